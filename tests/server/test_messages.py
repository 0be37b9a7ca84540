"""The `anthropic` package as the client of the Messages API: `messages.create`,
`messages.stream(...).get_final_message()` and `messages.count_tokens`, with tool calls, tool
results sent back, thinking (its budget closed by the server), stop sequences, a cancel
mid-stream, reuse over three turns, session keys and model names."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time

import anthropic
import httpx
import pytest

from ninfer.server.parsing import THINK_CLOSE, THINK_OPEN
from ninfer.server.reasoning import CLOSE_TEXT

MODEL = "claude-sonnet-4-5"    # any claude-* name is served by the loaded model
SYSTEM = "You are a careful assistant for the weather office."
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
CALL = ['Checking.\n<tool', '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
        '\n</tool_call>']


@pytest.fixture
def client(live):
    with anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0) as c:
        yield c


def request_id(message) -> str:
    return message.id.removeprefix("msg_")


def outputs(live, rid: str) -> list[int]:
    return [t for k, d, _ in live.events(rid) if k == "TokensCommitted" for t in d["tokens"]]


def queued(live, rid: str) -> dict:
    return next(d for k, d, _ in live.events(rid) if k == "RequestQueued")


def check_usage(live, message) -> dict:
    """Usage as Anthropic counts it: input not read from the cache + read from it = the
    prompt; output = the tokens committed."""
    rid = request_id(message)
    kind, data, _ = live.wait_terminal(rid)
    assert kind in ("RequestFinished", "RequestCancelled")
    started = live.started(rid)
    usage = message.usage
    assert usage.cache_read_input_tokens == started["reuse_base"]
    assert usage.input_tokens + usage.cache_read_input_tokens == queued(live, rid)["prompt_len"]
    assert usage.output_tokens == len(outputs(live, rid))
    assert usage.cache_creation_input_tokens == 0
    return started


def test_create_with_a_tool_call_then_the_tool_result(live, client, scripted):
    scripted[:] = CALL
    one = client.messages.create(
        model=MODEL, max_tokens=12, system=SYSTEM, tools=TOOLS,
        messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert one.model == MODEL and one.stop_reason == "tool_use"
    assert [b.type for b in one.content] == ["text", "tool_use"]
    assert one.content[0].text == "Checking."
    call = one.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Oslo"}
    assert call.id.startswith("toolu_")
    check_usage(live, one)

    scripted[:] = ["It is sunny in Oslo."]
    two = client.messages.create(
        model=MODEL, max_tokens=12, system=SYSTEM, tools=TOOLS, messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [b.model_dump() for b in one.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id,
                 "content": [{"type": "text", "text": "sunny, 21 C"}]},
                {"type": "text", "text": "Thanks. Anything else?"}]}])
    assert two.stop_reason == "max_tokens" and two.content[0].text == "It is sunny in Oslo."
    prompt = live.server.tokenizer.decode(queued(live, request_id(two))["tokens"])
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert prompt.index("sunny, 21 C") < prompt.index("Thanks. Anything else?")
    check_usage(live, two)


def test_stream_final_message_with_thinking_and_a_tool_call(live, client, scripted):
    scripted[:] = ["Let me look", " it up.\n</think>\n\n", *CALL]
    with client.messages.stream(
            model=MODEL, max_tokens=12, tools=TOOLS,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "Let me look it up."
    assert final.content[0].signature
    assert final.content[1].text == "Checking."
    assert final.content[2].input == {"city": "Oslo"}
    assert final.stop_reason == "tool_use"
    check_usage(live, final)


@pytest.mark.parametrize("stream", [False, True])
def test_a_thinking_budget_is_closed_by_the_server(live, client, stream):
    """The random model never closes its reasoning: at the budget the server commits the
    template's close, and the model answers after it; nothing of the close shows."""
    kwargs = dict(model=MODEL, max_tokens=14, thinking={"type": "enabled", "budget_tokens": 4},
                  messages=[{"role": "user", "content": "Think briefly, then answer."}])
    if stream:
        with client.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    rid = request_id(message)
    live.wait_terminal(rid)
    params = queued(live, rid)["params"]
    close = live.server.tokenizer.encode(CLOSE_TEXT)
    assert params["reasoning_budget"] == 4 and params["reasoning_close"] == close
    out = outputs(live, rid)
    assert out[4:4 + len(close)] == close
    assert [b.type for b in message.content] == ["thinking", "text"]
    thinking, text = message.content[0].thinking, message.content[1].text
    assert thinking == live.server.tokenizer.decode(out[:4])
    for piece in (thinking, text):
        assert THINK_CLOSE not in piece and THINK_OPEN not in piece
    assert text and message.stop_reason == "max_tokens"


