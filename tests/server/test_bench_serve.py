"""`ninfer bench serve`'s Responses API and Messages API clients measure what its chat client
measures: the time to the first text delta, the total, and the usage in chat's terms, for the
same prompt and greedy output (so the decode rates compare like for like)."""

from __future__ import annotations

from ninfer.bench.serve import _stream, _stream_messages, _stream_responses
from ninfer.bench.serve_streams import _clients, _gaps


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


def test_the_messages_client_measures_like_the_chat_client(live):
    messages = [{"role": "user", "content": "A bench prompt of a few words."}]
    chat = _stream(live.url, {"messages": messages, "max_tokens": 6, "temperature": 0,
                              "reasoning_effort": "none"})
    anthropic = _stream_messages(live.url, {
        "model": "claude-bench", "messages": messages, "max_tokens": 6, "temperature": 0,
        "thinking": {"type": "disabled"}})
    assert anthropic["usage"]["completion_tokens"] == chat["usage"]["completion_tokens"] == 6
    assert anthropic["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert 0 < anthropic["ttft"] < anthropic["total"]


def test_gaps_during_a_window_are_those_that_overlap_it():
    arrivals = [0.0, 1.0, 2.0, 5.0, 6.0, 6.5]
    assert _gaps(arrivals) == [3.0, 1.0, 0.5]            # the stream's first two left out
    assert _gaps(arrivals, (2.5, 5.5)) == [3.0, 1.0]     # 2→5 spans the start, 5→6 the end


def test_the_streams_together_share_one_client_and_count_every_token(live):
    bodies = [{"messages": [{"role": "user", "content": f"Stream {i} of a bench batch."}],
               "max_tokens": 5, "temperature": 0, "reasoning_effort": "none"} for i in range(3)]
    seconds, tokens, chunks = _clients(live.url, bodies)
    assert seconds > 0
    assert tokens == 15
    assert 3 <= chunks <= tokens
