"""Reasoning, tool-call and stop-string parsing on given text, whole and in every split."""

from __future__ import annotations

import json

import pytest

from ninfer.model.runtime import open_model
from ninfer.server.parsing import Delta, OutputParser, StopScanner, parse_tool_call

CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>')


def run(text: str, pieces: list[str] | None = None, **kw) -> list[Delta]:
    parser = OutputParser(**kw)
    out: list[Delta] = []
    for piece in pieces if pieces is not None else [text]:
        out += parser.push(piece)
    out += parser.finish()
    return merge(out)


def merge(deltas: list[Delta]) -> list[Delta]:
    out: list[Delta] = []
    for d in deltas:
        if out and d.kind == out[-1].kind and d.kind != "tool_call":
            out[-1] = Delta(d.kind, out[-1].text + d.text)
        else:
            out.append(d)
    return out


def splits(text: str):
    yield [text]
    yield list(text)  # one character at a time
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def summary(deltas: list[Delta]) -> list[tuple]:
    return [(d.kind, d.call.name if d.call else d.text,
             json.loads(d.call.arguments) if d.call else None) for d in deltas]


CASES = [
    ("plain reasoning then answer", "I think.\n</think>\n\nThe answer.", dict(thinking=True,
     tools=False), [("reasoning", "I think.", None), ("content", "The answer.", None)]),
    ("thinking off", "Just text", dict(thinking=False, tools=False),
     [("content", "Just text", None)]),
    ("think opened by the model", "<think>\nhmm\n</think>\n\nok", dict(thinking=False,
     tools=False), [("reasoning", "hmm", None), ("content", "ok", None)]),
    ("tool call after reasoning", "plan\n</think>\n\n" + CALL, dict(thinking=True, tools=True),
     [("reasoning", "plan", None), ("tool_call", "get_weather", {"city": "Paris", "days": 2})]),
    ("content, two calls", "Sure.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo"),
     dict(thinking=False, tools=True),
     [("content", "Sure.", None), ("tool_call", "get_weather", {"city": "Paris", "days": 2}),
      ("tool_call", "get_weather", {"city": "Oslo", "days": 2})]),
    ("invalid call stays text", "<tool_call>\nnot json\n</tool_call>", dict(thinking=False,
     tools=True), [("content", "<tool_call>\nnot json\n</tool_call>", None)]),
    ("unterminated call stays text", "<tool_call>\n{\"name\": \"f\"", dict(thinking=False,
     tools=True), [("content", "<tool_call>\n{\"name\": \"f\"", None)]),
    ("tools off: markup is text", CALL, dict(thinking=False, tools=False),
     [("content", CALL, None)]),
]


@pytest.mark.parametrize("name,text,kw,expected", CASES, ids=[c[0] for c in CASES])
def test_parser_in_every_split(name, text, kw, expected):
    for pieces in splits(text):
        assert summary(run(text, pieces, **kw)) == expected, pieces


def test_tool_call_arguments_kept_as_written():
    call = parse_tool_call('{"name": "f", "arguments": {"b": 1, "a": [1,2]}}')
    assert call.arguments == '{"b": 1, "a": [1,2]}'
    other = parse_tool_call('{"arguments": "{\\"x\\": 1}", "name": "g"}')
    assert other.name == "g" and json.loads(other.arguments) == {"x": 1}
    assert parse_tool_call('{"name": 3}') is None
    assert parse_tool_call('["f"]') is None


@pytest.mark.parametrize("text,stops,expected", [
    ("hello STOP world", ("STOP",), "hello "),
    ("abcabd", ("abd",), "abc"),
    ("no stop here", ("zz",), "no stop here"),
    ("first, then", ("then", ","), "first"),
])
def test_stop_strings_in_every_split(text, stops, expected):
    for pieces in splits(text):
        scanner = StopScanner(stops)
        out = "".join(scanner.push(p) for p in pieces) + scanner.finish()
        assert out == expected, pieces


@pytest.fixture(scope="module")
def tiny():
    return open_model(kv_capacity=256, num_slots=4)


def test_history_rerenders_to_the_tokens_the_model_computed(tiny):
    """Turn 1's prompt + output ids are a prefix of turn 2's prompt, when the client sends back
    the parsed message (reasoning, content and tool calls)."""
    tok, template = tiny.tokenizer, tiny.template
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "You help."},
                {"role": "user", "content": "Weather in Paris?"}]
    prompt = tok.encode(template.render(messages, tools=tools, add_generation_prompt=True))
    written = "The user wants weather.\n</think>\n\nLet me check.\n" + CALL
    output = tok.encode(written) + [tok.special.im_end]
    deltas = run(written, thinking=True, tools=True)
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    content = "".join(d.text for d in deltas if d.kind == "content")
    calls = [{"id": d.call.id, "type": "function", "function": {
        "name": d.call.name, "arguments": d.call.arguments}} for d in deltas if d.call]
    history = [*messages, {"role": "assistant", "content": content,
                           "reasoning_content": reasoning, "tool_calls": calls},
               {"role": "tool", "content": "sunny", "tool_call_id": calls[0]["id"]}]
    again = tok.encode(template.render(history, tools=tools, add_generation_prompt=True))
    assert again[:len(prompt) + len(output)] == prompt + output


@pytest.mark.parametrize("name,text,kw,expected", CASES, ids=[c[0] for c in CASES])
def test_push_without_a_tag_in_sight_releases_what_the_full_scan_does(name, text, kw,
                                                                       expected):
    """`push` skips the tag searches while no "<" is buffered; each push's own deltas (one
    stream event's) must be the full scan's, in every split (held newlines included)."""
    def same(deltas):  # a call's id is random
        return [(d.kind, d.text, d.call and (d.call.name, d.call.arguments)) for d in deltas]

    for pieces in [*splits(text), list(text + "\n\nmore\n")]:
        fast, full = OutputParser(**kw), OutputParser(**kw)
        for piece in pieces:
            full.buf += piece
            assert same(fast.push(piece)) == same(full._scan()), pieces
            assert (fast.buf, fast.mode) == (full.buf, full.mode)
        assert same(fast.finish()) == same(full.finish())
