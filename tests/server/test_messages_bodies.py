"""Messages API bodies on the wire, whole messages, every stream event and every error,
checked against the `anthropic` package's types in strict mode: no coercion, no field the
types lack (they accept unknown fields, so the validated model must hold none), and the
model dumps back to exactly the body sent."""

from __future__ import annotations

import json

import httpx
import pytest
from anthropic import BaseModel as AnthropicModel
from anthropic.types import (
    Message,
    MessageTokensCount,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
)
from anthropic.types.shared import ErrorResponse

from .test_messages import CALL, MODEL, TOOLS

MESSAGES = "/v1/messages"
EVENTS = {"message_start": RawMessageStartEvent, "message_delta": RawMessageDeltaEvent,
          "message_stop": RawMessageStopEvent, "content_block_start": RawContentBlockStartEvent,
          "content_block_delta": RawContentBlockDeltaEvent,
          "content_block_stop": RawContentBlockStopEvent, "error": ErrorResponse}


def no_unknown_fields(value, path: str = "") -> None:
    if isinstance(value, AnthropicModel):
        assert not value.model_extra, f"{path}: fields the types lack: {value.model_extra}"
        for name in type(value).model_fields:
            no_unknown_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            no_unknown_fields(item, f"{path}[{i}]")


def strictly(kind: type[AnthropicModel], body: dict):
    model = kind.model_validate(body, strict=True)
    no_unknown_fields(model)
    assert model.model_dump(mode="json", exclude_unset=True) == body
    return model


def events_of(response: httpx.Response) -> list[tuple[str, dict]]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix(
            "data: "))
        assert data["type"] == name
        out.append((name, data))
    return out


def post(live, body: dict, path: str = MESSAGES, **kw) -> httpx.Response:
    return httpx.post(live.url + path, json={"model": MODEL, **body}, timeout=60, **kw)


def test_whole_message_with_thinking_text_and_a_tool_call(live, scripted):
    scripted[:] = ["Let me look", " it up.\n</think>\n\n", *CALL]
    body = post(live, {"max_tokens": 12, "tools": TOOLS,
                       "thinking": {"type": "enabled", "budget_tokens": 2000},
                       "messages": [{"role": "user", "content": "Weather in Oslo?"}]}).json()
    message = strictly(Message, body)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert set(body["usage"]) == {"input_tokens", "output_tokens", "cache_read_input_tokens",
                                  "cache_creation_input_tokens"}


def test_every_stream_event(live, scripted):
    scripted[:] = ["Let me look", " it up.\n</think>\n\n", *CALL]
    events = events_of(post(live, {
        "max_tokens": 12, "tools": TOOLS, "stream": True,
        "thinking": {"type": "enabled", "budget_tokens": 2000},
        "messages": [{"role": "user", "content": "Weather in Oslo?"}]}))
    names = [n for n, _ in events]
    for name, data in events:
        if name == "ping":
            assert data == {"type": "ping"}
        else:
            strictly(EVENTS[name], data)
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    blocks: dict[int, dict] = {}
    for name, data in events:
        if name == "content_block_start":
            blocks[data["index"]] = {"start": data["content_block"], "deltas": []}
        elif name == "content_block_delta":
            blocks[data["index"]]["deltas"].append(data["delta"])
    assert sorted(blocks) == [0, 1, 2]
    thinking, text, tool = blocks[0], blocks[1], blocks[2]
    assert [d["type"] for d in thinking["deltas"]][-1] == "signature_delta"
    assert "".join(d.get("thinking", "") for d in thinking["deltas"]) == "Let me look it up."
    assert "".join(d["text"] for d in text["deltas"]) == "Checking."
    assert tool["start"]["type"] == "tool_use" and tool["start"]["input"] == {}
    partial = "".join(d["partial_json"] for d in tool["deltas"])
    assert json.loads(partial) == {"city": "Oslo"}
    # each block opens, gets its deltas and stops before the next one opens
    order = [(n, d.get("index")) for n, d in events if n.startswith("content_block")]
    for i in range(3):
        mine = [n for n, idx in order if idx == i]
        assert mine[0] == "content_block_start" and mine[-1] == "content_block_stop"
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["output_tokens"] > 0


def test_token_count_body(live):
    body = post(live, {"messages": [{"role": "user", "content": "count me"}]},
                "/v1/messages/count_tokens?beta=true").json()
    strictly(MessageTokensCount, body)
    assert body["input_tokens"] > 0


