"""The `openai` package as the client: chat and text completions, streaming and not, usage,
timings, reuse across turns, session keys, tenant isolation, tool calls."""

from __future__ import annotations

import openai
import pytest

from ninfer.server.parsing import CALL_CLOSE

MODEL = "tiny-qwen3-next-v1"
SYSTEM = {"role": "system", "content": "You are a careful assistant for the weather office."}


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def check_usage(live, response_id: str, usage, timings: dict | None = None):
    request_id = response_id.split("-", 1)[1]
    kind, data, _ = live.wait_terminal(request_id)
    assert kind == "RequestFinished"
    started = live.started(request_id)
    assert usage.prompt_tokens_details.cached_tokens == started["reuse_base"]
    assert usage.prompt_tokens == data["prompt_tokens"]
    assert usage.completion_tokens == data["completion_tokens"]
    if timings is not None:
        assert timings["cache_n"] == started["reuse_base"]
        assert timings["cache_n"] + timings["prompt_n"] == usage.prompt_tokens
        assert timings["predicted_n"] == usage.completion_tokens
    return started


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_non_streaming(live, client):
    r = client.chat.completions.create(model=MODEL, messages=[SYSTEM, {
        "role": "user", "content": "Hello!"}], max_tokens=3, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 3
    check_usage(live, r.id, r.usage, r.model_extra["timings"])


def test_chat_streaming_with_usage(live, client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Stream please"}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    check_usage(live, chunks[-1].id, chunks[-1].usage, chunks[-1].model_extra["timings"])


def test_completions(live, client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3,
                                  temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 3
    check_usage(live, r.id, r.usage, r.model_extra["timings"])
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=2,
                                            temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def turn(client, messages, max_tokens=4, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
        reasoning_effort="none", **extra)


def assistant_of(r) -> dict:
    m = r.choices[0].message
    out = {"role": "assistant", "content": m.content or ""}
    if (m.model_extra or {}).get("reasoning_content"):
        out["reasoning_content"] = m.model_extra["reasoning_content"]
    return out


def test_second_turn_reuses_the_first(live, client):
    """The whole previous turn (prompt and output but its last token) is reused, even where
    the random model's output ids are not the tokenizer's encoding of their text; a different
    salt or key (another tenant) reuses nothing of it."""
    headers = {"X-Session-Id": "reuse-1"}
    first_messages = [SYSTEM, {"role": "user", "content": "What is the weather in Oslo?"}]
    one = turn(client, first_messages, max_tokens=40, extra_headers=headers)
    tok = live.server.tokenizer
    output = [e for k, d, _ in live.events(one.id.split("-", 1)[1]) if k == "TokensCommitted"
              for e in d["tokens"]]
    assert tok.encode(tok.decode(output)) != output  # the case re-encoding would lose
    check_usage(live, one.id, one.usage)
    history = [*first_messages, assistant_of(one),
               {"role": "user", "content": "And tomorrow?"}]
    two = turn(client, history, max_tokens=40, extra_headers=headers)
    started = check_usage(live, two.id, two.usage, two.model_extra["timings"])
    assert started["plan"] == "PrivateEndpoint"
    assert two.usage.prompt_tokens_details.cached_tokens == (
        one.usage.prompt_tokens + one.usage.completion_tokens - 1)

    salted = turn(client, history, extra_headers=headers, extra_body={"cache_salt": "other"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    with live.configured(api_keys=("key-a", "key-b")):
        keyed = client.with_options(api_key="key-b").chat.completions.create(
            model=MODEL, messages=history, max_tokens=2, extra_headers=headers)
        assert keyed.usage.prompt_tokens_details.cached_tokens == 0


def test_session_from_body_and_derived(live, client):
    messages = [SYSTEM, {"role": "user", "content": "Derive my session, please."}]
    one = turn(client, messages, extra_body={"session_id": "body-1"})
    history = [*messages, assistant_of(one), {"role": "user", "content": "Again."}]
    two = turn(client, history, extra_body={"session_id": "body-1"})
    assert two.usage.prompt_tokens_details.cached_tokens > one.usage.prompt_tokens
    messages = [SYSTEM, {"role": "user", "content": "A derived conversation."}]
    one = turn(client, messages)  # derived by default
    history = [*messages, assistant_of(one), {"role": "user", "content": "More."}]
    two = turn(client, history)
    assert two.usage.prompt_tokens_details.cached_tokens > one.usage.prompt_tokens
    # without a key (none derived), only the shared prefix (system prompt) can be reused
    with live.configured(derive_session_keys=False):
        three = turn(client, [*history, assistant_of(two), {"role": "user", "content": "x"}])
    assert live.started(three.id.split("-", 1)[1])["plan"] in ("SharedPrefix", "Root")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = ['Checking.\n<tool', '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
        '\n</tool_call>', "END"]


def test_tool_calls_streamed_and_whole(live, client, scripted):
    scripted[:] = ["Let me look", " it up.\n</think>\n\n", *CALL]
    r = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS, max_tokens=12,
        stop=["END"])
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert message.model_extra["reasoning_content"] == "Let me look it up."
    assert message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')]

    scripted[:] = ["ok\n</think>\n\n", *CALL]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"},
                               {"role": "assistant", "content": None,
                                "tool_calls": [{"id": "c1", "type": "function", "function": {
                                    "name": "get_weather", "arguments": "{}"}}]},
                               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        tools=TOOLS, max_tokens=12, stop=["END"], stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [
        (0, "get_weather", '{"city": "Oslo"}')]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert CALL_CLOSE not in text and text == "Checking."


def test_reasoning_effort_none_gives_plain_content(live, client, scripted):
    scripted[:] = ["plain answer"]
    r = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "hi"}], max_tokens=3, reasoning_effort="none")
    assert r.choices[0].message.content == "plain answer"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


def test_repetition_penalty_reaches_the_request_and_changes_its_tokens(live, client):
    """vLLM's `repetition_penalty` (not OpenAI's) is taken, journaled with the request's
    parameters, and applied. The random model's greedy reply rarely picks a token it has
    seen, which a penalty above 1 pushes down; one below 1 pulls seen tokens up (a positive
    logit divided by 0.05), so the reply changes."""
    messages = [{"role": "user", "content": "Repeat after me: la la la la la"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           temperature=0, reasoning_effort="none")
    penalised = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, reasoning_effort="none",
        extra_body={"repetition_penalty": 0.05})
    queued = [d for k, d, _ in live.events(penalised.id.split("-", 1)[1])
              if k == "RequestQueued"]
    assert queued[0]["params"]["repetition_penalty"] == 0.05
    tokens = {}
    for name, r in (("plain", plain), ("penalised", penalised)):
        tokens[name] = [t for k, d, _ in live.events(r.id.split("-", 1)[1])
                        if k == "TokensCommitted" for t in d["tokens"]]
    assert tokens["plain"] != tokens["penalised"]
    prompt = set(queued[0]["tokens"])
    assert sum(t in prompt for t in tokens["penalised"]) > sum(t in prompt
                                                               for t in tokens["plain"])


def test_stop_token_ids_end_the_reply_and_ignore_eos_drops_end_of_text(live, client):
    """vLLM's `stop_token_ids` end a reply at the first of them (hidden from its text, as
    end-of-text is), not before `min_tokens` outputs; `ignore_eos` leaves the model's
    end-of-text ids out of the stops."""
    def tokens(r):
        return [t for k, d, _ in live.events(r.id.split("-", 1)[1]) if k == "TokensCommitted"
                for t in d["tokens"]]

    def stops(r):
        queued = [d for k, d, _ in live.events(r.id.split("-", 1)[1]) if k == "RequestQueued"]
        return set(queued[0]["params"]["stop_tokens"])

    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                      temperature=0)
    out = tokens(plain)
    cut = next(i for i, t in enumerate(out) if t not in out[:i] and i >= 2)
    stopped = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                        temperature=0, extra_body={"stop_token_ids": [out[cut]]})
    assert tokens(stopped) == out[:cut + 1]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == live.server.tokenizer.decode(out[:cut])
    held = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                     temperature=0, extra_body={"stop_token_ids": [out[cut]],
                                                                "min_tokens": cut + 2})
    assert len(tokens(held)) >= cut + 2 and out[cut] not in tokens(held)[:cut + 2]
    assert tokens(held)[:cut] == out[:cut]
    eos = stops(plain)
    assert eos and out[cut] not in eos
    free = client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [7]})
    assert stops(free) == {7}


def test_logprobs(live, client):
    # greedy: a sampled reply may draw the end-of-text token first (an unseeded draw once
    # did in CI) and end after one token
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3, logprobs=True, top_logprobs=2,
                                       temperature=0)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True,
        temperature=0, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert len(streamed) == 3 and all(e.top_logprobs == [] for e in streamed)
    text = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, logprobs=3,
                                     temperature=0)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 2 and len(lp.top_logprobs[0]) <= 3
    plain = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "x"}], max_tokens=2)
    assert plain.choices[0].logprobs is None
