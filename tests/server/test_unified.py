"""The one request type underneath, without a server: chat completions and the Responses API
convert to the same UnifiedRequest messages; input items fold into model turns; pinned spans
encode as their ids; sealed reasoning round-trips and is refused quietly when foreign; every
API carries its answer format with the field it came from."""

from __future__ import annotations

from ninfer.server.formats import AskedFormat
from ninfer.server.reply_grammar import OutputFormat
from ninfer.server.responses_api import reasoning_switch, to_unified
from ninfer.server.responses_schema import ResponsesRequest
from ninfer.server.responses_stream import custom_input
from ninfer.server.schemas import ChatRequest, CompletionRequest
from ninfer.server.sealed_reasoning import reasoning_span, seal, unseal
from ninfer.server.submission import pinned_encoder
from ninfer.server.unified import (
    ChatMessage,
    PinnedText,
    ToolCallRecord,
    from_chat,
    from_completion,
)


def responses(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate(fields)


def convert(body: ResponsesRequest, decode=lambda ids: "".join(map(chr, ids))):
    return to_unified(body, model="m", vocab_size=1000, decode=decode, default_budget=None)


def test_chat_and_responses_convert_to_the_same_messages_and_tools():
    chat = from_chat(ChatRequest.model_validate({
        "messages": [{"role": "system", "content": "Be brief.\n\nUse tools."},
                     {"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": "Checking.", "reasoning_content": "hm",
                      "tool_calls": [{"id": "c1", "type": "function", "function": {
                          "name": "w", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sun"}],
        "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}]}),
        default_budget=None)
    resp = convert(responses(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                           "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sun"}],
        tools=[{"type": "function", "name": "w", "parameters": {}}])).request
    assert resp.template_messages() == chat.template_messages()
    assert resp.template_tools() == chat.template_tools()
    assert resp.instructions() == chat.instructions() and resp.first_user() == "Weather?"


def test_every_api_carries_its_answer_format_and_the_field_it_came_from():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = from_chat(ChatRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": 2, "3": -1.5},
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "n", "schema": schema, "strict": True}}}),
        default_budget=None)
    assert chat.answer == AskedFormat(OutputFormat("json_schema", schema, True),
                                      "response_format")
    assert chat.logit_bias == ((3, -1.5), (7, 2.0))
    completion = from_completion(CompletionRequest.model_validate(
        {"prompt": "x", "guided_choice": ["a", "b"]}))
    assert completion.answer == AskedFormat(OutputFormat("choice", ("a", "b")), "guided_choice")
    assert completion.logit_bias == ()
    resp = convert(responses(input="x", text={"format": {
        "type": "json_schema", "name": "n", "schema": schema}})).request
    assert resp.answer == AskedFormat(OutputFormat("json_schema", schema, False), "text.format")
    assert convert(responses(input="x", text={"format": {"type": "json_object"}})).request \
        .answer == AskedFormat(OutputFormat("json_object"), "text.format")
    assert convert(responses(input="x", text={"format": {"type": "text"}})).request.answer \
        is None


def test_items_fold_into_model_turns():
    request = convert(responses(input=[
        {"role": "user", "content": "go"},
        {"type": "reasoning", "summary": []},                    # nothing to render: no-op
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "b", "name": "patch", "input": "x"},
        {"role": "assistant", "content": "after the calls"},     # a turn of its own
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                           "text": "r"}]},
        {"role": "assistant", "content": "answer"},
        {"role": "system", "content": "late instructions"}])).request
    assert [m.role for m in request.messages] == ["user", "assistant", "assistant",
                                                  "assistant", "system"]
    calls = request.messages[1].tool_calls
    assert calls == (ToolCallRecord("a", "f", "{}"), ToolCallRecord("b", "patch",
                                                                    '{"input": "x"}'))
    assert request.messages[2] == ChatMessage("assistant", "after the calls")
    assert request.messages[3] == ChatMessage("assistant", "answer", reasoning="r")
    # the system message merged first, as instructions
    assert request.template_messages()[0] == {"role": "system", "content": "late instructions"}


def test_custom_and_namespaced_tools_as_the_model_sees_them():
    converted = convert(responses(input="x", tools=[
        {"type": "custom", "name": "patch", "description": "Edit"},
        {"type": "namespace", "name": "fs", "description": "", "tools": [
            {"type": "function", "name": "read"}]},
        {"type": "web_search"}]))
    names = [t.name for t in converted.request.tools]
    assert names == ["patch", "fs.read"]
    assert converted.request.tools[0].parameters["required"] == ["input"]
    assert converted.tools["fs.read"] == ("function", "read", "fs")
    assert converted.tools["patch"].kind == "custom"


def test_reasoning_effort_is_the_thinking_switch():
    assert [reasoning_switch(e) for e in (None, "none", "low", "high")] == [
        None, False, True, True]
    assert convert(responses(input="x", reasoning={"effort": "none"})).request.reasoning is False


def test_custom_input_from_the_arguments_written():
    assert custom_input('{"input": "a\\nb"}') == "a\nb"
    assert custom_input('{"patch": "p"}') == "p"             # one string argument, any name
    assert custom_input('{"a": 1, "b": 2}') == '{"a": 1, "b": 2}'
    assert custom_input("not json") == "not json"


def test_pinned_spans_encode_as_their_ids():
    def encode(text):
        return [ord(c) for c in text]

    pinned = pinned_encoder(encode, [PinnedText("think", (1, 2)), PinnedText("absent", (9,))])
    assert pinned("<a>think</a>") == [*encode("<a>"), 1, 2, *encode("</a>")]
    assert pinned("no span here") == encode("no span here")
    assert pinned_encoder(encode, []) is encode


def test_sealed_reasoning_round_trips_and_refuses_quietly():
    blob = seal("m", "the reasoning", [5, 6, 7])
    assert unseal(blob, "m", 1000) == ("the reasoning", (5, 6, 7))
    assert unseal(blob, "other-model", 1000) == ("the reasoning", ())   # ids dropped
    assert unseal(blob, "m", 6) == ("the reasoning", ())               # out of vocabulary
    assert unseal("gAAAAB-openai-blob", "m", 1000) is None
    assert unseal(blob[:-4] + "!!!!", "m", 1000) is None


def test_sealed_reasoning_is_pinned_where_it_renders():
    def decode(ids):
        return "".join(chr(96 + i) for i in ids)   # 1 -> a, 2 -> b, ...

    blob = seal("m", "ab", [1, 2])
    request = convert(responses(input=[
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "encrypted_content": blob},
        {"role": "user", "content": "again"}]), decode=decode).request
    assert request.pinned == (PinnedText("ab", (1, 2)),)
    assert request.messages[1] == ChatMessage("assistant", reasoning="ab")


def test_the_reasoning_span_ends_with_the_closing_tag():
    vocab = {1: "think", 2: "ing\n", 3: "</think>", 4: "\n\nhi", 0: ""}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    assert reasoning_span([1, 2, 3, 4, 4], decode, frozenset({0})) == (1, 2, 3)
    assert reasoning_span([1, 2, 0], decode, frozenset({0})) == (1, 2)   # never closed
