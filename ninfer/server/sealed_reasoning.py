"""A reasoning item's `encrypted_content`: the reasoning text and the token ids the model
generated for it, in one opaque string the client hands back with its next turn.

Sealed: `ninfer.r1.` + base64url(zlib(JSON {"model", "reasoning", "ids"})). It is opaque, not
secret (the reasoning is in the item's `content` anyway) and needs no signature: whatever a
client puts in it only changes its own prompt, and the ids are used only where they decode to
text the rendered prompt holds (`submission.pinned_encoder`), so the model always reads the
conversation the client sent.

`ids` are the output's first tokens up to the one that closes the reasoning block (all of the
output when the reasoning never closed, end-of-text excepted): the span a re-render of that
turn starts with, so the next prompt carries the very ids whose state the engine computed
and the conversation keeps its reuse to the token, whatever the tokenizer would make of the
text."""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

from .parsing import THINK_CLOSE

PREFIX = "ninfer.r1."


class Unsealed(NamedTuple):
    reasoning: str
    ids: tuple[int, ...]     # empty when they cannot be used (another model, bad ids)


def seal(model: str, reasoning: str, ids: Sequence[int]) -> str:
    data = json.dumps({"model": model, "reasoning": reasoning, "ids": list(ids)},
                      ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return PREFIX + base64.urlsafe_b64encode(zlib.compress(data)).decode("ascii")


def unseal(blob: str, model: str, vocab_size: int) -> Unsealed | None:
    """The sealed reasoning, or None for a string this server did not write (another
    provider's, or damaged). Ids sealed under another model, or out of the vocabulary, are
    dropped: the reasoning text is still rendered."""
    if not blob.startswith(PREFIX):
        return None
    try:
        data = json.loads(zlib.decompress(base64.urlsafe_b64decode(blob[len(PREFIX):])))
    except (ValueError, binascii.Error, zlib.error):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("reasoning"), str):
        return None
    ids = data.get("ids")
    if (data.get("model") != model or not isinstance(ids, list)
            or not all(type(t) is int and 0 <= t < vocab_size for t in ids)):
        ids = []
    return Unsealed(data["reasoning"], tuple(ids))


def reasoning_span(outputs: Sequence[int], decode: Callable[[Sequence[int]], str],
                   hidden: frozenset[int]) -> tuple[int, ...]:
    """The output's first tokens up to and including the one that completes `</think>`;
    all of them (trailing end-of-text ids excepted) when none does."""
    if THINK_CLOSE in decode(outputs):
        lo, hi = 1, len(outputs)   # the shortest prefix holding the tag: prefixes only grow
        while lo < hi:
            mid = (lo + hi) // 2
            if THINK_CLOSE in decode(outputs[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return tuple(outputs[:lo])
    end = len(outputs)
    while end and outputs[end - 1] in hidden:
        end -= 1
    return tuple(outputs[:end])
