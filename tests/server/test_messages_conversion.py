"""The one conversion of a Messages request into the request type underneath
(messages_api.to_unified): what each block, field and setting becomes, without a server; and
the same conversation sent as a chat completion converts to the same messages and tools."""

from __future__ import annotations

import pytest

from ninfer.server.errors import ApiError
from ninfer.server.formats import AskedFormat
from ninfer.server.messages_api import CountTokensRequest, MessagesRequest, to_unified
from ninfer.server.reply_grammar import OutputFormat
from ninfer.server.schemas import ChatRequest
from ninfer.server.sessions import KeySource
from ninfer.server.submission import request_session_key
from ninfer.server.unified import Sampling, from_chat

TOOL = {"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"}}


def convert(default_budget=None, **body):
    body = {"model": "claude-x", "max_tokens": 5, **body}
    return to_unified(MessagesRequest.model_validate(body), default_budget=default_budget)


def templated(turn) -> list[dict]:
    return turn.request.template_messages()


def test_a_whole_conversation():
    turn = convert(
        system=[{"type": "text", "text": "Rules.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "More rules."}],
        tools=[TOOL],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                         {"type": "text", "text": "there",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "They greet.", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "data"}]},
                {"type": "text", "text": "And now?"}]},
            {"role": "system", "content": "Late rules."}])
    assert templated(turn) == [
        {"role": "system", "content": "Rules.\nMore rules.\n\nLate rules."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "They greet.",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "no data", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "And now?"}]
    assert [t.name for t in turn.request.tools] == ["get_weather"]
    assert turn.request.tools[0].parameters == TOOL["input_schema"]
    assert turn.dropped_tools == ()
    assert turn.request.merge_system and turn.request.instructions() == [
        "Rules.\nMore rules.\n\nLate rules."]


def test_the_same_conversation_as_a_chat_completion_converts_to_the_same_request():
    """What the template renders, the derived session key's inputs and the tools are the
    chat completion's: a conversation reuses as much whichever API continues it."""
    messages = convert(system="Be brief.", tools=[TOOL], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                      "content": "sun"}]}]).request
    chat = from_chat(ChatRequest.model_validate({
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": "Checking.", "reasoning_content": "hm",
                      "tool_calls": [{"id": "c1", "type": "function", "function": {
                          "name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sun"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather for a city",
            "parameters": TOOL["input_schema"]}}]}), default_budget=None)
    assert messages.template_messages() == chat.template_messages()
    assert messages.template_tools() == chat.template_tools()
    assert request_session_key({}, messages, derive=True) == request_session_key(
        {}, chat, derive=True)


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, "get_weather")])
def test_tool_choice(choice, expected):
    request = convert(tools=[TOOL], tool_choice=choice,
                      messages=[{"role": "user", "content": "x"}]).request
    assert request.tool_choice == expected
    assert request.parses_tools == (expected != "none")


@pytest.mark.parametrize("choice,parallel", [
    ({"type": "any"}, None), ({"type": "any", "disable_parallel_tool_use": True}, False),
    ({"type": "auto", "disable_parallel_tool_use": False}, True), ({"type": "none"}, None)])
def test_disable_parallel_tool_use_and_strict_tools(choice, parallel):
    request = convert(tools=[TOOL, dict(TOOL, name="strict_one", strict=True)],
                      tool_choice=choice, messages=[{"role": "user", "content": "x"}]).request
    assert request.parallel_tool_calls is parallel
    assert [t.strict for t in request.tools] == [None, True]


def test_output_config_format_is_the_answer_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = convert(output_config={"format": {"type": "json_schema", "schema": schema}},
                      messages=[{"role": "user", "content": "x"}]).request
    assert request.answer == AskedFormat(OutputFormat("json_schema", schema, False),
                                         "output_config.format")
    assert convert(messages=[{"role": "user", "content": "x"}]).request.answer is None


def test_built_in_tools_are_dropped_and_tool_choice_goes_with_them():
    turn = convert(tools=[{"type": "web_search_20250305", "name": "web_search"}],
                   tool_choice={"type": "auto"}, messages=[{"role": "user", "content": "x"}])
    assert turn.request.tools == () and turn.request.tool_choice is None
    assert turn.dropped_tools == ("web_search_20250305",)


@pytest.mark.parametrize("thinking,effort,expected", [
    (None, None, (False, None)),
    ({"type": "disabled"}, "high", (False, None)),
    ({"type": "enabled", "budget_tokens": 2048}, None, (True, 2048)),
    ({"type": "adaptive"}, None, (True, 77)),          # the server's default
    ({"type": "adaptive"}, "medium", (True, 4096)),
    ({"type": "adaptive"}, "max", (True, None)),
])
def test_thinking_and_effort(thinking, effort, expected):
    extra = {}
    if thinking is not None:
        extra["thinking"] = thinking
    if effort is not None:
        extra["output_config"] = {"effort": effort}
    turn = convert(default_budget=77, messages=[{"role": "user", "content": "x"}], **extra)
    assert (turn.request.reasoning, turn.request.reasoning_budget) == expected


def test_sampling_fields_stops_session_sources_and_salt():
    request = convert(temperature=0.3, top_p=0.9, top_k=20, stop_sequences=["A", "B", "C", "D",
                                                                            "E"],
                      stream=True, metadata={"user_id": "u"}, session_id="s", cache_salt="c",
                      messages=[{"role": "user", "content": "x"}]).request
    assert request.sampling == Sampling(max_tokens=5, fit_to_context=True, temperature=0.3,
                                        top_p=0.9, top_k=20, stop=("A", "B", "C", "D", "E"))
    assert request.key_sources == (KeySource("id", "s"), KeySource("user", "u"))
    assert request.derive_key and request.cache_salt == "c" and request.model is None
    assert request.route == "anthropic-messages"


def test_a_token_count_needs_no_max_tokens():
    turn = to_unified(CountTokensRequest.model_validate({
        "model": "claude-x", "messages": [{"role": "user", "content": "x"}]}),
        default_budget=None)
    assert turn.request.sampling == Sampling() and turn.request.first_user() == "x"


@pytest.mark.parametrize("messages,says", [
    ([{"role": "user", "content": [{"type": "document"}]}], "document content"),
    ([{"role": "assistant", "content": "hi"}], "last message"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}], "tool_result block"),
    ([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "x"}],
     "image content"),
])
def test_what_cannot_be_served_is_a_400(messages, says):
    with pytest.raises(ApiError) as caught:
        convert(messages=messages)
    assert caught.value.status == 400 and says in caught.value.message


def test_a_tool_name_anthropic_allows_is_served_as_named():
    """Anthropic's names run to 128 characters (chat completions' to 64): the request keeps
    the name the client gave."""
    request = convert(tools=[{**TOOL, "name": "x" * 100}],
                      tool_choice={"type": "tool", "name": "x" * 100},
                      messages=[{"role": "user", "content": "x"}]).request
    assert request.template_tools()[0]["function"]["name"] == "x" * 100
    assert request.tool_choice == "x" * 100