def test_thinking_adaptive_takes_the_effort_and_disabled_switches_it_off(live, client):
    adaptive = client.messages.create(
        model=MODEL, max_tokens=2, thinking={"type": "adaptive"},
        output_config={"effort": "low"}, messages=[{"role": "user", "content": "hi"}])
    assert queued(live, request_id(adaptive))["params"]["reasoning_budget"] == 1024
    with live.configured(reasoning_budget=7):
        default = client.messages.create(model=MODEL, max_tokens=2,
                                         thinking={"type": "adaptive"},
                                         messages=[{"role": "user", "content": "hi"}])
    assert queued(live, request_id(default))["params"]["reasoning_budget"] == 7
    for thinking in ({"type": "disabled"}, None):
        extra = {"thinking": thinking} if thinking else {}
        off = client.messages.create(model=MODEL, max_tokens=3,
                                     messages=[{"role": "user", "content": "hi"}], **extra)
        rid = request_id(off)
        live.wait_terminal(rid)
        prompt = live.server.tokenizer.decode(queued(live, rid)["tokens"])
        assert prompt.endswith(THINK_OPEN + "\n" + CLOSE_TEXT)  # the template's "off"
        assert "reasoning_budget" not in queued(live, rid)["params"]
        assert all(b.type == "text" for b in off.content)


def test_stop_sequences(live, client, scripted):
    scripted[:] = ["The answer", " is 42 STOP and more"]
    message = client.messages.create(model=MODEL, max_tokens=12, stop_sequences=["STOP", "42"],
                                     messages=[{"role": "user", "content": "Answer?"}])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "42"
    assert message.content[0].text == "The answer is "
    scripted[:] = ["one two", " STOP three"]
    with client.messages.stream(model=MODEL, max_tokens=12, stop_sequences=["STOP"],
                                messages=[{"role": "user", "content": "Count"}]) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "STOP")
    assert final.content[0].text == "one two "


def test_cancel_mid_stream(live, client):
    with live.configured(step_delay=0.05), client.messages.stream(
            model=MODEL, max_tokens=400, messages=[{"role": "user", "content": "Go on."}]) as s:
        for event in s:
            if event.type == "content_block_delta":
                rid = s.current_message_snapshot.id.removeprefix("msg_")
                break
    kind, data, _ = live.wait_terminal(rid)
    assert kind == "RequestCancelled" and data["at_state"] == "Active"
    assert len(outputs(live, rid)) < 400


def test_count_tokens_is_the_prompt_the_message_gets(live, client):
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, tools=TOOLS,
                                           messages=messages)
    message = client.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, tools=TOOLS,
                                     messages=messages)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    beta = client.beta.messages.count_tokens(model=MODEL, system=SYSTEM, tools=TOOLS,
                                             messages=messages)
    assert beta.input_tokens == counted.input_tokens


def test_three_turns_reuse_the_previous_prompt_and_output(live, client):
    """Each turn reads from the cache the whole previous turn, prompt and output (all but
    the last output token, whose state is never computed), thinking included."""
    history = [{"role": "user", "content": "What is the weather in Bergen?"}]
    previous = None
    for n in range(3):
        message = client.messages.create(
            model=MODEL, max_tokens=10, system=SYSTEM, messages=history,
            thinking={"type": "enabled", "budget_tokens": 3},
            metadata={"user_id": "three-turns"})
        started = check_usage(live, message)
        if previous is not None:
            assert started["plan"] == "PrivateEndpoint"
            assert message.usage.cache_read_input_tokens == (
                previous.usage.input_tokens + previous.usage.cache_read_input_tokens
                + previous.usage.output_tokens - 1)
        history += [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                    {"role": "user", "content": f"And on day {n + 2}?"}]
        previous = message


def conversation(live, rid: str) -> str | None:
    with contextlib.closing(sqlite3.connect(f"file:{live.journal_path}?mode=ro",
                                            uri=True)) as db:
        return db.execute("SELECT conversation FROM events WHERE request = ? AND kind = "
                          "'RequestQueued'", (rid,)).fetchone()[0]


def test_session_keys_in_order(live, client):
    """X-Session-Id, then session_id, then metadata.user_id, then the derived key."""
    def key(**kwargs) -> str | None:
        m = client.messages.create(model=MODEL, max_tokens=1,
                                   messages=[{"role": "user", "content": "key?"}], **kwargs)
        live.wait_terminal(request_id(m))
        return conversation(live, request_id(m))

    meta = {"user_id": '{"session_id": "abc"}'}
    assert key(metadata=meta, extra_headers={"X-Session-Id": "h"}) == "id-h"
    assert key(metadata=meta, extra_body={"session_id": "b"}) == "id-b"
    assert key(metadata=meta) == 'user-{"session_id": "abc"}'
    assert key().startswith("derived-")
    with live.configured(derive_session_keys=False):
        assert key() is None


