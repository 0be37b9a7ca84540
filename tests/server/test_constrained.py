"""Constrained output over HTTP, on the live server's random tiny model: every format field
reaches the engine as a grammar the reply then matches (a complete document when
`finish_reason` is "stop", a prefix of one when "length"), forced tool calls always are
well-formed calls, reasoning stays free and is closed in time for the answer, the logit bias
works, and every bad format is a 400 naming its field before anything is queued."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from ninfer.engine.constraint import Constraint
from ninfer.lifecycle.request import SamplingParams
from ninfer.server.formats import answer_turn
from ninfer.server.reasoning import bounded

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
NO_THINKING = {"enable_thinking": False}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["red", "blue"]}}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 8},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def chat(content="Describe a person as JSON.", **fields):
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


def post(live, path, body) -> dict:
    r = httpx.post(live.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def queued(live) -> int:
    """RequestQueued events in the journal so far."""
    import contextlib
    import sqlite3
    with contextlib.closing(sqlite3.connect(f"file:{live.journal_path}?mode=ro", uri=True)) as db:
        return db.execute("SELECT count(*) FROM events WHERE kind = 'RequestQueued'").fetchone()[0]


def test_a_strict_schema_reply_is_a_complete_valid_document(live):
    """No max_tokens: the server gives a strict, bounded schema the room its longest
    document needs, so the reply always completes."""
    body = post(live, CHAT, chat(chat_template_kwargs=NO_THINKING, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                               "strict": True}}))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    doc = json.loads(choice["message"]["content"])
    jsonschema.validate(doc, PERSON)
    # strict formatting: the separators and nothing else
    assert choice["message"]["content"] == json.dumps(doc, ensure_ascii=False)


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"json_object": True}},
    {"guided_json": {"type": "object"}},
], ids=["response_format", "structured_outputs", "guided_json"])
def test_any_json_object_is_a_document_or_a_prefix_of_one(live, fields):
    body = post(live, CHAT, chat(chat_template_kwargs=NO_THINKING, max_tokens=24, **fields))
    choice = body["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("fields,check", [
    ({"structured_outputs": {"regex": r"[a-z]{2,5}-[0-9]{3}"}},
     lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t)),
    ({"guided_regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["alpha", "beta", "gamma ray"]}},
     lambda t: t in ("alpha", "beta", "gamma ray")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"grammar": 'start: "x" NUM ("," NUM){0,2}\nNUM: /[0-9]{1,2}/'}},
     lambda t: re.fullmatch(r"x[0-9]{1,2}(,[0-9]{1,2}){0,2}", t)),
    ({"guided_grammar": 'start: "(" start ")" | "ok"'},
     lambda t: re.fullmatch(r"\(*ok\)*", t) and t.count("(") == t.count(")")),
], ids=["regex", "guided_regex", "choice", "guided_choice", "grammar", "guided_grammar"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_regex_choice_and_grammar_formats(live, fields, check, route):
    if route == "chat":
        body = post(live, CHAT, chat(chat_template_kwargs=NO_THINKING, max_tokens=40,
                                     **fields))
        choice = body["choices"][0]
        text = choice["message"]["content"]
    else:
        body = post(live, COMPLETIONS, {"prompt": "The answer:", "max_tokens": 40,
                                        "temperature": 1.0, "seed": 3, **fields})
        choice = body["choices"][0]
        text = choice["text"]
    assert choice["finish_reason"] == "stop", text
    assert check(text), text


def test_required_tool_choice_always_yields_valid_calls(live):
    """Sampled: calls and nothing else, each valid. One call ends the reply; in parallel
    the model may go on calling until max_tokens cuts it (the call cut short is left as
    text)."""
    for seed, parallel in ((0, False), (1, False), (2, None), (3, None)):
        body = post(live, CHAT, chat("What is the weather?", tools=[WEATHER, TIME],
                                     tool_choice="required", max_tokens=200, temperature=1.0,
                                     seed=seed, chat_template_kwargs=NO_THINKING,
                                     parallel_tool_calls=parallel))
        choice = body["choices"][0]
        content = choice["message"]["content"] or ""
        if parallel is False or choice["finish_reason"] != "length":
            assert choice["finish_reason"] == "tool_calls", choice
            assert content == ""
        else:
            assert content == "" or content.startswith("<tool_call>"), content
        calls = choice["message"]["tool_calls"]
        if parallel is False:
            assert len(calls) == 1
        assert calls
        for call in calls:
            fn = call["function"]
            schema = {t["function"]["name"]: t["function"]["parameters"]
                      for t in (WEATHER, TIME)}[fn["name"]]
            jsonschema.validate(json.loads(fn["arguments"]), schema)


def test_a_named_tool_choice_calls_that_function_once(live):
    body = post(live, CHAT, chat("Time?", tools=[WEATHER, TIME], max_tokens=120,
                                 tool_choice={"type": "function",
                                              "function": {"name": "get_time"}},
                                 chat_template_kwargs=NO_THINKING))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("utc", "local")


def test_a_forced_call_renders_back_to_the_tokens_the_model_wrote(live):
    """The call the server returns, sent back as history, re-renders to exactly what the
    model wrote: the next turn reuses the whole of this one."""
    first = chat("What is the weather?", tools=[WEATHER], tool_choice="required",
                 max_tokens=120, chat_template_kwargs=NO_THINKING, session_id="forced")
    body = post(live, CHAT, first)
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    turn2 = dict(first, tool_choice="auto", max_tokens=2, messages=[
        *first["messages"], {"role": "assistant", "content": None,
                             "tool_calls": message["tool_calls"]},
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
         "content": "sunny"}])
    second = post(live, CHAT, turn2)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]  # all but the last
    assert cached == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1


def test_reasoning_stays_free_and_the_answer_follows_it(live):
    """With thinking on, the reasoning is the model's own (the same tokens as without a
    format) and the grammar holds from its end: a logit bias on the end-of-reasoning
    token makes the reasoning short."""
    tokenizer = live.server.tokenizer
    think_end = tokenizer.special.think_end
    fields = dict(max_tokens=300, logit_bias={str(think_end): 3.0})
    free = post(live, CHAT, chat(**fields))["choices"][0]
    held = post(live, CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": PERSON, "strict": True}}, **fields))["choices"][0]
    reasoning = held["message"]["reasoning_content"]
    assert reasoning and reasoning == free["message"]["reasoning_content"]
    assert len(tokenizer.encode(reasoning)) >= 3
    assert held["finish_reason"] == "stop"
    jsonschema.validate(json.loads(held["message"]["content"]), PERSON)
    # a forced tool call comes after the reasoning the model writes with no call forced
    loose = dict(WEATHER, function={**WEATHER["function"], "strict": False})
    free = post(live, CHAT, chat(tools=[loose], **fields))["choices"][0]
    called = post(live, CHAT, chat(tools=[loose], tool_choice="required",
                                   parallel_tool_calls=False, **fields))["choices"][0]
    assert free["message"].get("reasoning_content")
    assert called["message"]["reasoning_content"] == free["message"]["reasoning_content"]
    assert called["finish_reason"] == "tool_calls"
    [call] = called["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        WEATHER["function"]["parameters"])


def journaled(live, request_id: str) -> tuple[dict, list[int]]:
    """The request's journaled parameters and output tokens."""
    live.wait_terminal(request_id)
    events = live.events(request_id)
    params = next(e for k, e, _ in events if k == "RequestQueued")["params"]
    return params, [t for k, e, _ in events if k == "TokensCommitted" for t in e["tokens"]]


