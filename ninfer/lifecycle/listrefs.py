"""Journal rows that name an earlier row's list instead of repeating it (schema version 3).

A conversation's every turn journals its whole context: the prompt's token ids and block
hashes in `RequestQueued`, the same again in each endpoint it publishes and each checkpoint
it captures. Written in full, a journal grows with the square of a conversation's length
and the engine thread writes a context's worth of rows on the way to every first token (at
16K of context, 320 KB a turn). Instead a row's list may start with the first n items of
an earlier row's list of the same packing, in the same file (`events.pack`'s `after`), and
carry only the rest.

`Referrer` (the writer's) keeps the lists of the last rows it wrote and of each recent
conversation's last rows and, for a new row's lists, finds the longest prefix one of them
shares, checked item by item, never trusted to a hash. A reference chain is at most
`MAX_DEPTH` rows long (then a row is written whole) so a reader with no cache reads a
bounded number of rows. `Resolver` (the reader's) reads the
named rows, a few of the lists it built kept for the next row's reference."""

from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from .events import (
    EVENT_TYPES,
    PACKINGS,
    Event,
    list_paths,
    lists_of,
    pack,
    packed_items,
    reset_resolving,
    resolving,
)
from .hashing import HASH_BLOCK

RECENT = 8          # rows the writer keeps to refer to, whatever their conversation
# conversations whose last rows it keeps (their next turn names them); the lists are the
# events' own tuples, mostly held by the store's endpoints too, but a conversation's 32K
# ids kept only here cost ~1 MB: this bounds that
CONVERSATIONS = 64
MAX_DEPTH = 16      # rows a reference may lead through before one is written whole
MIN_BLOCKS = 4      # hashed blocks (64 token ids) a reference must share to be worth it
CACHED = 16         # lists the reader keeps, for the rows that follow
IDS, HASHES = "packed u32", "packed u64"


class Kept(NamedTuple):
    seq: int
    lists: dict[str, tuple[int, ...]]   # by packing tag (the event's own tuples: the store
    #                                     holds most of them anyway)
    depth: int                          # rows a reader follows from this one


class Referrer:
    """The writer's side: for each row it writes, the text of its packed lists, naming
    an earlier row's where one shares a long enough prefix.

    The rows it may name: the last few written, and each recent conversation's last row
    and last row with token ids (a turn comes minutes after its conversation's last, other
    conversations' rows between). Every kind that holds token ids holds their block hashes
    beside them, chained (`hashing`): two rows' hash lists agree up to the first block
    where their ids differ, so the row sharing the most is found by a binary search on
    single hashes, and then checked: the ids and hashes a reference stands for are compared
    with the named row's before it is written."""

    def __init__(self) -> None:
        self.recent: OrderedDict[int, Kept] = OrderedDict()   # by seq
        self.conversations: OrderedDict[str, dict[str, Kept]] = OrderedDict()

    def packer(self, ev: Event) -> Callable[[tuple[int, ...], str], str]:
        """A packer for `ev`'s row (`events.to_row`), after which its lists are kept for
        the rows that follow."""
        lists = lists_of(ev)
        if not lists:   # (most rows: a decode round's tokens hold no packed list)
            return pack
        chosen, depth = self._choose(lists, self._candidates(ev.conversation))
        self._keep(Kept(ev.seq, lists, depth), ev.conversation)

        def packer(values: tuple[int, ...], tag: str) -> str:
            after = chosen.get(tag)
            if after is None:
                return pack(values, tag)
            return pack(values[after[1]:], tag, after=after)
        return packer

    def forget(self) -> None:
        """Rows not written after all (a transaction rolled back): refer to none of them."""
        self.recent.clear()
        self.conversations.clear()

    def _candidates(self, conversation: str | None) -> list[Kept]:
        rows = {k.seq: k for k in self.recent.values()}
        if conversation is not None and conversation in self.conversations:
            rows.update((k.seq, k) for k in self.conversations[conversation].values())
        return list(rows.values())

    def _keep(self, kept: Kept, conversation: str | None) -> None:
        self.recent[kept.seq] = kept
        while len(self.recent) > RECENT:
            self.recent.popitem(last=False)
        if conversation is not None:
            last = self.conversations.pop(conversation, {})
            last["row"] = kept
            if IDS in kept.lists:
                last["ids"] = kept
            self.conversations[conversation] = last
            while len(self.conversations) > CONVERSATIONS:
                self.conversations.popitem(last=False)

    @staticmethod
    def _choose(lists: dict[str, tuple[int, ...]], candidates: list[Kept]
                ) -> tuple[dict[str, tuple[int, int]], int]:
        """The (seq, n) each of `lists` starts with, by tag, and the new row's depth."""
        hashes, ids = lists.get(HASHES), lists.get(IDS)
        if hashes is None:
            return {}, 0
        best: dict[str, tuple[int, Kept]] = {}     # tag -> (blocks shared, the row)
        for kept in candidates:
            theirs = kept.lists.get(HASHES)
            if theirs is None:
                continue
            m = chained_prefix(hashes, theirs)
            if m < MIN_BLOCKS:
                continue
            for tag in (HASHES, IDS) if ids is not None and IDS in kept.lists else (HASHES,):
                if tag not in best or m > best[tag][0]:
                    best[tag] = (m, kept)
        chosen, depth = {}, 0
        for tag, (m, kept) in best.items():
            if kept.depth + 1 >= MAX_DEPTH:
                continue   # written whole: a reader follows at most MAX_DEPTH rows
            mine, theirs = lists[tag], kept.lists[tag]
            n = m if tag == HASHES else m * HASH_BLOCK
            if mine[:n] != theirs[:n]:
                continue   # a hash that collided: written whole
            if tag == IDS:  # the ids past the last shared block that still agree
                while n < len(mine) and n < len(theirs) and mine[n] == theirs[n]:
                    n += 1
            chosen[tag], depth = (kept.seq, n), max(depth, kept.depth + 1)
        return chosen, depth


