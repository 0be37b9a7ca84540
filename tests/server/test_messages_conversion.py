"""The one conversion of a Messages request into a chat request (messages_api.to_chat): what
each block, field and setting becomes, without a server."""

from __future__ import annotations

import pytest

from ninfer.server.errors import ApiError
from ninfer.server.messages_api import CountTokensRequest, MessagesRequest, to_chat

TOOL = {"name": "get_weather", "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"}}


def convert(default_budget=None, **body):
    body = {"model": "claude-x", "max_tokens": 5, **body}
    return to_chat(MessagesRequest.model_validate(body), default_budget=default_budget)


def templated(turn) -> list[dict]:
    return [m.for_template() for m in turn.chat.messages]


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
    assert [t.function.name for t in turn.chat.tools] == ["get_weather"]
    assert turn.chat.tools[0].function.parameters == TOOL["input_schema"]
    assert turn.dropped_tools == ()


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, "get_weather")])
def test_tool_choice(choice, expected):
    chat = convert(tools=[TOOL], tool_choice=choice,
                   messages=[{"role": "user", "content": "x"}]).chat
    got = chat.tool_choice if isinstance(chat.tool_choice, str) else \
        chat.tool_choice.function["name"]
    assert got == expected


def test_built_in_tools_are_dropped_and_tool_choice_goes_with_them():
    turn = convert(tools=[{"type": "web_search_20250305", "name": "web_search"}],
                   tool_choice={"type": "auto"}, messages=[{"role": "user", "content": "x"}])
    assert turn.chat.tools is None and turn.chat.tool_choice is None
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
    assert (turn.chat.enable_thinking(), turn.reasoning_budget) == expected


def test_sampling_fields_and_stops():
    chat = convert(temperature=0.3, top_p=0.9, top_k=20, stop_sequences=["A", "B"],
                   stream=True, metadata={"user_id": "u"}, session_id="s", cache_salt="c",
                   messages=[{"role": "user", "content": "x"}]).chat
    assert (chat.temperature, chat.top_p, chat.top_k, chat.stop, chat.stream) == (
        0.3, 0.9, 20, ["A", "B"], True)
    assert (chat.max_tokens, chat.session_id, chat.cache_salt) == (5, "s", "c")


def test_a_token_count_needs_no_max_tokens():
    turn = to_chat(CountTokensRequest.model_validate({
        "model": "claude-x", "messages": [{"role": "user", "content": "x"}]}),
        default_budget=None)
    assert turn.chat.max_tokens is None and turn.chat.messages[0].content == "x"


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


def test_a_value_chat_completions_refuses_is_a_400_in_words():
    with pytest.raises(ApiError, match="cannot be served: tools"):
        convert(tools=[{**TOOL, "name": "x" * 100}], messages=[{"role": "user", "content": "x"}])
