"""Block hashes extended from a prefix's (or cut from a longer sequence's) are the ones hashed
from scratch: the engine's captures reuse their request's hashes this way."""

from hypothesis import given
from hypothesis import strategies as st

from ninfer.lifecycle.hashing import HASH_BLOCK, block_hashes, extend_block_hashes

tokens = st.lists(st.integers(0, 2**20), max_size=6 * HASH_BLOCK)
cuts = st.integers(0, 6 * HASH_BLOCK)


@given(tokens, cuts, cuts)
def test_extended_equal_hashed_from_scratch(ids, known_at, cut):
    known = block_hashes(ids[:known_at])   # a shorter or a longer prefix's than the cut's
    assert extend_block_hashes(ids[:cut], known) == block_hashes(ids[:cut])
    assert extend_block_hashes(ids, known) == block_hashes(ids)
    assert extend_block_hashes(ids, ()) == block_hashes(ids)


def test_other_tokens_hash_otherwise():
    ids = list(range(3 * HASH_BLOCK))
    changed = [*ids[:HASH_BLOCK], 7, *ids[HASH_BLOCK + 1:]]
    assert block_hashes(ids)[0] == block_hashes(changed)[0]
    assert block_hashes(ids)[1:] != block_hashes(changed)[1:]
