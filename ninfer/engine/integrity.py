"""Invariant 6, conservation, checked where the engine is idle and by the Hypothesis
machine after every rule: a block or slot is in use iff a live lane or an endpoint holds
it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..lifecycle.store import ContinuationStore
from ..model.pools import BlockPool, SlotPool
from .live import Live
from .runner import Held


def check_conservation(blocks: BlockPool, slots: SlotPool, held: Mapping[str, Held],
                       lives: Iterable[Live], store: ContinuationStore) -> None:
    """Raise AssertionError naming the first difference between pool use and holders."""
    refs = [0] * blocks.num_blocks
    in_use: list[int] = []
    owners: list[Held] = list(held.values())
    lives = list(lives)
    for live in lives:
        for block in live.lane.attn_blocks + live.lane.mtp_blocks:
            refs[block] += 1
        in_use.append(live.lane.slot)
        owners.extend(live.captures)
    for h in owners:
        for block in h.attn_blocks + h.mtp_blocks:
            refs[block] += 1
        in_use.append(h.slot)
    if refs != blocks.refs:
        bad = [b for b in range(len(refs)) if refs[b] != blocks.refs[b]]
        raise AssertionError(f"block refcounts differ from holders at blocks {bad[:8]}")
    if sorted(in_use) != sorted(slots.in_use) or len(set(in_use)) != len(in_use):
        raise AssertionError(f"slots in use {sorted(slots.in_use)} != {sorted(in_use)}")
    if set(held) != store.checkpoint_ids():
        raise AssertionError("held checkpoints differ from the store's endpoints")
    if not lives and not store.endpoints:
        assert blocks.free == blocks.num_blocks, "blocks leaked"
        assert slots.free == slots.num_slots, "slots leaked"
