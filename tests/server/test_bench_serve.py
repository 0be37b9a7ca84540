"""`ninfer bench serve`'s Responses API client measures what its chat client measures: the
time to the first text delta, the total, and the usage in chat's terms, for the same prompt
and greedy output (so the two decode rates compare like for like)."""

from __future__ import annotations

from ninfer.bench.serve import _stream, _stream_responses


def test_the_responses_client_measures_like_the_chat_client(live):
    messages = [{"role": "user", "content": "A bench prompt of a few words."}]
    chat = _stream(live.url, {"messages": messages, "max_tokens": 6, "temperature": 0,
                              "reasoning_effort": "none"})
    responses = _stream_responses(live.url, {"input": messages, "max_output_tokens": 6,
                                             "temperature": 0, "reasoning": {"effort": "none"}})
    assert responses["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"] == 6
    assert responses["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    for run in (chat, responses):
        assert 0 < run["ttft"] < run["total"]
