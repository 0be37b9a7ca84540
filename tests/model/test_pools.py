"""The block pool's batch operations are its one-block ones in a loop: shared blocks count
one holder more each, released ones go back to the free list at their last holder, and a
free block can be neither shared nor released."""

import pytest

from ninfer.model.pools import BlockPool


def test_shared_blocks_free_at_their_last_holder():
    pool = BlockPool(8, 16)
    table = [pool.alloc() for _ in range(5)]
    copy = table[:3]
    pool.share(copy)
    assert [pool.refs[b] for b in table] == [2, 2, 2, 1, 1]
    pool.release(table)
    assert table == [] and pool.free == 8 - 3
    pool.release(copy)
    assert copy == [] and pool.free == 8 and pool.used == 0


def test_a_free_block_is_neither_shared_nor_released():
    pool = BlockPool(4, 16)
    with pytest.raises(AssertionError):
        pool.share([2])
    with pytest.raises(AssertionError):
        pool.release([1])
