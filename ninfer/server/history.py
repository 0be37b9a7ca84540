"""What each conversation last computed, as text and token ids, so its next prompt is encoded
into the very ids the model computed on, not a re-tokenization of them.

A model's output ids are not always the tokenizer's own encoding of their text (a random
model's almost never are; real models' sometimes), and re-encoding the history would then
lose the reuse of everything after the first difference. So per (tenant, session) the server
remembers, for each of the conversation's branches (as the store keeps one private endpoint
per branch), the last request's prompt and prompt + output, both as text and ids, and the
longest text the branch had reached before that request (what a retry of it starts with); a new
prompt whose text starts with one of them is encoded as those ids + the encoding of the rest.
The splice is at a text boundary and the ids decode to exactly the text, so the model sees
the same conversation; it only keeps the tokenization it already computed."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

Key = tuple[str, str]


class Known(NamedTuple):
    text: str
    ids: tuple[int, ...]


Branch = list[Known]   # (what it reached before,) one request's prompt, its prompt + output


class History:
    def __init__(self, capacity: int = 256, per_session: int = 4) -> None:
        """`capacity`: branches remembered in all; `per_session`: branches per session key.
        The least recently used go first."""
        self.capacity, self.per_session = capacity, per_session
        self._last: OrderedDict[Key, list[Branch]] = OrderedDict()  # each list: LRU first
        self._count = 0

    def encoder(self, encode: Callable[[str], list[int]], tenant: str,
                session: str | None) -> Callable[[str], list[int]]:
        """An `encode(text)` that reuses this conversation's remembered ids (the longest
        remembered text the given one starts with, of any branch)."""
        branches = self._last.get((tenant, session)) if session is not None else None
        if not branches:
            return encode
        self._last.move_to_end((tenant, session))
        known = sorted(((k, b) for b in branches for k in b), key=lambda kb: -len(kb[0].text))

        def spliced(text: str) -> list[int]:
            for k, branch in known:
                if text.startswith(k.text):
                    if branch in branches:  # this branch was used: last out
                        branches.remove(branch)
                        branches.append(branch)
                    rest = text[len(k.text):]
                    return [*k.ids, *encode(rest)] if rest else list(k.ids)
            return encode(text)
        return spliced

    def remember(self, tenant: str, session: str | None, branch: Branch) -> None:
        """A request's computed text and ids: they replace the branch it moved forward (a
        remembered one whose texts all lie on its way), else join the key's branches."""
        branch = [k for k in branch if k.text]
        if session is None or not branch:
            return
        key = (tenant, session)
        longest = max(branch, key=lambda k: len(k.text)).text
        branches = self._last.setdefault(key, [])
        moved = [b for b in branches if all(longest.startswith(k.text) for k in b)]
        for b in moved:
            branches.remove(b)
        # the longest text the moved branches reached, kept before the new one: a retry of
        # this turn (another last message, or the same regenerated) starts with it
        shortest = min(len(k.text) for k in branch)
        before = [k for b in moved for k in b if len(k.text) < shortest]
        if before:
            branch = [max(before, key=lambda k: len(k.text)), *branch]
        branches.append(branch)
        self._count += 1 - len(moved)
        self._last.move_to_end(key)
        while len(branches) > self.per_session:
            branches.pop(0)
            self._count -= 1
        while self._count > self.capacity:
            oldest_key, oldest = next(iter(self._last.items()))
            oldest.pop(0)
            self._count -= 1
            if not oldest:
                del self._last[oldest_key]

    def __len__(self) -> int:
        """Branches remembered."""
        return self._count
