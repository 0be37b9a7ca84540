"""Response bodies on the wire, non-streamed and every streamed chunk, checked against the
`openai` package's types in strict mode (no coercion: an int where a float belongs, a
string for a number, fails).

The openai types accept unknown fields, so strict validation alone would let any extra
field through. Each body is therefore validated as a copy without this server's documented
extensions (`timings` beside `usage`, `reasoning_content` in a message or delta), the
validated model must then hold no unknown field anywhere and dump back to exactly that copy,
and the extensions are asserted on their own.

One deviation is the openai types', not ours: `CompletionChoice.finish_reason` is not
optional, though a streamed text completion sends null in every chunk but the last, as the
OpenAI API does. Such a chunk is checked to hold null there, and validated with the field
set to "stop"."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from openai import BaseModel as OpenAIModel
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from .test_openai import CALL, MODEL, TOOLS

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
TIMING_FIELDS = ("cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                 "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second")


def no_unknown_fields(value, path: str = "") -> None:
    if isinstance(value, OpenAIModel):
        assert not value.model_extra, f"{path}: fields the openai types lack: {value.model_extra}"
        for name in type(value).model_fields:
            no_unknown_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            no_unknown_fields(item, f"{path}[{i}]")


def strictly(kind: type[OpenAIModel], body: dict) -> dict:
    """`body` without its extensions, validated strictly as `kind`; returns the extensions
    found ({"timings": ..., "reasoning_content": [...]})."""
    plain = copy.deepcopy(body)
    found: dict = {"reasoning_content": []}
    if "timings" in plain:
        found["timings"] = plain.pop("timings")
    for choice in plain["choices"]:
        inner = choice.get("message", choice.get("delta", {}))
        if "reasoning_content" in inner:
            found["reasoning_content"].append(inner.pop("reasoning_content"))
    checked = copy.deepcopy(plain)
    if kind is Completion:
        for choice in checked["choices"]:
            if choice["finish_reason"] is None:   # see the module's docstring
                choice["finish_reason"] = "stop"
    model = kind.model_validate(checked, strict=True)
    no_unknown_fields(model)
    assert model.model_dump(mode="json", exclude_unset=True) == checked
    return found


def check_timings(timings: dict, usage: dict) -> None:
    assert list(timings) == list(TIMING_FIELDS)
    for name in TIMING_FIELDS:
        assert type(timings[name]) is (int if name.endswith("_n") else float), name
    assert timings["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["cache_n"] + timings["prompt_n"] == usage["prompt_tokens"]
    assert timings["predicted_n"] == usage["completion_tokens"]


def chunks_of(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [e for e in response.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def post(live, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + path, json={"model": MODEL, **body}, timeout=60)


def test_chat_body_with_reasoning_tool_calls_and_logprobs(live, scripted):
    scripted[:] = ["Let me look", " it up.\n</think>\n\n", *CALL]
    body = post(live, CHAT, {"messages": [{"role": "user", "content": "Weather in Oslo?"}],
                             "tools": TOOLS, "max_tokens": 12, "stop": ["END"],
                             "logprobs": True, "top_logprobs": 2}).json()
    found = strictly(ChatCompletion, body)
    assert found["reasoning_content"] == ["Let me look it up."]
    check_timings(found["timings"], body["usage"])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    entries = choice["logprobs"]["content"]
    assert len(entries) == body["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in entries)


def test_chat_body_plain(live, scripted):
    scripted[:] = ["plain answer"]
    body = post(live, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                             "reasoning_effort": "none"}).json()
    found = strictly(ChatCompletion, body)
    assert found["reasoning_content"] == []   # written only when there is some
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "plain answer"}
    assert body["choices"][0]["logprobs"] is None and body["system_fingerprint"] is None


@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_chunks_with_reasoning_tool_calls_and_usage(live, scripted, logprobs):
    scripted[:] = ["Let me look", " it up.\n</think>\n\n", *CALL]
    extra = {"logprobs": True, "top_logprobs": 1} if logprobs else {}
    chunks = chunks_of(post(live, CHAT, {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
        "max_tokens": 12, "stop": ["END"], "stream": True,
        "stream_options": {"include_usage": True}, **extra}))
    reasoning, calls, entries = [], [], []
    for chunk in chunks:
        found = strictly(ChatCompletionChunk, chunk)
        reasoning += found["reasoning_content"]
        for choice in chunk["choices"]:
            calls += choice["delta"].get("tool_calls", [])
            entries += (choice["logprobs"] or {}).get("content", [])
        assert ("timings" in found) == (chunk is chunks[-1])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(reasoning) == "Let me look it up."
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == [chunks[-2]] and finish[0]["choices"][0]["finish_reason"] == "tool_calls"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    check_timings(usage_chunk["timings"], usage_chunk["usage"])
    if logprobs:
        assert len(entries) == usage_chunk["usage"]["completion_tokens"]
    else:
        assert entries == [] and all(c["choices"][0]["logprobs"] is None
                                     for c in chunks[:-1])


def test_text_body_with_logprobs(live):
    body = post(live, TEXT, {"prompt": "Once upon a time", "max_tokens": 3, "logprobs": 2,
                             "temperature": 0}).json()
    found = strictly(Completion, body)
    check_timings(found["timings"], body["usage"])
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 3
    assert all(len(top) <= 2 for top in lp["top_logprobs"])


def test_text_chunks_with_logprobs_and_usage(live):
    chunks = chunks_of(post(live, TEXT, {
        "prompt": "Once upon a time", "max_tokens": 4, "logprobs": 1, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}))
    tokens = []
    for chunk in chunks:
        found = strictly(Completion, chunk)
        assert ("timings" in found) == (chunk is chunks[-1])
        for choice in chunk["choices"]:
            tokens += choice["logprobs"]["tokens"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert reasons[-1] in ("stop", "length") and set(reasons[:-1]) <= {None}
    assert chunks[-1]["choices"] == []
    check_timings(chunks[-1]["timings"], chunks[-1]["usage"])
    assert len(tokens) == chunks[-1]["usage"]["completion_tokens"]
