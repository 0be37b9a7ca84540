"""The Responses API through the `openai` package: `client.responses.create` and
`client.responses.stream(...)`, tool calls and their results sent back, reasoning and its
sealed `encrypted_content`, cancels mid-stream, reuse across turns (the same as through chat
completions, to the token), the stateless fields, and bad input in OpenAI's error shape."""

from __future__ import annotations

import contextlib
import json
import sqlite3

import httpx
import openai
import pytest
from openai.types.responses.response_create_params import ResponseCreateParamsBase

from ninfer.server.history import History

from .responses_helpers import (
    CONTEXT_CODE,
    MODEL,
    events_of,
    output_tokens,
    queued_tokens,
    request_id,
    strict_event,
)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": False}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
INSTRUCTIONS = "You are the forecaster of a small harbour: answer in one line."


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_create_with_usage_from_the_journal(live, client):
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=3,
                                temperature=0, reasoning={"effort": "none"}, store=False)
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text
    kind, data, _ = live.wait_terminal(request_id(r.id))
    assert kind == "RequestFinished"
    assert r.usage.input_tokens == data["prompt_tokens"]
    assert r.usage.output_tokens == data["completion_tokens"] == 3
    assert r.usage.input_tokens_details.cached_tokens == live.started(
        request_id(r.id))["reuse_base"]
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_tool_call_then_its_result_sent_back(live, client, ends_at_once):
    ends_at_once[:] = ["Let me look", " it up.\n</think>\n\n", "Checking.\n", CALL]
    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=[
        {"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, {"type": "web_search"}],
        max_output_tokens=8, include=["reasoning.encrypted_content"])
    assert first.status == "completed"
    reasoning, message, call = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me look it up."
    assert reasoning.encrypted_content and reasoning.summary == []
    assert message.content[0].text == "Checking."
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather",
                                                      '{"city": "Oslo"}')
    assert [t.type for t in first.tools] == ["function"]   # web_search dropped

    ends_at_once[:] = ["ok\n</think>\n\n", "Sunny in Oslo."]
    with client.responses.stream(model=MODEL, instructions=INSTRUCTIONS, input=[
            {"role": "user", "content": "Weather in Oslo?"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
            tools=[WEATHER], max_output_tokens=8) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "Sunny in Oslo."
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" in kinds
    prompt = live.server.tokenizer.decode(queued_tokens(live, final.id))
    # the call and its result rendered in the model's own markup, the instructions first
    assert prompt.startswith("<|im_start|>system\n" + INSTRUCTIONS)
    assert CALL in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_custom_and_namespaced_tools(live, client, ends_at_once):
    namespace = {"type": "namespace", "name": "files", "description": "File tools",
                 "tools": [{"type": "function", "name": "read", "parameters": {
                     "type": "object", "properties": {"path": {"type": "string"}}}}]}
    patch = "*** Begin Patch\n*** End Patch"
    ends_at_once[:] = ["\n</think>\n\n", '<tool_call>\n{"name": "apply_patch", "arguments": ',
                       json.dumps({"input": patch}), "}\n</tool_call>\n",
                       '<tool_call>\n{"name": "files.read", "arguments": {"path": "a.py"}}',
                       "\n</tool_call>"]
    events = []
    with client.responses.stream(model=MODEL, input="Fix a.py", tools=[PATCH, namespace],
                                 max_output_tokens=8) as stream:
        events = list(stream)
        final = stream.get_final_response()
    custom, namespaced = final.output
    assert (custom.type, custom.name, custom.input) == ("custom_tool_call", "apply_patch", patch)
    assert (namespaced.type, namespaced.namespace, namespaced.name) == (
        "function_call", "files", "read")
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == patch
    # the custom tool is presented as a function of one string, its grammar described
    prompt = live.server.tokenizer.decode(queued_tokens(live, final.id))
    assert '"name": "apply_patch"' in prompt and "start: /.+/" in prompt
    assert '"name": "files.read"' in prompt
    # sent back, both render as the calls the model wrote
    ends_at_once[:] = ["done"]
    again = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Fix a.py"},
        {"type": "reasoning", "summary": []},   # no content: a no-op
        *[item.model_dump(exclude_none=True) for item in final.output],
        {"type": "custom_tool_call_output", "call_id": custom.call_id, "output": "applied"},
        {"type": "function_call_output", "call_id": namespaced.call_id, "output": [
            {"type": "input_text", "text": "print(1)"}]}],
        tools=[PATCH, namespace], max_output_tokens=4)
    prompt = live.server.tokenizer.decode(queued_tokens(live, again.id))
    assert json.dumps({"input": patch}) in prompt and '{"path": "a.py"}' in prompt
    assert "applied" in prompt and "print(1)" in prompt


