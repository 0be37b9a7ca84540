"""Commands other threads send: a stop ends an active request as finished (it publishes
its state for the next turn), unlike a cancel; neither touches a request that has ended."""

from ninfer.engine.engine import EngineConfig
from ninfer.lifecycle.checks import JournalChecker
from ninfer.sim.harness import Harness

PROMPT = tuple(range(1, 30))


def test_a_stop_finishes_and_publishes():
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=8))
    rid = h.submit(PROMPT, "s", max_tokens=40)
    h.step()
    while h.request(rid).state != "Active" or len(h.request(rid).outputs) < 3:
        h.step()
    h.engine.stop_request(rid)
    h.run()
    h.check()
    kinds = [e.kind for e in h.journal.read() if e.request == rid]
    assert kinds[-1] == "RequestFinished" and "RequestCancelled" not in kinds
    stopped = [e for e in h.journal.read() if e.kind == "StopReached" and e.request == rid]
    assert stopped[0].reason == "stop_string"
    r = h.request(rid)
    assert len(r.outputs) < 40
    published = [e for e in h.journal.read() if e.kind == "EndpointPublished"]
    assert published[-1].endpoint.position == len(PROMPT) + len(r.outputs) - 1


def test_commands_for_ended_requests_change_nothing():
    h = Harness(EngineConfig())
    rid = h.submit(PROMPT, "s", max_tokens=3)
    h.run()
    before = h.journal.count()
    h.engine.stop_request(rid)
    h.engine.cancel(rid)
    h.engine.cancel("never-submitted")
    h.step()
    h.check()
    assert h.journal.count() == before


def test_a_server_engine_forgets_ended_requests():
    h = Harness(EngineConfig(keep_finished=False))
    done = h.submit(PROMPT, "s", max_tokens=2)
    running = h.submit(PROMPT[::-1], "t", max_tokens=50)
    for _ in range(30):
        h.step()
    assert done not in h.engine.requests and running in h.engine.requests
    h.engine.cancel(done)  # a late command for a forgotten request is harmless
    h.run()
    h.check()
    assert not h.engine.requests


def test_a_hashes_only_journal_keeps_no_token_ids_and_reuse_still_works():
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=8, journal_tokens=False,
                             check_reuse=True))
    first = h.submit(PROMPT, "s", max_tokens=4)
    h.run()
    nxt = PROMPT + tuple(h.request(first).outputs) + (3, 4)
    second = h.submit(nxt, "s", max_tokens=4)
    h.run()
    h.check()
    assert h.request(second).plan.reuse_base == len(PROMPT) + 3  # matched on hashes alone
    for e in h.journal.read():
        assert getattr(e, "tokens", None) is None
        if e.kind == "TokensCommitted":
            assert e.count >= 1 and e.logprobs is None
        facts = getattr(getattr(e, "endpoint", None), "checkpoint", None) or getattr(
            e, "checkpoint", None)
        assert facts is None or isinstance(facts, str) or facts.tokens is None
    # the journal alone still checks: outputs are counted without their ids
    checker = JournalChecker().feed_all(h.journal.read())
    assert checker.requests[second].outputs == len(h.request(second).outputs)


def test_a_prompt_with_an_id_out_of_the_vocabulary_is_refused_whole():
    """Any id below 0, at or past the vocabulary, or too large for 64 bits, wherever it is
    in the prompt, refuses the submit with the range in words; a prompt of valid ids passes."""
    from ninfer.engine.commands import Submit, problem
    from ninfer.lifecycle.request import SamplingParams

    def check(ids):
        return problem(Submit("r", tuple(ids), "s", "t", SamplingParams(4)), vocab_size=100,
                       max_context=10_000)

    good = list(range(1, 99)) * 40
    assert check(good) is None and check([0]) is None and check([99]) is None
    for bad in (-1, 100, 2**63, 2**70, -(2**70)):
        for where in (0, len(good) // 2, len(good)):
            assert check([*good[:where], bad, *good[where:]]) == \
                "token ids must be in [0, 100)", (bad, where)