def check_error(response: httpx.Response, status: int, kind: str = "invalid_request_error",
                says: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = strictly(ErrorResponse, response.json())
    assert error.type == "error" and error.error.type == kind
    if says is not None:
        assert says in error.error.message, error.error.message
    return error.error.message


OK = [{"role": "user", "content": "hello"}]
BAD = [
    ("max_tokens missing", {"messages": OK}, "max_tokens"),
    ("max_tokens a string", {"messages": OK, "max_tokens": "12"}, "max_tokens"),
    ("max_tokens zero", {"messages": OK, "max_tokens": 0}, "max_tokens"),
    ("empty messages", {"messages": [], "max_tokens": 2}, "messages"),
    ("unknown role", {"messages": [{"role": "tool", "content": "x"}], "max_tokens": 2},
     "role"),
    ("content a number", {"messages": [{"role": "user", "content": 3}], "max_tokens": 2},
     "content"),
    ("unknown block", {"messages": [{"role": "user", "content": [{"type": "video"}]}],
                       "max_tokens": 2}, "video"),
    ("temperature above one", {"messages": OK, "max_tokens": 2, "temperature": 1.5},
     "temperature"),
    ("stream not a bool", {"messages": OK, "max_tokens": 2, "stream": "yes"}, "stream"),
    ("image", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}], "max_tokens": 2},
     "image content is not supported"),
    ("image in a tool result", {"messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {}}]}]}], "max_tokens": 2},
     "image content is not supported"),
    ("final assistant message", {"messages": [*OK, {"role": "assistant", "content": "Sure"}],
                                 "max_tokens": 2}, "last message"),
    ("only system messages", {"messages": [{"role": "system", "content": "rules"}],
                              "max_tokens": 2}, "user message"),
    ("tool_use in a user message", {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}], "max_tokens": 2},
     "tool_use block"),
    ("tool without a schema", {"messages": OK, "max_tokens": 2, "tools": [{"name": "f"}]},
     "input_schema"),
    ("tool_choice names no tool", {"messages": OK, "max_tokens": 2, "tools": TOOLS,
                                   "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ("tool_choice any without tools", {"messages": OK, "max_tokens": 2,
                                       "tool_choice": {"type": "any"}}, "any"),
    ("negative budget", {"messages": OK, "max_tokens": 2,
                         "thinking": {"type": "enabled", "budget_tokens": -1}}, "budget"),
    ("unknown thinking type", {"messages": OK, "max_tokens": 2,
                               "thinking": {"type": "sometimes"}}, "thinking"),
    ("format without a schema", {"messages": OK, "max_tokens": 2,
                                 "output_config": {"format": {"type": "json_schema"}}},
     "format"),
    ("format of an unknown type", {"messages": OK, "max_tokens": 2,
                                   "output_config": {"format": {"type": "yaml"}}}, "format"),
    ("format schema that does not compile", {
        "messages": OK, "max_tokens": 2,
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "strin"}}}},
     "strin"),
    ("forced tool and a format", {
        "messages": OK, "max_tokens": 2, "tools": TOOLS, "tool_choice": {"type": "any"},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "no room"),
]


@pytest.mark.parametrize("name,body,says", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_in_anthropics_shape(live, name, body, says):
    check_error(post(live, body), 400, says=says)


def test_bad_raw_bodies_oversize_and_unknown_models(live):
    url = live.url + MESSAGES
    check_error(httpx.post(url, content=b'{"messages": [', headers={
        "content-type": "application/json"}), 400, says="malformed JSON")
    check_error(httpx.post(url, content=b"[1]", headers={"content-type": "application/json"}),
                400)
    check_error(httpx.post(url, content=b"{}", headers={"content-type": "text/plain"}), 400)
    with live.configured(max_body_bytes=2000):
        big = {"max_tokens": 2, "messages": [{"role": "user", "content": "x" * 5000}]}
        check_error(post(live, big), 413, says="over 2,000 bytes")
    check_error(post(live, {"model": "gpt-4o", "max_tokens": 2, "messages": OK}), 404,
                "not_found_error", "gpt-4o")
    check_error(httpx.get(url), 405)
    check_error(httpx.put(live.url + "/v1/messages/count_tokens"), 405)


def test_an_overlong_prompt_says_so_in_the_words_clients_look_for(live):
    text = "word " * 3000
    for path in (MESSAGES, MESSAGES + "?beta=true"):
        message = check_error(post(live, {"max_tokens": 2, "messages": [
            {"role": "user", "content": text}]}, path), 400)
        prompt, limit = message.removeprefix("prompt is too long: ").split(" tokens > ")
        assert int(prompt) > int(limit.removesuffix(" maximum")) == \
            live.server.settings.max_context - 2


def test_a_large_max_tokens_is_lowered_to_what_the_context_leaves(live):
    body = post(live, {"max_tokens": 64_000, "messages": OK}).json()
    strictly(Message, body)   # served, not refused (Claude Code asks for up to 64K)
    with live.configured(max_context=body["usage"]["input_tokens"]
                         + body["usage"]["cache_read_input_tokens"] + 4):
        body = post(live, {"max_tokens": 64_000, "messages": OK}).json()
    assert body["usage"]["output_tokens"] == 3
    assert body["stop_reason"] == "model_context_window_exceeded"


def test_a_failure_after_the_stream_started_is_an_error_event(live, monkeypatch):
    """The engine fails the request mid-stream: the stream ends with Anthropic's error event
    (never a 5xx once the headers are out)."""
    from ninfer.lifecycle import events as ev
    from ninfer.server.generation import Generation

    real = Generation.absorb

    def failing(self, event):
        if isinstance(event, ev.TokensCommitted) and self.completion_tokens >= 1:
            event = ev.RequestFailed(seq=0, time=event.time, request=self.id,
                                     conversation=None, failure="internal", message="boom")
        return real(self, event)

    monkeypatch.setattr(Generation, "absorb", failing)
    events = events_of(post(live, {"max_tokens": 20, "stream": True, "messages": OK}))
    name, data = events[-1]
    assert name == "error"
    strictly(ErrorResponse, data)
    assert data["error"]["type"] == "api_error"