def test_the_responses_api_has_no_stop_sequences(live, client):
    """The Responses API has no `stop` (its SDK's parameters lack one, and the Codex CLI
    sends none): the reply ends at the model's end-of-text or an output limit. A `stop`
    field sent anyway is an unknown field, ignored like any other."""
    assert "stop" not in ResponseCreateParamsBase.__annotations__
    r = client.responses.create(model=MODEL, input="Count", max_output_tokens=4,
                                reasoning={"effort": "none"}, extra_body={"stop": ["a"]})
    assert r.usage.output_tokens == 4


def test_cancel_mid_stream(live, client):
    """Leaving `client.responses.stream(...)` after two text deltas closes the connection: the
    engine cancels the request, and the server stays whole."""
    with live.configured(step_delay=0.05):
        with client.responses.stream(model=MODEL, input="Tell me a long story",
                                     max_output_tokens=200) as stream:
            deltas = 0
            for event in stream:
                if event.type == "response.created":
                    response_id = event.response.id
                deltas += event.type.endswith("_text.delta")
                if deltas == 2:
                    break
    kind, data, _ = live.wait_terminal(request_id(response_id))
    assert kind == "RequestCancelled" and data["completion_tokens"] < 200
    live.integrity()


def _assistant_items(response) -> list[dict]:
    return [item.model_dump(exclude_none=True) for item in response.output]


def test_three_turns_reuse_the_whole_previous_turn(live, client):
    """Turns 2 and 3 reuse the previous prompt and output (but the output's last token, whose
    state is computed only when the next token is), as through chat completions; the
    conversation is named by prompt_cache_key."""
    history: list = [{"role": "user", "content": "What is the weather in Oslo?"}]
    previous = None
    for turn in range(3):
        r = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=history,
                                    max_output_tokens=24, temperature=0,
                                    prompt_cache_key="three-turns",
                                    include=["reasoning.encrypted_content"])
        assert r.status == "incomplete"
        started = live.started(request_id(r.id))
        assert r.usage.input_tokens_details.cached_tokens == started["reuse_base"]
        if previous is not None:
            assert started["plan"] == "PrivateEndpoint"
            assert r.usage.input_tokens_details.cached_tokens == (
                previous.usage.input_tokens + previous.usage.output_tokens - 1)
        previous = r
        history += [*_assistant_items(r), {"role": "user", "content": f"And day {turn + 2}?"}]


