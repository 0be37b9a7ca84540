"""`ninfer bench engine`'s forced drafts: "forced right" must be right for the verify rounds
that check them (every one accepted), "forced wrong" never accepted, on the default model."""

import pytest

from ninfer.bench.engine import Bench
from ninfer.engine.engine import run_until_idle
from ninfer.engine.speculative import AdaptiveDraft


@pytest.fixture(scope="module")
def bench():
    return Bench(None, "cpu", "float32")


def test_drafts_forced_right_are_all_accepted_and_drafting_is_adaptive_again_after(bench):
    adaptive = AdaptiveDraft.next_k, AdaptiveDraft.drafts_next
    r = bench.decode(1, tokens=24, spec="mtp", drafts="accept")  # (its answers: every round
    assert r["drafted"] >= 15 and r["accepted"] == r["drafted"]  # drafting, forced wrong)
    assert r["tokens_per_verify"] > 3
    assert (AdaptiveDraft.next_k, AdaptiveDraft.drafts_next) == adaptive


def test_drafts_forced_wrong_are_never_accepted_and_the_drafter_is_put_back(bench):
    adaptive = AdaptiveDraft.next_k, AdaptiveDraft.drafts_next
    r = bench.decode(1, tokens=24, spec="mtp", drafts="reject")
    assert r["drafted"] > 0 and r["accepted"] == 0
    assert (AdaptiveDraft.next_k, AdaptiveDraft.drafts_next) == adaptive


def test_forced_right_drafts_are_the_verify_rounds_own_tokens(bench):
    prompt = bench.prompt(40)
    answers = bench.verify_answers([prompt], 12)[prompt]
    engine = bench.engine()  # plain decode: on the CPU in float32 the same tokens
    rid = bench.submit(engine, prompt, 12)
    run_until_idle(engine)
    assert answers == tuple(engine.requests[rid].outputs) and len(answers) == 12