def test_a_small_budget_with_thinking_on_closes_the_reasoning_for_the_answer(live):
    """The server's budget of 8, thinking on, a strict schema and no max_tokens: the
    reasoning is closed at the budget (the grammar holds from its end), and the answer is a
    complete, valid document."""
    with live.configured(reasoning_budget=8):
        r = httpx.post(live.url + CHAT, timeout=60, json=chat(response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                   "strict": True}}))
    choice = r.json()["choices"][0]
    params, tokens = journaled(live, r.headers["x-request-id"])
    close = params["reasoning_close"]
    assert params["reasoning_budget"] == 8 and tokens[8:8 + len(close)] == close
    assert choice["message"]["reasoning_content"]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_without_a_budget_a_constrained_reply_still_gets_its_turn(live):
    """No budget anywhere and thinking on: a constrained reply's reasoning is closed in time
    for the answer, by half the output limit when the answer's length is unknown."""
    r = httpx.post(live.url + CHAT, timeout=60, json=chat(
        max_tokens=60, response_format={"type": "json_object"}))
    choice = r.json()["choices"][0]
    params, tokens = journaled(live, r.headers["x-request-id"])
    close = params["reasoning_close"]
    assert params["reasoning_budget"] == 60 - len(close) - 30
    assert live.server.tokenizer.special.think_end in tokens[:30]
    assert choice["message"]["content"].startswith("{")