def test_sealed_reasoning_alone_keeps_the_reuse_to_the_token(live, client):
    """A reasoning item sent back with its encrypted_content only (no text) re-renders the
    reasoning, as the very ids the model wrote: even with the server's memory of the
    conversation gone, the next turn reuses the whole previous one."""
    tok = live.server.tokenizer
    first_input = [{"role": "user", "content": "Think about the tides of the harbour."}]
    one = client.responses.create(model=MODEL, input=first_input, max_output_tokens=24,
                                  temperature=0, prompt_cache_key="sealed",
                                  include=["reasoning.encrypted_content"])
    [reasoning] = one.output
    ids = output_tokens(live, one.id)
    assert tok.encode(tok.decode(ids)) != ids   # the case re-encoding the text would lose
    assert one.usage.output_tokens_details.reasoning_tokens == len(ids)
    sealed = {"type": "reasoning", "id": reasoning.id, "summary": [],
              "encrypted_content": reasoning.encrypted_content}
    live.server.history = History()   # as after a restart with its endpoints restored
    two = client.responses.create(model=MODEL, input=[
        *first_input, sealed, {"role": "user", "content": "And tomorrow?"}],
        max_output_tokens=2, prompt_cache_key="sealed")
    assert two.usage.input_tokens_details.cached_tokens == (
        one.usage.input_tokens + one.usage.output_tokens - 1)
    # an encrypted_content this server did not write is not an error: nothing is rendered
    foreign = client.responses.create(model=MODEL, input=[
        *first_input, {**sealed, "encrypted_content": "gAAAAB-from-elsewhere"},
        {"role": "user", "content": "And tomorrow?"}], max_output_tokens=2, temperature=0)
    assert foreign.status == "incomplete"   # (greedy: a sampled reply may end at once)


def _chat_tokens(live, chat_id: str, kind: str) -> list[int]:
    events = live.events(chat_id.split("-", 1)[1])
    if kind == "RequestQueued":
        return [d for k, d, _ in events if k == kind][0]["tokens"]
    return [t for k, d, _ in events if k == kind for t in d["tokens"]]


def test_a_conversation_renders_and_reuses_the_same_through_chat_and_responses(live, client):
    """One conversation, two ways (each its own tenant): through chat completions, and
    through the Responses API with its instructions split between `instructions` and a
    developer message and its reply sent back as items. Each turn renders to the same token
    ids and reuses as much. A conversation begun on chat completions and continued on the
    Responses API, recognised by its derived key, reuses its whole first turn."""
    system, note = "You are the harbour master.", "Answer with the berth number."
    question, follow = "Where does the Number 7 dock?", "And the Number 9?"

    def chat(messages, salt, max_tokens):
        return client.chat.completions.create(
            model=MODEL, max_tokens=max_tokens, temperature=0, extra_body={"cache_salt": salt},
            messages=[{"role": "system", "content": f"{system}\n\n{note}"}, *messages])

    def responses(items, salt, max_tokens):
        return client.responses.create(
            model=MODEL, max_output_tokens=max_tokens, temperature=0, instructions=system,
            extra_body={"cache_salt": salt},
            input=[{"role": "developer", "content": note}, *items])

    asked = [{"role": "user", "content": question}]
    chat_one, resp_one = chat(asked, "chat-way", 16), responses(asked, "responses-way", 16)
    assert queued_tokens(live, resp_one.id) == _chat_tokens(live, chat_one.id, "RequestQueued")
    assert output_tokens(live, resp_one.id) == _chat_tokens(live, chat_one.id,
                                                            "TokensCommitted")
    message = chat_one.choices[0].message
    reply = {"role": "assistant", "content": message.content or ""}
    if (message.model_extra or {}).get("reasoning_content"):
        reply["reasoning_content"] = message.model_extra["reasoning_content"]
    chat_two = chat([*asked, reply, {"role": "user", "content": follow}], "chat-way", 2)
    resp_two = responses([*asked, *_assistant_items(resp_one),
                          {"role": "user", "content": follow}], "responses-way", 2)
    assert queued_tokens(live, resp_two.id) == _chat_tokens(live, chat_two.id, "RequestQueued")
    whole_turn = chat_one.usage.prompt_tokens + chat_one.usage.completion_tokens - 1
    assert resp_two.usage.input_tokens_details.cached_tokens == whole_turn
    assert chat_two.usage.prompt_tokens_details.cached_tokens == whole_turn

    begun = chat(asked, "across", 16)
    continued = responses([*asked, *_assistant_items(resp_one),
                           {"role": "user", "content": follow}], "across", 2)
    assert continued.usage.input_tokens_details.cached_tokens == (
        begun.usage.prompt_tokens + begun.usage.completion_tokens - 1)


