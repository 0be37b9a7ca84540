"""A stream's text deltas are spliced into a template made once per stream (TextEvents), in
chat and text completions and in Anthropic's Messages API: the bytes are those of the event
built and dumped through its pydantic body, whatever the text (quotes, escapes, control
characters, the mark itself, non-ASCII) and whatever the model's name holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ninfer.server.parsing import Delta
from ninfer.server.streaming import Shape, TextEvents, sse

TEXTS = ["", " hello", 'a "quoted" \\ back\\slash', "tab\tnew\nline\r", "\x00", "\x00\x01\x1f",
         "é ü 中文 🙂", "\u2028\u2029", "</script>", "{}[]:,"]


def shape(chat: bool, model: str = "tiny") -> Shape:
    gen = SimpleNamespace(id="req-1", logprobs=[], logprobs_sent=0)
    return Shape(gen, model, chat=chat, include_usage=True)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("kind", ["content", "reasoning"])
@pytest.mark.parametrize("model", ["tiny", 'odd "\x00" name'])
def test_a_text_delta_is_the_chunk_its_body_writes(chat, kind, model):
    fast, slow = shape(chat, model), shape(chat, model)
    for text in TEXTS:
        d = Delta(kind, text)
        assert fast.on_delta(d) == [sse(slow.delta_chunk(d))]


def test_a_template_whose_last_string_is_not_the_mark_is_refused():
    with pytest.raises(ValueError):
        TextEvents(sse(shape(True).delta_chunk(Delta("content", "no mark"))))


def test_a_messages_delta_is_the_event_its_body_writes():
    """Anthropic's text and thinking deltas, across blocks (the index is in the template)."""
    from ninfer.server.messages_bodies import BlockDelta, TextDelta, ThinkingDelta
    from ninfer.server.messages_stream import MessagesShape, event
    gen = SimpleNamespace(id="req-1")
    stream = MessagesShape(gen, "claude-x", clamped=False)
    for kind in ("reasoning", "content", "reasoning"):
        for text in TEXTS:
            *_, got = stream.on_delta(Delta(kind, text))
            body = ThinkingDelta(thinking=text) if kind == "reasoning" else TextDelta(text=text)
            assert got == event(BlockDelta(index=stream.index, delta=body))
    assert stream.index == 2


def test_a_responses_delta_is_the_event_its_body_writes():
    """The Responses API's text and reasoning deltas, across items: the sequence number and
    the item (id, output index) are in the template, the number spliced in per event."""
    from ninfer.server.responses_bodies import OutputTextDelta, ReasoningTextDelta
    from ninfer.server.responses_stream import ResponsesShape, event_bytes
    server = SimpleNamespace(settings=SimpleNamespace(model_id="m"))
    stream = ResponsesShape(SimpleNamespace(id="req-1", server=server), echo=None, tools={})
    seen = set()
    for kind in ("content", "reasoning"):
        for text in TEXTS:
            *_, got = stream.on_delta(Delta(kind, text))
            body = ReasoningTextDelta if kind == "reasoning" else OutputTextDelta
            assert got == event_bytes(body(
                sequence_number=stream.life.seq - 1, item_id=stream.open.id,
                output_index=stream.open.index, content_index=0, delta=text))
            seen.add((stream.open.id, stream.life.seq - 1))
    assert len({item for item, _ in seen}) == 2 and len(seen) == 2 * len(TEXTS)