def test_the_answers_turn_in_numbers(live):
    """answer_turn: the budget leaves the answer its room, never more than asked; a limit
    the client did not set fits the budget, the close and a known answer."""
    tokenizer = live.server.tokenizer
    close = len(bounded(SamplingParams(), 0, tokenizer).reasoning_close)
    asked = bounded(SamplingParams(max_tokens=300), 1024, tokenizer)
    assert answer_turn(asked, None, None, tokenizer).reasoning_budget == 300 - close - 150
    assert answer_turn(asked, 100, None, tokenizer).reasoning_budget == 300 - close - 100
    small = bounded(SamplingParams(max_tokens=300), 7, tokenizer)
    assert answer_turn(small, 100, None, tokenizer).reasoning_budget == 7
    none = SamplingParams(max_tokens=300)
    assert answer_turn(none, None, None, tokenizer).reasoning_budget == 300 - close - 150
    opened = answer_turn(asked, 100, 5000, tokenizer)     # no max_tokens: room for it all
    assert opened.max_tokens == 1024 + close + 100 and opened.reasoning_budget == 1024
    assert answer_turn(asked, 100, 500, tokenizer).max_tokens == 500   # the context's end
    # without reasoning: only the limit, raised to the answer when the client set none
    assert answer_turn(none, 400, 5000, None) == SamplingParams(max_tokens=400)
    assert answer_turn(none, 400, None, None) == none


def test_logprobs_are_after_the_mask(live):
    body = post(live, CHAT, chat(chat_template_kwargs=NO_THINKING, logprobs=True,
                                 top_logprobs=5, max_tokens=6,
                                 structured_outputs={"choice": ["yes", "no"]}))
    entries = body["choices"][0]["logprobs"]["content"]
    first = entries[0]
    # only the tokens that start "yes" or "no" are alternatives, and they share all the mass
    assert all("yes".startswith(t["token"]) or "no".startswith(t["token"])
               for t in first["top_logprobs"])
    total = sum(2.718281828459045 ** t["logprob"] for t in first["top_logprobs"])
    assert total == pytest.approx(1.0, abs=1e-6)


def test_stop_strings_do_not_cut_constrained_text(live):
    body = post(live, CHAT, chat(chat_template_kwargs=NO_THINKING, stop=['"', ":"],
                                 response_format={"type": "json_schema", "json_schema": {
                                     "name": "p", "schema": PERSON, "strict": True}}))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_logit_bias_forces_and_forbids_tokens(live):
    tokenizer = live.server.tokenizer
    plain = post(live, COMPLETIONS, {"prompt": "Once upon", "max_tokens": 5,
                                     "temperature": 0})["choices"][0]["text"]
    first = tokenizer.encode(plain)[0]
    banned = post(live, COMPLETIONS, {"prompt": "Once upon", "max_tokens": 5, "temperature": 0,
                                      "logit_bias": {str(first): -100}})["choices"][0]["text"]
    assert first not in tokenizer.encode(banned)
    [word] = tokenizer.encode(" the")
    forced = post(live, COMPLETIONS, {"prompt": "Once upon", "max_tokens": 5, "temperature": 1,
                                      "logit_bias": {str(word): 100}})["choices"][0]["text"]
    assert forced == " the" * 5


