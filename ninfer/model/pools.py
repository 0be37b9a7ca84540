"""Memory bookkeeping, torch-free: a block pool for attention and MTP KV, a slot pool for
recurrent-state snapshots. A block or slot is in use iff a live request or an endpoint
holds it (invariant 6). The model owns the storage these ids index."""

from __future__ import annotations


class OutOfMemory(Exception):
    """The pool has no free block or slot."""


class BlockPool:
    """Reference-counted fixed-size KV blocks; full blocks are shared between a checkpoint
    and the requests restored from it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfMemory("no free KV block")
        block = self._free.pop()
        self.refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self.refs[block] > 0, f"incref of free block {block}"
        self.refs[block] += 1

    def share(self, blocks: list[int]) -> None:
        """`incref` each of `blocks` (a checkpoint's table: thousands at 32K of context)."""
        refs = self.refs
        for block in blocks:
            assert refs[block] > 0, f"incref of free block {block}"
            refs[block] += 1

    def decref(self, block: int) -> None:
        assert self.refs[block] > 0, f"decref of free block {block}"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)

    def release(self, blocks: list[int]) -> None:
        refs, free = self.refs, self._free
        for block in blocks:
            assert refs[block] > 0, f"decref of free block {block}"
            refs[block] -= 1
            if refs[block] == 0:
                free.append(block)
        blocks.clear()


class SlotPool:
    """Recurrent-state slots (GDN matrix, conv tail, last hidden state); one owner each."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.in_use: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self.in_use)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfMemory("no free state slot")
        slot = self._free.pop()
        self.in_use.add(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot in self.in_use, f"release of free slot {slot}"
        self.in_use.remove(slot)
        self._free.append(slot)
