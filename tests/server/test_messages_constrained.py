"""Constrained output on Anthropic's Messages API, through the `anthropic` package, on the live
server's random tiny model: `output_config.format` holds the answer to its JSON schema (after
thinking closed at its budget when thinking is on), and `tool_choice` any / tool force
well-formed `tool_use` blocks, on the same path underneath as every other API."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from .test_constrained import PERSON, journaled

MODEL = "claude-sonnet-4-5"
WEATHER = {"name": "get_weather", "description": "Weather for a city", "input_schema": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
TIME = {"name": "get_time", "description": "The time", "input_schema": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
FORMAT = {"format": {"type": "json_schema", "schema": PERSON}}
GREEDY = {"temperature": 0}   # (the package's create has no temperature any more)


@pytest.fixture
def client(live):
    with anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0) as c:
        yield c


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_a_json_schema_answer_validates(client):
    message = client.messages.create(model=MODEL, max_tokens=400, messages=ASK,
                                     extra_body=GREEDY, output_config=FORMAT)
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(message)), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_closed_at_a_small_budget_then_the_answer_validates(live, client, stream):
    """Thinking on with a budget of 8: the server closes the thinking at its budget, the
    grammar holds from there, and the answer is a valid document."""
    fields = dict(model=MODEL, max_tokens=400, messages=ASK, extra_body=GREEDY,
                  output_config=FORMAT, thinking={"type": "enabled", "budget_tokens": 8})
    if stream:
        with client.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**fields)
    params, tokens = journaled(live, message.id.removeprefix("msg_"))
    close = params["reasoning_close"]
    assert params["reasoning_budget"] == 8 and tokens[8:8 + len(close)] == close
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(message)), PERSON)


def test_tool_choice_any_always_yields_valid_tool_use(client):
    """Sampled, so a different reply each time: tool_use blocks and nothing else, each
    valid; in parallel the model may go on calling until max_tokens cuts it: the whole
    calls still end the message as tool_use (the client runs them), and the call cut short
    is left as text (`messages_stream.MessagesShape.stop`). This test once asked for no
    text with tool_use whatever cut the reply, and failed when a sample ran long."""
    for disable in (False, False, True, True):
        message = client.messages.create(
            model=MODEL, max_tokens=200, extra_body={"temperature": 1.0}, tools=[WEATHER, TIME],
            tool_choice={"type": "any", "disable_parallel_tool_use": disable},
            messages=[{"role": "user", "content": "What is the weather?"}])
        calls = [b for b in message.content if b.type == "tool_use"]
        assert calls
        for call in calls:
            jsonschema.validate(call.input, SCHEMAS[call.name])
        if disable:
            assert len(calls) == 1 and message.stop_reason == "tool_use"
        if message.stop_reason == "tool_use":
            cut = message.usage.output_tokens >= 200
            assert text_of(message) == "" or cut and text_of(message).startswith("<tool_call>")
        else:
            assert message.stop_reason == "max_tokens"
            assert text_of(message) == "" or text_of(message).startswith("<tool_call>")


def test_a_named_tool_is_called_once_without_parallel_use(client):
    message = client.messages.create(
        model=MODEL, max_tokens=200, extra_body=GREEDY, tools=[WEATHER, TIME],
        tool_choice={"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Time?"}])
    [call] = [b for b in message.content if b.type == "tool_use"]
    assert call.name == "get_time" and call.input["zone"] in ("utc", "local")
    assert message.stop_reason == "tool_use"
