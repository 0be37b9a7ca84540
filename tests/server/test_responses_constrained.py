"""Constrained output on the Responses API, on the live server's random tiny model: the same
path underneath as chat completions (submission.py) holds `text.format` and a forced
`tool_choice` to their grammars (after the reasoning, closed at its budget); the response
echoes the format and is the SDK's shape."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from .responses_helpers import MODEL, request_id, strict_event, strict_response
from .test_constrained import PERSON, journaled, queued

NO_THINKING = {"effort": "none"}
STRICT_PERSON = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
WEATHER = {"type": "function", "name": "get_weather", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}
TIME = {"type": "function", "name": "get_time", "strict": False, "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}


def create(live, **fields) -> dict:
    body = {"model": MODEL, "input": "Describe a person as JSON.", "temperature": 0, **fields}
    r = httpx.post(live.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    strict_response(r.json())
    return r.json()


def text_of(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def calls_of(response: dict) -> list[dict]:
    return [item for item in response["output"] if item["type"] == "function_call"]


def test_a_strict_json_schema_answer_is_a_complete_valid_document(live):
    """No max_output_tokens: the reply may run to the context's end, so a strict document
    always completes; the response echoes the format it was held to."""
    r = create(live, reasoning=NO_THINKING, text={"format": STRICT_PERSON})
    assert r["status"] == "completed"
    doc = json.loads(text_of(r))
    jsonschema.validate(doc, PERSON)
    assert text_of(r) == json.dumps(doc, ensure_ascii=False)   # strict: compact
    assert r["text"]["format"] == STRICT_PERSON


def test_json_object_is_a_document_or_a_prefix_of_one(live):
    r = create(live, reasoning=NO_THINKING, max_output_tokens=24,
               text={"format": {"type": "json_object"}})
    text = text_of(r)
    assert text.startswith("{")
    if r["status"] == "completed":
        assert isinstance(json.loads(text), dict)
    else:
        assert r["incomplete_details"]["reason"] == "max_output_tokens"
    assert r["text"]["format"] == {"type": "json_object"}


def test_thinking_closed_at_the_budget_then_the_answer_validates(live):
    """Thinking on (the template's default) and the server's budget of 8: the reasoning
    item comes first, closed at its budget, and the answer after it is a valid document."""
    with live.configured(reasoning_budget=8):
        r = create(live, text={"format": STRICT_PERSON})
    params, tokens = journaled(live, request_id(r["id"]))
    close = params["reasoning_close"]
    assert params["reasoning_budget"] == 8 and tokens[8:8 + len(close)] == close
    assert [item["type"] for item in r["output"]] == ["reasoning", "message"]
    assert r["status"] == "completed"
    jsonschema.validate(json.loads(text_of(r)), PERSON)


@pytest.mark.parametrize("choice", ["required", {"type": "allowed_tools", "mode": "required",
                                                 "tools": []}],
                         ids=["required", "allowed_tools"])
def test_a_required_tool_choice_always_yields_valid_calls(live, choice):
    """Sampled, so a different reply each time: calls and nothing else, each valid; in
    parallel the model may go on calling until max_output_tokens cuts it (a call cut short
    is left as text), one call ends."""
    for parallel in (None, None, False, False):
        r = create(live, input="What is the weather?", tools=[WEATHER, TIME],
                   tool_choice=choice, reasoning=NO_THINKING, temperature=1.0,
                   max_output_tokens=200, parallel_tool_calls=parallel)
        calls = calls_of(r)
        assert calls, r
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        if parallel is False:
            assert len(calls) == 1 and r["status"] == "completed", r
        if r["status"] == "completed":
            assert text_of(r) == ""
        else:
            assert r["incomplete_details"]["reason"] == "max_output_tokens"
            assert text_of(r) == "" or text_of(r).startswith("<tool_call>")


def test_a_named_tool_choice_calls_that_function_once(live):
    r = create(live, input="Time?", tools=[WEATHER, TIME], reasoning=NO_THINKING,
               tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=120)
    [call] = calls_of(r)
    assert call["name"] == "get_time"
    assert json.loads(call["arguments"])["zone"] in ("utc", "local")
    assert r["tool_choice"] == {"type": "function", "name": "get_time"}


def test_streamed_through_the_openai_package(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as client:
        events = list(client.responses.create(
            model=MODEL, input="JSON please", stream=True, temperature=0,
            reasoning=NO_THINKING, text={"format": STRICT_PERSON}))
    for event in events:
        strict_event(event.model_dump(mode="json", exclude_unset=True, by_alias=True))
    done = events[-1]
    assert done.type == "response.completed"
    jsonschema.validate(json.loads(done.response.output_text), PERSON)
    assert done.response.text.format.type == "json_schema"


BAD = [
    ("invalid schema", {"text": {"format": {"type": "json_schema", "name": "x",
                                            "schema": {"type": "strin"}}}},
     "text.format", "strin"),
    ("unsupported keyword", {"text": {"format": {
        "type": "json_schema", "name": "x", "strict": True,
        "schema": {"type": "object", "dependentSchemas": {}}}}}, "text.format",
     "dependentSchemas"),
    ("forced call and a format", {"tools": [WEATHER], "tool_choice": "required",
                                  "text": {"format": {"type": "json_object"}}},
     "text.format", "no room"),
    ("tool parameters not an object", {"tool_choice": "required", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools", "object schema"),
]


@pytest.mark.parametrize("name,fields,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_formats_are_400s_naming_the_problem_before_anything_is_queued(
        live, name, fields, param, words):
    before = queued(live)
    r = httpx.post(live.url + "/v1/responses",
                   json={"input": "x", "max_output_tokens": 4, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"]
    assert queued(live) == before


# a custom tool whose input is held to its grammar (written JSON-escaped inside the call);
# bounded, so a sampled call completes within max_output_tokens
EDIT_GRAMMAR = r'''
start: "BEGIN\n" edit{1,2} "END"
edit: ("+" | "-") LINE LF -> changed
LINE: /[^\n]{0,10}/
%import common.LF
'''
EDIT_RE = r"BEGIN\n(?:[+-][^\n]{0,10}\n){1,2}END"
EDIT = {"type": "custom", "name": "edit", "description": "Edits a file.",
        "format": {"type": "grammar", "syntax": "lark", "definition": EDIT_GRAMMAR}}
SAY = {"type": "custom", "name": "say",
       "format": {"type": "grammar", "syntax": "regex", "definition": r'[a-z]{1,6} "[^"\n]{0,6}"'}}


@pytest.mark.parametrize("choice", ["required", {"type": "custom", "name": "edit"}],
                         ids=["required", "named"])
def test_a_custom_tools_grammar_holds_its_input(live, choice):
    """Sampled, so a different input each time; each call's input is a sentence of its
    tool's grammar, quotes, backslashes and control characters included."""
    seen = 0
    for _ in range(4):
        r = create(live, input="Fix the file.", tools=[EDIT, SAY], tool_choice=choice,
                   reasoning=NO_THINKING, temperature=1.0, max_output_tokens=400,
                   parallel_tool_calls=False)
        assert r["status"] == "completed", r
        [item] = r["output"]
        assert item["type"] == "custom_tool_call", r
        pattern = EDIT_RE if item["name"] == "edit" else SAY["format"]["definition"]
        assert re.fullmatch(pattern, item["input"]), item["input"]
        seen += item["name"] == "edit"
    if choice != "required":
        assert seen == 4


def test_a_custom_tools_grammar_that_cannot_be_held_is_a_400(live):
    before = queued(live)
    bad = {**EDIT, "format": {**EDIT["format"], "definition": 'start: %json {"type": "object"}'}}
    r = httpx.post(live.url + "/v1/responses", json={"input": "x", "tools": [bad]}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and "%json" in error["message"]
    assert queued(live) == before