def chained_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading items two chained hash lists share: equal at an index, equal
    before it, so a binary search on single items."""
    lo, hi = 0, min(len(a), len(b))   # a[lo - 1] == b[lo - 1] (or lo 0); hi: an upper bound
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Resolver:
    """The reader's side: the first n items of a row's list, read from the journal
    (`fetch(seq)` -> the row's (kind, payload text), or None), its own references
    followed; the last lists built kept."""

    def __init__(self, fetch: Callable[[int], tuple[str, str] | None]) -> None:
        self.fetch = fetch
        self.cache: OrderedDict[tuple[str, int], array] = OrderedDict()

    def below(self, row: int) -> Callable[[str, int, int], array]:
        """The resolver for the lists of the row at seq `row`: they may name only rows
        before it (a damaged row that names itself or a later one is refused, not
        followed round)."""
        def resolve(code: str, seq: int, n: int) -> array:
            if seq >= row:
                raise ValueError(f"a packed list of row {row} names row {seq}, not one "
                                 "before it")
            return self(code, seq, n)
        return resolve

    def __call__(self, code: str, seq: int, n: int) -> array:
        items = self.cache.get((code, seq))
        if items is None:
            items = self._read(code, seq)
            self.cache[(code, seq)] = items
            while len(self.cache) > CACHED:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end((code, seq))
        if n > len(items):
            raise ValueError(f"a packed list names {n} items of row {seq}'s, which has "
                             f"{len(items)}")
        return items[:n]

    def _read(self, code: str, seq: int) -> array:
        row = self.fetch(seq)
        if row is None:
            raise ValueError(f"a packed list names row {seq}, which this file lacks")
        kind, data = row
        tag = next(t for t, (_, c) in PACKINGS.items() if c == code)
        path = list_paths(EVENT_TYPES[kind]).get(tag) if kind in EVENT_TYPES else None
        value: Any = json.loads(data)
        for name in path or ():
            value = value.get(name) if isinstance(value, dict) else None
        if type(value) is not str:   # (a list in a row of version 1 cannot be named)
            raise ValueError(f"a packed list names row {seq}'s {tag} list, which it lacks")
        token = resolving(self.below(seq))   # its own references, to rows before it
        try:
            return packed_items(value)
        finally:
            reset_resolving(token)
