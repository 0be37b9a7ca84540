"""A chat prompt's rendering: with the tokenizer's own encoding (a cold prompt), each message
boundary's head is encoded from the prompt's ids and its last part (`Tokenizer.encode_head`)
instead of whole; the ids, boundaries and shared prefix are those of encoding each head
whole."""

from __future__ import annotations

import pytest

from ninfer.server.reading import validate
from ninfer.server.schemas import ChatRequest
from ninfer.server.submission import encode, render_chat
from ninfer.server.unified import from_chat

TOOL = {"type": "function", "function": {"name": "get_city", "description": "A city's facts.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}


def _request(messages, tools=None, thinking=False):
    body = {"model": "m", "messages": messages,
            "chat_template_kwargs": {"enable_thinking": thinking}}
    if tools:
        body["tools"] = tools
    return from_chat(validate(ChatRequest, body), default_budget=None)


CASES = [
    ([{"role": "user", "content": "hello " * 300}], None),
    ([{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "café 日本 😀"},
      {"role": "assistant", "content": "ok <think> not a tag here"},
      {"role": "user", "content": "  next\n\n"}], None),
    ([{"role": "user", "content": "Where is Zürich?"},
      {"role": "assistant", "content": "", "tool_calls": [{
          "id": "c1", "type": "function",
          "function": {"name": "get_city", "arguments": "{\"city\": \"Zürich\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "{\"country\": \"CH\"}"},
      {"role": "user", "content": "and Bern?"}], [TOOL]),
]


@pytest.mark.parametrize("messages,tools", CASES)
@pytest.mark.parametrize("thinking", [False, True])
def test_heads_from_the_prompts_ids_give_what_encoding_them_whole_gives(live, messages, tools,
                                                                       thinking):
    server = live.server
    request = _request(messages, tools, thinking)
    calls: list[str] = []

    def whole(text: str) -> list[int]:
        calls.append(text)
        return encode(server.tokenizer, text)

    slow = render_chat(server, request, whole)
    encoded_slow = sum(map(len, calls))
    calls.clear()
    fast = render_chat(server, request, whole, plain=True)
    assert fast == slow
    assert slow.boundaries   # (the case has boundaries to find)
    # the fast one encoded the prompt once and only heads' last parts besides
    assert calls == [slow.text] and encoded_slow > len(slow.text)


def test_a_long_cold_prompt_renders_off_the_event_loop(live, monkeypatch):
    """A cold prompt of RENDER_OFF_LOOP_CHARS or more is rendered and tokenized in a worker
    thread (the loop goes on streaming others' tokens); a short one, and any prompt read
    with a remembered conversation, on the loop itself. Either way it is answered."""
    import asyncio

    import httpx

    from ninfer.server import submission
    seen: list[tuple[bool, bool]] = []
    real = submission.render_chat

    def spy(server, request, encode_text, plain=False):
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        seen.append((on_loop, plain))
        return real(server, request, encode_text, plain)

    monkeypatch.setattr(submission, "render_chat", spy)
    monkeypatch.setattr(submission, "RENDER_OFF_LOOP_CHARS", 400)

    def ask(messages, session):
        r = httpx.post(f"{live.url}/v1/chat/completions", timeout=60,
                       headers={"X-Session-Id": session},
                       json={"model": live.server.settings.model_id, "messages": messages,
                             "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    long = [{"role": "user", "content": "tell me about trains " * 30}]   # 630 characters
    reply = ask(long, "render-off-loop")
    ask([{"role": "user", "content": "hi"}], "render-short")
    ask([*long, {"role": "assistant", "content": reply}, {"role": "user", "content": "more"}],
        "render-off-loop")
    assert seen == [(False, True), (True, True), (True, False)]
