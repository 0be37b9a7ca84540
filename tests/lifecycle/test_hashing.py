"""Block hashes extended from a prefix's (or cut from a longer sequence's) are the ones hashed
from scratch: the engine's captures reuse their request's hashes this way."""

from hypothesis import given
from hypothesis import strategies as st

from ninfer.lifecycle.hashing import HASH_BLOCK, block_hashes, extend_block_hashes, starts_with

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


small = st.lists(st.integers(0, 3), max_size=4 * HASH_BLOCK)   # few ids: prefixes often agree


@given(small, small, cuts, cuts, st.data())
def test_starts_with_is_the_comparison_of_ids(a, b, a_known, b_known, data):
    """With the block hashes of any prefix of each (or none), `starts_with` answers what
    comparing the ids answers: its early rejections never reject a true prefix."""
    if data.draw(st.booleans()):
        b = a[:data.draw(st.integers(0, len(a)))]   # a true prefix, or a's own ids
    hashes, prefix_hashes = block_hashes(a[:a_known]), block_hashes(b[:b_known])
    assert starts_with(a, b, hashes, prefix_hashes) == (a[:len(b)] == b)
    assert starts_with(tuple(a), tuple(b)) == (a[:len(b)] == b)


def test_starts_with_rejects_on_a_block_hash_without_comparing_ids():
    """Two sequences whose last ids agree but whose blocks differ are told apart by the
    hashes given (ids that would compare equal stand in, to show the ids were not read)."""
    a, b = list(range(3 * HASH_BLOCK)), [7, *range(1, 2 * HASH_BLOCK)]

    class Equal(list):
        def __getitem__(self, i):   # a slice of it compares equal to anything
            return Equal(super().__getitem__(i)) if isinstance(i, slice) \
                else super().__getitem__(i)

        def __eq__(self, other):
            return True

        def __ne__(self, other):
            return False

    assert not starts_with(Equal(a), b, block_hashes(a), block_hashes(b))
    assert starts_with(Equal(a), b)   # without the hashes: compared, and "equal"
