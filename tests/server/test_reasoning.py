"""Reasoning budgets: the effort table, the server's default (`--reasoning-budget`), the close
the server commits at the budget, and the answer after it parsed and streamed as usual
(nothing of the close in the reasoning or the content), through chat completions and the
Responses API here (the Messages API's `budget_tokens`: test_messages.py). Each API names its
budget in its own fields; the one path underneath enforces it."""

from __future__ import annotations

import json

import httpx
import pytest

from ninfer.lifecycle.request import SamplingParams
from ninfer.server.parsing import THINK_CLOSE, THINK_OPEN
from ninfer.server.reasoning import CLOSE_TEXT, EFFORT_BUDGETS, bounded, budget_for_effort

CHAT = "/v1/chat/completions"
MODEL = "tiny-qwen3-next-v1"


def test_the_effort_table():
    assert [budget_for_effort(e, 99) for e in ("none", "minimal", "low", "medium", "high",
                                               "xhigh", "max")] == [
        0, 256, 1024, 4096, 16_384, 32_768, None]
    assert budget_for_effort(None, 99) == 99 and budget_for_effort(None, None) is None
    assert set(EFFORT_BUDGETS) == {"none", "minimal", "low", "medium", "high", "xhigh", "max"}
    with pytest.raises(ValueError, match="unknown reasoning effort"):
        budget_for_effort("extreme", None)


def test_bounded_needs_an_end_of_thinking_token(live):
    tokenizer = live.server.tokenizer
    params = bounded(SamplingParams(), 5, tokenizer)
    assert params.reasoning_budget == 5 and params.reasoning_end == tokenizer.special.think_end
    assert tokenizer.decode(list(params.reasoning_close)) == CLOSE_TEXT
    assert bounded(SamplingParams(), None, tokenizer) == SamplingParams()


def journaled(live, rid: str) -> tuple[dict, list[int]]:
    live.wait_terminal(rid)
    events = live.events(rid)
    params = next(d for k, d, _ in events if k == "RequestQueued")["params"]
    return params, [t for k, d, _ in events if k == "TokensCommitted" for t in d["tokens"]]


def chat(live, **body) -> httpx.Response:
    return httpx.post(live.url + CHAT, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Think, then answer."}],
        "temperature": 0, **body})


@pytest.mark.parametrize("stream", [False, True])
def test_the_servers_default_budget_closes_the_reasoning(live, stream):
    close = live.server.tokenizer.encode(CLOSE_TEXT)
    with live.configured(reasoning_budget=3):
        r = chat(live, max_tokens=12, stream=stream)
    rid = r.headers["x-request-id"]
    params, out = journaled(live, rid)
    assert params["reasoning_budget"] == 3 and params["reasoning_close"] == close
    assert out[3:3 + len(close)] == close
    if stream:
        deltas = [json.loads(line[6:])["choices"] for line in r.text.splitlines()
                  if line.startswith("data: {")]
        pieces = [c[0]["delta"] for c in deltas if c]
        reasoning = "".join(p.get("reasoning_content", "") for p in pieces)
        content = "".join(p.get("content") or "" for p in pieces)
    else:
        message = r.json()["choices"][0]["message"]
        reasoning, content = message["reasoning_content"], message["content"]
    assert reasoning == live.server.tokenizer.decode(out[:3])
    assert content and content == live.server.tokenizer.decode(out[3 + len(close):])
    for text in (reasoning, content):
        assert THINK_CLOSE not in text and THINK_OPEN not in text


def test_reasoning_effort_names_the_budget(live):
    with live.configured(reasoning_budget=3):
        low = chat(live, max_tokens=2, reasoning_effort="low")
        off = chat(live, max_tokens=2, reasoning_effort="none")
    assert journaled(live, low.headers["x-request-id"])[0]["reasoning_budget"] == 1024
    # thinking off: the template closed the block, there is nothing to budget
    assert "reasoning_budget" not in journaled(live, off.headers["x-request-id"])[0]
    plain = chat(live, max_tokens=2)
    assert "reasoning_budget" not in journaled(live, plain.headers["x-request-id"])[0]


def responses(live, **body) -> httpx.Response:
    return httpx.post(live.url + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": "Think, then answer.", "temperature": 0, **body})


@pytest.mark.parametrize("stream", [False, True])
def test_the_responses_api_closes_the_reasoning_at_its_budget(live, stream):
    """Its effort names no budget here, so the server's default binds; the answer follows the
    close as an output_text part."""
    close = live.server.tokenizer.encode(CLOSE_TEXT)
    with live.configured(reasoning_budget=3):
        r = responses(live, max_output_tokens=12, stream=stream)
    params, out = journaled(live, r.headers["x-request-id"])
    assert params["reasoning_budget"] == 3 and out[3:3 + len(close)] == close
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        reasoning = "".join(e["delta"] for e in events
                            if e["type"] == "response.reasoning_text.delta")
        content = "".join(e["delta"] for e in events
                          if e["type"] == "response.output_text.delta")
    else:
        output = r.json()["output"]
        reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning"
                            for p in item["content"])
        content = "".join(p["text"] for item in output if item["type"] == "message"
                          for p in item["content"])
    assert reasoning == live.server.tokenizer.decode(out[:3])
    assert content and content == live.server.tokenizer.decode(out[3 + len(close):])
    for text in (reasoning, content):
        assert THINK_CLOSE not in text and THINK_OPEN not in text


def test_the_responses_apis_effort_names_the_budget(live):
    def budget(effort: str) -> int | None:
        with live.configured(reasoning_budget=3):
            r = responses(live, max_output_tokens=2, reasoning={"effort": effort})
        return journaled(live, r.headers["x-request-id"])[0].get("reasoning_budget")

    assert budget("low") == 1024 and budget("xhigh") == 32_768
    assert budget("max") is None       # no budget, whatever the server's default
    assert budget("none") is None      # thinking off: nothing to budget
