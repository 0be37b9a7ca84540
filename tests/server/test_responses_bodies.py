"""Responses API bodies on the wire, whole and every streamed event, checked strictly against
the `openai` package's own types (responses_helpers: no coercion, no field the types lack,
dumped back to exactly what was sent). The one departure, documented there: a failed
response's `context_length_exceeded` code, which the SDK's literal lacks.

And the grammar: the events' order per item, their indexes and ids, and that the items the
stream builds up are the response's output."""

from __future__ import annotations

import json

import httpx

from .responses_helpers import MODEL, events_of, strict_event, strict_response

PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files"}
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}
SCRIPT = ["Let me", " look it up.\n</think>\n\n", "Checking.\n",
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n',
          '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}',
          "\n</tool_call>"]
REQUEST = {"model": MODEL, "input": [{"role": "user", "content": "Weather in Oslo?"}],
           "tools": [WEATHER, PATCH], "max_output_tokens": 8, "temperature": 0.5,
           "include": ["reasoning.encrypted_content"], "prompt_cache_key": "bodies",
           "metadata": {"ticket": "7"}, "reasoning": {"effort": "high", "summary": "auto"}}


def post(live, body: dict) -> httpx.Response:
    return httpx.post(live.url + "/v1/responses", json=body, timeout=60)


def test_whole_body_with_reasoning_text_and_calls(live, ends_at_once):
    ends_at_once[:] = SCRIPT
    body = post(live, REQUEST).json()
    response = strict_response(body)
    assert response.status == "completed" and response.error is None
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call", "custom_tool_call"]
    reasoning, message, call, custom = response.output
    assert reasoning.content[0].text == "Let me look it up." and reasoning.encrypted_content
    assert message.content[0].text == "Checking." and message.status == "completed"
    assert json.loads(call.arguments) == {"city": "Oslo"} and call.status == "completed"
    assert custom.input == "*** Begin Patch"
    assert len({item.id for item in response.output}) == 4
    # the request's settings, repeated
    assert (response.temperature, response.max_output_tokens) == (0.5, 8)
    assert response.metadata == {"ticket": "7"} and response.prompt_cache_key == "bodies"
    assert (response.reasoning.effort, response.reasoning.summary) == ("high", "auto")
    assert [t.type for t in response.tools] == ["function", "custom"]
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cache_write_tokens == 0


def test_whole_body_cut_by_the_output_limit(live):
    body = post(live, {"model": MODEL, "input": "Go on", "max_output_tokens": 2,
                       "reasoning": {"effort": "none"}}).json()
    response = strict_response(body)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert "encrypted_content" not in json.dumps(body)   # not asked for


def test_stream_events_and_their_grammar(live, ends_at_once):
    ends_at_once[:] = SCRIPT
    events = events_of(post(live, {**REQUEST, "stream": True}))
    for event in events:
        strict_event(event)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    final = strict_response(events[-1]["response"])
    assert events[0]["response"]["status"] == "in_progress" and not events[0]["response"][
        "output"]
    # per output index: added first, done last, deltas in between naming the item
    items: dict[int, list[dict]] = {}
    for event in events[2:-1]:
        items.setdefault(event["output_index"], []).append(event)
    assert sorted(items) == list(range(len(final.output)))
    grammar = {
        "reasoning": ["response.output_item.added", "response.content_part.added",
                      "response.reasoning_text.delta", "response.reasoning_text.done",
                      "response.content_part.done", "response.output_item.done"],
        "message": ["response.output_item.added", "response.content_part.added",
                    "response.output_text.delta", "response.output_text.done",
                    "response.content_part.done", "response.output_item.done"],
        "function_call": ["response.output_item.added",
                          "response.function_call_arguments.delta",
                          "response.function_call_arguments.done",
                          "response.output_item.done"],
        "custom_tool_call": ["response.output_item.added",
                             "response.custom_tool_call_input.delta",
                             "response.custom_tool_call_input.done",
                             "response.output_item.done"]}
    for index, item in enumerate(final.output):
        seen = [e["type"] for e in items[index]]
        assert list(dict.fromkeys(seen)) == grammar[item.type], (item.type, seen)
        done = items[index][-1]["item"]
        assert done == events[-1]["response"]["output"][index]
        assert all(e.get("item_id", item.id) == item.id for e in items[index])
    reasoning = "".join(e["delta"] for e in items[0] if e["type"].endswith(".delta"))
    assert reasoning == final.output[0].content[0].text == "Let me look it up."
    # the events of one index are contiguous: an item is finished before the next starts
    order = [e["output_index"] for e in events[2:-1]]
    assert order == sorted(order)
