"""An internal failure fails that request only: 500 before the stream starts, an error event
in the stream after it, RequestFailed in the journal, and the server keeps serving. Long
prefills stream keep-alive comments."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = "/v1/chat/completions"


@pytest.fixture
def broken_prefill(live, monkeypatch):
    """The engine's prefill step raises a state-part error for prompts containing 'BREAK'."""
    engine = live.engine
    marker = live.server.tokenizer.encode(" BREAK")
    original = engine._prefill_step

    def prefill(lane_live, limit=None, parts=False):
        prompt = lane_live.request.prompt
        n = len(marker)
        if any(tuple(prompt[i:i + n]) == tuple(marker) for i in range(len(prompt) - n + 1)):
            raise KeyError("injected: a state part is missing")
        return original(lane_live, limit, parts)

    monkeypatch.setattr(engine, "_prefill_step", prefill)


def test_internal_failure_fails_one_request_only(live, broken_prefill):
    body = {"max_tokens": 3, "messages": [{"role": "user", "content": "please BREAK now"}]}
    r = httpx.post(live.url + CHAT, json=body, timeout=20)
    assert r.status_code == 500
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    kind, data, _ = live.wait_terminal(r.headers["x-request-id"])
    assert kind == "RequestFailed" and data["failure"] == "internal"

    with httpx.stream("POST", live.url + CHAT, json={**body, "stream": True}, timeout=20) as s:
        assert s.status_code == 200  # the request had started: the error comes in the stream
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])
    assert set(error) == {"error"} and error["error"]["code"] == "internal_error"

    ok = httpx.post(live.url + CHAT, json={**body, "messages": [
        {"role": "user", "content": "all fine"}]}, timeout=20)
    assert ok.status_code == 200
    assert httpx.get(live.url + "/health").status_code == 200


def test_keepalive_comments_during_a_long_prefill(live):
    body = {"stream": True, "max_tokens": 2, "messages": [
        {"role": "user", "content": " ".join(f"item {i}" for i in range(100))}]}
    with live.configured(step_delay=0.25, keepalive_s=0.2):
        with httpx.stream("POST", live.url + CHAT, json=body, timeout=20) as s:
            lines = list(s.iter_lines())
    data = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    assert '"role": "assistant"' in lines[data[0]]
    assert ": keep-alive" in lines[data[0]:data[1]]  # between the role chunk and the first token
    assert lines[data[-1]] == "data: [DONE]"


def test_a_responses_stream_that_fails_ends_with_response_failed(live, broken_prefill):
    from .responses_helpers import events_of, strict_event

    body = {"max_output_tokens": 3, "input": "please BREAK now"}
    r = httpx.post(live.url + "/v1/responses", json=body, timeout=20)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    events = events_of(httpx.post(live.url + "/v1/responses", json={**body, "stream": True},
                                  timeout=20))
    for event in events:
        strict_event(event)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    ok = httpx.post(live.url + "/v1/responses", json={**body, "input": "all fine"}, timeout=20)
    assert ok.status_code == 200
