"""A restart on the same journal: open requests fail as interrupted, endpoints whose tensors
did not survive (or that the new mode cannot use) are lost, and serving goes on."""

from ninfer.engine.engine import EngineConfig
from ninfer.lifecycle.checks import JournalChecker
from ninfer.lifecycle.store import ContinuationStore
from ninfer.sim.harness import Harness

PROMPT = tuple((i * 13 + 5) % 97 for i in range(1, 40))


def _turn(h, prompt, max_tokens=5):
    rid = h.submit(prompt, "s", max_tokens=max_tokens)
    h.run()
    h.check()
    r = h.request(rid)
    assert r.state == "Finished"
    assert r.outputs == h.engine.model.reference_generate(prompt, max_tokens)
    return r


def _kinds(h, kind):
    return [e for e in h.journal.read() if e.kind == kind]


def test_a_crash_interrupts_open_requests_and_loses_tensors():
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=6, check_reuse=True))
    first = _turn(h, PROMPT)
    open_request = h.submit(PROMPT + (1, 2, 3), "s", max_tokens=30)
    h.step(3)
    h.restart(keep_tensors=False)
    h.check()
    interrupted = [e for e in _kinds(h, "RequestFailed") if e.failure == "interrupted"]
    assert [e.request for e in interrupted] == [open_request]
    assert _kinds(h, "EndpointLost") and not h.engine.store.endpoints
    nxt = _turn(h, PROMPT + tuple(first.outputs) + (4,))
    assert nxt.plan.kind == "Root"
    JournalChecker().feed_all(h.journal.read())
    assert ContinuationStore.from_journal(h.journal) == h.engine.store


def test_kept_tensors_survive_into_a_mode_that_can_use_them():
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=6, check_reuse=True))
    first = _turn(h, PROMPT)
    h.restart(keep_tensors=True, spec="none")
    assert not _kinds(h, "EndpointLost")
    nxt = _turn(h, PROMPT + tuple(first.outputs) + (4,))
    assert (nxt.plan.kind, nxt.plan.reuse_base) == ("PrivateEndpoint", len(PROMPT) + 4)


def test_endpoints_without_mtp_parts_are_lost_when_mtp_comes_on():
    h = Harness(EngineConfig(spec="none", prefill_chunk=6, check_reuse=True))
    first = _turn(h, PROMPT)
    h.restart(keep_tensors=True, spec="mtp")
    lost = _kinds(h, "EndpointLost")
    assert lost and ("hidden state" in lost[0].reason or "MTP KV" in lost[0].reason)
    nxt = _turn(h, PROMPT + tuple(first.outputs) + (4,))
    assert nxt.plan.kind == "Root"
    JournalChecker().feed_all(h.journal.read())
