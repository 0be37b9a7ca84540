"""Admission hashes only the prompt's blocks past the longest held checkpoint that begins it
(a next turn's prompt is its last turn's and a few tokens), and the hashes are the ones
hashed from scratch: for next turns, for branches that diverge inside a block, for another
tenant's prompt (which never borrows) and for checkpoints captured on the way."""

from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.engine.engine import EngineConfig, Submit, make_sim_engine, run_until_idle
from ninfer.lifecycle.hashing import HASH_BLOCK, block_hashes
from ninfer.lifecycle.request import SamplingParams


def _run(engine, rid, prompt, session="k", tenant="t", max_tokens=3):
    engine.submit(Submit(rid, tuple(prompt), session, tenant,
                         SamplingParams(max_tokens=max_tokens)))
    run_until_idle(engine)
    return engine.requests[rid]


def _check(engine, request):
    assert request.hashes == block_hashes(request.prompt)
    assert request.sequence_hashes == block_hashes(request.sequence)
    for held in engine.held.values():
        assert held.hashes == block_hashes(held.tokens)


def test_a_next_turn_borrows_its_last_turns_hashes():
    engine = make_sim_engine(EngineConfig(check_reuse=True, auto_anchors=2))
    first = _run(engine, "r1", range(1, 5 * HASH_BLOCK + 3))
    _check(engine, first)
    borrowed = engine._known_hashes(Submit("x", first.sequence + (7, 8), "k", "t",
                                           SamplingParams()))
    assert borrowed and len(borrowed) * HASH_BLOCK <= len(first.sequence)
    assert engine._known_hashes(Submit("x", first.sequence, "k", "other",
                                       SamplingParams())) == ()
    second = _run(engine, "r2", first.sequence + (7, 8, 9), max_tokens=4)
    _check(engine, second)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 90), min_size=1, max_size=4 * HASH_BLOCK),
       st.lists(st.tuples(st.integers(0, 6 * HASH_BLOCK), st.lists(st.integers(1, 90),
                                                                   min_size=1, max_size=20)),
                min_size=1, max_size=4))
def test_admitted_hashes_equal_hashed_from_scratch(start, turns):
    """Each turn cuts the last sequence somewhere (a branch, an edit) and adds tokens."""
    engine = make_sim_engine(EngineConfig(check_reuse=True, auto_anchors=2))
    request = _run(engine, "r0", start)
    _check(engine, request)
    for i, (cut, extra) in enumerate(turns, 1):
        prompt = request.sequence[:cut] + tuple(extra)
        request = _run(engine, f"r{i}", prompt, session="k" if i % 3 else "j")
        _check(engine, request)