def test_overlong_prompt(live, client):
    long_input = "tide " * 3000
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=long_input, max_output_tokens=2)
    error = caught.value.body
    assert error["code"] == CONTEXT_CODE and error["param"] == "input"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="short", max_output_tokens=10_000)
    assert caught.value.body["param"] == "max_output_tokens"
    # streamed, it is a response that failed, as OpenAI streams it
    events = events_of(httpx.post(live.url + "/v1/responses", json={
        "model": MODEL, "input": long_input, "stream": True}, timeout=60))
    for event in events:
        strict_event(event)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == CONTEXT_CODE
    assert "maximum context length" in failed["error"]["message"]


def test_stateless_fields(live, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert "send the whole conversation" in caught.value.body["message"]
    assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", background=True)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[{"type": "item_reference", "id": "msg_1"}])
    assert caught.value.body["param"] == "input.0.type"
    for store in (True, False):   # accepted, and ignored
        assert client.responses.create(model=MODEL, input="x", store=store, temperature=0,
                                       max_output_tokens=1).status == "incomplete"


BAD = [
    ("malformed JSON", b'{"input": [', "invalid_json", None),
    ("wrong type", b'{"input": 5}', None, "input"),
    ("temperature not a number", b'{"input": "x", "temperature": "hot"}', None, "temperature"),
    ("unknown role", b'{"input": [{"role": "robot", "content": "x"}]}', None, "input.0.role"),
    ("unknown item", b'{"input": [{"type": "telepathy"}]}', None, "input.0.type"),
    ("image", b'{"input": [{"role": "user", "content": [{"type": "input_image", '
              b'"image_url": "x"}]}]}', None, "input.0.content.0.type"),
    ("empty input", b'{"input": []}', None, "input"),
    ("empty string", b'{"input": ""}', None, "input"),
    ("only instructions", b'{"input": [{"role": "system", "content": "x"}]}', None, "input"),
    ("unknown text format", b'{"input": "x", "text": {"format": {"type": "yaml"}}}', None,
     "text.format.type"),
    ("json_schema without a schema", b'{"input": "x", "text": {"format": {"type": '
                                     b'"json_schema", "name": "n"}}}', None,
     "text.format.schema"),
    ("invalid schema", b'{"input": "x", "text": {"format": {"type": "json_schema", "name": '
                       b'"n", "schema": {"type": "object", "properties": 5}}}}', None,
     "text.format"),
    ("two tools one name", b'{"input": "x", "tools": [{"type": "function", "name": "f"}, '
                           b'{"type": "custom", "name": "f"}]}', None, "input"),
    ("unknown tool_choice", b'{"input": "x", "tools": [{"type": "function", "name": "f"}], '
                            b'"tool_choice": {"type": "function", "name": "g"}}', None, "input"),
]


@pytest.mark.parametrize("name,body,code,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_in_openai_error_shape(live, name, body, code, param):
    r = httpx.post(live.url + "/v1/responses", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["code"] == code and error["param"] == param


def test_oversized_body(live):
    with live.configured(max_body_bytes=1000):
        r = httpx.post(live.url + "/v1/responses", json={"input": "x" * 2000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_prompt_cache_key_names_the_conversation(live, client):
    first = [{"role": "user", "content": "A conversation named by its cache key."}]
    one = client.responses.create(model=MODEL, input=first, max_output_tokens=6,
                                  temperature=0, prompt_cache_key="named-1")
    with contextlib.closing(sqlite3.connect(f"file:{live.journal_path}?mode=ro",
                                            uri=True)) as db:
        [(conversation,)] = db.execute("SELECT DISTINCT conversation FROM events WHERE "
                                       "request = ?", (request_id(one.id),)).fetchall()
    assert conversation == "cache-named-1"
    two = client.responses.create(model=MODEL, input=[*first, *_assistant_items(one), {
        "role": "user", "content": "Go on."}], max_output_tokens=2,
        prompt_cache_key="named-1")
    assert two.usage.input_tokens_details.cached_tokens == (
        one.usage.input_tokens + one.usage.output_tokens - 1)