def test_a_mid_conversation_system_message_joins_the_leading_system_prompt(live, client):
    m = client.messages.create(model=MODEL, max_tokens=1, system="First rules.", messages=[
        {"role": "user", "content": "hello"},
        {"role": "system", "content": "Later rules."},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"}])
    prompt = live.server.tokenizer.decode(queued(live, request_id(m))["tokens"])
    assert prompt.startswith("<|im_start|>system\nFirst rules.\n\nLater rules.<|im_end|>\n")
    assert prompt.count("<|im_start|>system") == 1


def test_server_tools_are_dropped_with_one_warning(live, client, caplog):
    with caplog.at_level(logging.WARNING, logger="ninfer.server"):
        m = client.messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "search?"}],
            tools=[*TOOLS, {"type": "web_search_20250305", "name": "web_search"},
                   {"type": "bash_20250124", "name": "bash"}],
            tool_choice={"type": "auto"})
    lines = [r.getMessage() for r in caplog.records if "built-in tools" in r.getMessage()]
    assert lines == ["messages: built-in tools this server does not run were dropped: "
                     "web_search_20250305, bash_20250124"]
    prompt = live.server.tokenizer.decode(queued(live, request_id(m))["tokens"])
    assert "get_weather" in prompt and "web_search" not in prompt


def test_model_names_headers_and_keys(live):
    body = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "whatever-2099-01-01,x"}

    def post(model, extra=None, path="/v1/messages?beta=true"):
        return httpx.post(live.url + path, json={**body, "model": model},
                          headers={**headers, **(extra or {})}, timeout=60)

    assert post(live.server.settings.model_id).status_code == 200
    assert post("claude-haiku-4-5").status_code == 200
    assert post("gpt-4o").status_code == 404
    with live.configured(claude_names=False, model_aliases=("house-model",)):
        assert post("claude-haiku-4-5").status_code == 404
        assert post("house-model").status_code == 200
    with live.configured(api_keys=("key-a",)):
        assert post(MODEL).status_code == 401
        assert post(MODEL, {"x-api-key": "key-a"}).status_code == 200
        assert post(MODEL, {"Authorization": "Bearer key-a"}).status_code == 200
        assert post(MODEL, {"x-api-key": "key-b"}).json()["error"]["type"] == \
            "authentication_error"


def test_pings_while_a_long_prompt_prefills(live):
    """Chunks of 48 tokens, a step every 0.2 s: the prefill takes seconds, and the client
    hears `ping` every keep-alive interval (0.5 s) until the first block starts."""
    text = " ".join(f"line {i}: the daily report shows stable temperature." for i in range(40))
    with live.configured(step_delay=0.2), httpx.stream("POST", live.url + "/v1/messages", json={
            "model": MODEL, "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": text}]}, timeout=120) as r:
        names, started = [], time.monotonic()
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
    assert names[0] == "message_start"
    first_block = names.index("content_block_start")
    assert names[1:first_block].count("ping") >= 2
    assert set(names[1:first_block]) == {"ping"}
    assert time.monotonic() - started > 1.0


def test_count_tokens_of_a_conversation_with_tools_thinking_and_results(live, client):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
            {"type": "tool_use", "id": "toolu_9", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                      "content": "sunny"}]}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, tools=TOOLS,
                                           messages=messages,
                                           thinking={"type": "enabled", "budget_tokens": 1024})
    message = client.messages.create(model=MODEL, max_tokens=1, system=SYSTEM, tools=TOOLS,
                                     messages=messages,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    assert counted.input_tokens == (message.usage.input_tokens
                                    + message.usage.cache_read_input_tokens)
    prompt = live.server.tokenizer.decode(queued(live, request_id(message))["tokens"])
    assert "<think>\nUse the tool.\n</think>" in prompt and "sunny" in prompt


def test_a_create_the_client_gives_up_on_is_cancelled(live, client):
    before = {r for r, in _requests(live)}
    # greedy: a sampled answer (Anthropic's default temperature is 1) may stop on its own
    # before the client's second is up
    with live.configured(step_delay=0.1), pytest.raises(anthropic.APITimeoutError):
        client.with_options(timeout=1.0).messages.create(
            model=MODEL, max_tokens=400, extra_body={"temperature": 0.0},
            messages=[{"role": "user", "content": "Go on."}])
    rid, = {r for r, in _requests(live)} - before
    kind, data, _ = live.wait_terminal(rid)
    assert kind == "RequestCancelled" and len(outputs(live, rid)) < 400


def _requests(live):
    with contextlib.closing(sqlite3.connect(f"file:{live.journal_path}?mode=ro",
                                            uri=True)) as db:
        return db.execute("SELECT request FROM events WHERE kind = 'RequestQueued' AND "
                          "request NOT LIKE 'warmup-%'").fetchall()


def test_a_model_alias_serves_chat_completions_too(live):
    with live.configured(model_aliases=("house-model",)):
        r = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
            "model": "house-model", "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
