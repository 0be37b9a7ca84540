"""Tokens ready together share one SSE event: while the server's event loop is held (the
engine goes on committing), every token committed meanwhile reaches the client as one text
delta (one `delta.content` chunk, one `response.output_text.delta`, one
`content_block_delta`) once the loop runs again, and the text the `openai` and `anthropic`
clients reassemble equals the whole (non-streamed) reply's. Deterministic: the loop is held
until the request has ended, whatever the machine's speed."""

from __future__ import annotations

import threading

import anthropic
import openai
import pytest

from ninfer.server import handoff
from ninfer.server.parsing import Delta, ParsedCall, merged

PROMPT = [{"role": "user", "content": "Write about the harbour in a few sentences."}]
MAX_TOKENS = 24
MODEL = "tiny-qwen3-next-v1"


def commits(live, rid: str) -> int:
    return sum(1 for k, _, _ in live.events(rid) if k == "TokensCommitted")


def hold_until_ended(live, rid: str) -> int:
    """Hold the server's event loop until request `rid` has ended and its events were
    handed over, then let it go; the number of its commits journaled when the hold began."""
    [loop] = [x for x in list(handoff._HANDOFFS) if x.is_running()]
    entered, gate = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(30)
    loop.call_soon_threadsafe(hold)
    assert entered.wait(10)
    try:
        before = commits(live, rid)
        live.wait_terminal(rid, 30)
        live.server.thread.call(lambda engine: None).result(10)  # its events handed over
        return before
    finally:
        gate.set()


class Counted:
    """Text deltas of one stream: how many, the text, and the commits before the hold."""

    def __init__(self) -> None:
        self.deltas, self.text, self.before = 0, "", None

    def add(self, text: str) -> None:
        self.deltas += 1
        self.text += text


def check(live, rid: str, counted: Counted, whole: str) -> None:
    assert counted.text == whole
    held = commits(live, rid) - counted.before
    assert held >= 2, "the test needs several commits while the loop was held"
    # every delta before the hold carried at least one commit; after it, one delta
    assert counted.deltas <= counted.before + 1


def test_chat_completions_coalesce(live):
    body = dict(model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"reasoning_effort": "none"})
    counted = Counted()
    with live.configured(step_delay=0.02), \
            openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as c:
        whole = c.chat.completions.create(**body).choices[0].message.content
        for chunk in c.chat.completions.create(**body, stream=True):
            rid = chunk.id.removeprefix("chatcmpl-")
            content = chunk.choices[0].delta.content if chunk.choices else None
            if content:
                counted.add(content)
                if counted.before is None:
                    counted.before = hold_until_ended(live, rid)
    check(live, rid, counted, whole)


def test_responses_coalesce(live):
    body = dict(model=MODEL, input=PROMPT, max_output_tokens=MAX_TOKENS, temperature=0,
                reasoning={"effort": "none"})
    counted = Counted()
    with live.configured(step_delay=0.02), \
            openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as c:
        whole = c.responses.create(**body).output_text
        for event in c.responses.create(**body, stream=True):
            if event.type == "response.created":
                rid = event.response.id.removeprefix("resp_")
            if event.type == "response.output_text.delta":
                counted.add(event.delta)
                if counted.before is None:
                    counted.before = hold_until_ended(live, rid)
    check(live, rid, counted, whole)


def test_messages_coalesce(live):
    body = dict(model="claude-sonnet-4-5", messages=PROMPT, max_tokens=MAX_TOKENS,
                thinking={"type": "disabled"}, extra_body={"temperature": 0})
    counted = Counted()
    with live.configured(step_delay=0.02), \
            anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0) as c:
        whole = "".join(b.text for b in c.messages.create(**body).content if b.type == "text")
        for event in c.messages.create(**body, stream=True):
            if event.type == "message_start":
                rid = event.message.id.removeprefix("msg_")
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                counted.add(event.delta.text)
                if counted.before is None:
                    counted.before = hold_until_ended(live, rid)
    check(live, rid, counted, whole)


@pytest.mark.parametrize("deltas, expected", [
    ([Delta("content", "a"), Delta("content", "b")], [Delta("content", "ab")]),
    ([Delta("reasoning", "r"), Delta("reasoning", "s"), Delta("content", "c")],
     [Delta("reasoning", "rs"), Delta("content", "c")]),
    ([Delta("content", "a"), Delta("tool_call", call=ParsedCall("c1", "f", "{}")),
      Delta("tool_call", call=ParsedCall("c2", "f", "{}")), Delta("content", "b")],
     [Delta("content", "a"), Delta("tool_call", call=ParsedCall("c1", "f", "{}")),
      Delta("tool_call", call=ParsedCall("c2", "f", "{}")), Delta("content", "b")]),
])
def test_merged_joins_text_of_one_kind_and_keeps_calls_apart(deltas, expected):
    assert merged(deltas) == expected