def test_the_grammar_is_journaled_with_the_request(live):
    body = post(live, COMPLETIONS, {"prompt": "Pick:", "max_tokens": 8,
                                    "guided_choice": ["one", "two"]})
    request_id = body["id"].split("-", 1)[1]
    params = live.events(request_id)[0][1]["params"]
    assert params["grammar"] and params["grammar_after"] is None
    matcher = live.engine.grammars.matcher(params["grammar"])
    outputs = [e for k, e, _ in live.events(request_id) if k == "TokensCommitted"]
    tokens = [t for e in outputs for t in e["tokens"]]
    constraint = Constraint(matcher, tokens, after=None,
                            end_tokens=live.engine.grammars.end_tokens,
                            vocab_size=live.engine.grammars.vocab_size)
    constraint.masks()  # the journaled tokens are the grammar's: it accepts every one
    assert body["choices"][0]["text"] in ("one", "two")


BAD = [
    ("invalid schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format", "strin"),
    ("unsupported keyword", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "object", "dependentSchemas": {}}}}},
     "response_format", "dependentSchemas"),
    ("schema as bad JSON text", {"guided_json": "{not json"}, "guided_json", "JSON schema"),
    ("grammar that fails to compile", {"structured_outputs": {"grammar": "start: nothing"}},
     "structured_outputs", "nothing"),
    ("invalid regex", {"guided_regex": "(ab"}, "guided_regex", "regex"),
    ("empty choice", {"guided_choice": []}, "guided_choice", None),
    ("two formats", {"guided_regex": "a", "response_format": {"type": "json_object"}},
     "guided_regex", "one output format"),
    ("two structured formats", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "exactly one"),
    ("schema too large", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": [f"value number {i:06d} " * 8 for i in range(6000)]}}}},
     "response_format", "over the limit"),
    ("forced call and a format", {"tools": [WEATHER], "tool_choice": "required",
                                  "response_format": {"type": "json_object"}},
     "response_format", "no room"),
    ("tool parameters not an object", {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools", "object schema"),
]


@pytest.mark.parametrize("name,fields,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_formats_are_400s_naming_the_problem_before_anything_is_queued(
        live, name, fields, param, words):
    before = queued(live)
    r = httpx.post(live.url + CHAT, json=chat(max_tokens=4, **fields), timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"].split(".")[0] == param
    if words is not None:
        assert words in error["message"]
    assert queued(live) == before


def test_a_grammar_that_takes_too_long_to_compile_is_a_400(live):
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": f"a{i}+"}
                                               for i in range(40)}}
    with live.configured(grammar_timeout=1e-6):
        r = httpx.post(live.url + CHAT, json=chat(max_tokens=4, guided_json=schema), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "grammar_too_complex"


def test_compiled_grammars_are_cached_by_hash(live):
    grammars = live.engine.grammars
    fields = {"prompt": "Pick:", "max_tokens": 4, "guided_choice": ["cached", "twice"]}
    post(live, COMPLETIONS, fields)
    compiled = grammars.compiled
    post(live, COMPLETIONS, dict(fields, temperature=1.0, seed=5))
    assert grammars.compiled == compiled


def test_streamed_through_the_openai_package(live):
    import openai
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0) as client:
        chunks = list(client.chat.completions.create(
            model="tiny-qwen3-next-v1", messages=[{"role": "user", "content": "JSON please"}],
            stream=True, temperature=0, extra_body={"chat_template_kwargs": NO_THINKING},
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON, "strict": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)
