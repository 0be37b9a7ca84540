"""What each conversation last computed, as text and token ids, so its next prompt is encoded
into the very ids the model computed on, not a re-tokenization of them.

A model's output ids are not always the tokenizer's own encoding of their text (a random
model's almost never are; real models' sometimes), and re-encoding the history would then
lose the reuse of everything after the first difference. So per (tenant, session) the server
remembers the last request's prompt and prompt + output, both as (text, ids); a new prompt
whose text starts with one of them is encoded as those ids + the encoding of the rest. The
splice is at a text boundary and the ids decode to exactly the text, so the model sees the
same conversation; it only keeps the tokenization it already computed."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

Key = tuple[str, str]


class History:
    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._last: OrderedDict[Key, list[tuple[str, tuple[int, ...]]]] = OrderedDict()

    def encoder(self, encode: Callable[[str], list[int]], tenant: str,
                session: str | None) -> Callable[[str], list[int]]:
        """An `encode(text)` that reuses this conversation's remembered ids."""
        known = self._last.get((tenant, session)) if session is not None else None
        if not known:
            return encode
        self._last.move_to_end((tenant, session))
        pairs = sorted(known, key=lambda p: -len(p[0]))

        def spliced(text: str) -> list[int]:
            for head, ids in pairs:
                if text.startswith(head):
                    rest = text[len(head):]
                    return [*ids, *encode(rest)] if rest else list(ids)
            return encode(text)
        return spliced

    def remember(self, tenant: str, session: str | None,
                 pairs: list[tuple[str, tuple[int, ...]]]) -> None:
        if session is None:
            return
        self._last[(tenant, session)] = [p for p in pairs if p[0]]
        self._last.move_to_end((tenant, session))
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)
