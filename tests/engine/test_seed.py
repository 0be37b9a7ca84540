"""The seed incident and its neighbours: a request cut at an awkward moment under MTP, then
the conversation's next request. It must get a valid plan, finish, and say what a Root run
says; the journal must pass every check."""

import pytest

from ninfer.engine.engine import EngineConfig
from ninfer.sim.harness import Harness

from ..model.nets import TENSOR_PARALLEL, torch_factory

PROMPT = tuple((i * 31 + 7) % 97 for i in range(1, 60))


def _harness(spec="mtp", **kw):
    # SimModel; the tiny torch model sharded over the ranks under NINFER_TEST_TENSOR_PARALLEL
    return Harness(EngineConfig(spec=spec, prefill_chunk=8, draft_tokens=3, check_reuse=True,
                                **kw),
                   model_factory=torch_factory if TENSOR_PARALLEL > 1 else None)


def _events(h, kind, request=None):
    return [e for e in h.journal.read() if e.kind == kind and request in (None, e.request)]


def _next_turn_is_sound(h, cut, prompt=PROMPT, max_tokens=6):
    """Submit the same messages again; it must plan validly, finish, and equal Root."""
    rid = h.submit(prompt, "s", max_tokens=max_tokens)
    h.run()
    h.check()
    r = h.request(rid)
    assert r.state == "Finished", r.state
    assert r.outputs == h.engine.model.reference_generate(prompt, max_tokens)
    started = _events(h, "RequestStarted", rid)[-1]
    finished = _events(h, "RequestFinished", rid)[-1]
    assert finished.cached_tokens == started.reuse_base < len(prompt)
    return started


def _cancel_at(h, cut, predicate, max_steps=100):
    for _ in range(max_steps):
        h.step()
        if predicate(h.request(cut)):
            break
    else:
        raise AssertionError("never reached the state to cancel in")
    h.engine.cancel(cut)
    h.step()
    h.check()
    return _events(h, "RequestCancelled", cut)[0]


def test_seed_cancel_mid_prefill_under_mtp_refuses_the_lagging_frontier():
    h = _harness()
    cut = h.submit(PROMPT, "s", max_tokens=64)
    cancelled = _cancel_at(h, cut, lambda r: r.state == "Prefilling" and r.cursor >= 24)
    assert cancelled.at_state == "Prefilling"
    refused = _events(h, "PublicationRefused", cut)
    assert refused and "MTP KV covers" in refused[0].reason
    published = _events(h, "EndpointPublished", cut)
    assert published and published[0].endpoint.position < 24  # an earlier, complete capture
    started = _next_turn_is_sound(h, cut)
    assert started.plan == "PrivateEndpoint"
    assert started.reuse_base == published[0].endpoint.position


def test_without_mtp_a_cut_prefill_resumes_from_its_last_committed_chunk():
    h = _harness(spec="none")
    cut = h.submit(PROMPT, "s", max_tokens=64)
    _cancel_at(h, cut, lambda r: r.state == "Prefilling" and r.cursor >= 24)
    frontier = h.request(cut).cursor
    started = _next_turn_is_sound(h, cut)
    assert (started.plan, started.reuse_base) == ("PrivateEndpoint", frontier)


def test_cancel_at_the_first_token():
    h = _harness()
    cut = h.submit(PROMPT, "s", max_tokens=64)
    cancelled = _cancel_at(h, cut, lambda r: r.state == "Active" and len(r.outputs) == 1)
    assert cancelled.at_state == "Active"
    assert "MTP KV covers" in _events(h, "PublicationRefused", cut)[0].reason
    _next_turn_is_sound(h, cut)


@pytest.mark.skipif(TENSOR_PARALLEL > 1, reason="the frontier is complete when SimModel's "
                    "MTP layer keeps up; the random torch model's may lag, whole or sharded alike, "
                    "and an earlier capture is published")
def test_cancel_between_draft_and_verify():
    h = _harness()
    cut = h.submit(PROMPT, "s", max_tokens=64)
    h.step(12)
    assert h.request(cut).state == "Active"
    h.engine.draft_hook = lambda request: request.id == cut
    frontier = h.request(cut).cursor
    h.step()
    h.engine.draft_hook = None
    assert h.request(cut).state == "Cancelled"
    assert h.request(cut).cursor == frontier, "the round was discarded as a whole"
    h.check()
    published = _events(h, "EndpointPublished", cut)
    assert published[0].endpoint.position == frontier  # a complete frontier: nothing lags
    continued = PROMPT + tuple(h.request(cut).outputs) + (5, 6, 7)
    started = _next_turn_is_sound(h, cut, prompt=continued)
    assert started.reuse_base == frontier


def test_cancel_in_finishable():
    h = _harness()
    cut = h.submit(PROMPT, "s", max_tokens=1)   # stops at the first token, MTP still lagging
    cancelled = _cancel_at(h, cut, lambda r: r.state == "Finishable")
    assert cancelled.at_state == "Finishable"
    _next_turn_is_sound(h, cut)


def test_a_finished_turn_under_mtp_publishes_its_frontier():
    h = _harness()
    first = h.submit(PROMPT, "s", max_tokens=1)
    h.run()
    assert _events(h, "EndpointPublished", first)[0].endpoint.position == len(PROMPT)
    nxt = PROMPT + tuple(h.request(first).outputs) + (1, 2)
    started = _next_turn_is_sound(h, first, prompt=nxt)
    assert started.reuse_base == len(PROMPT)


def _two_long_requests(num_blocks):
    """Two lanes in a pool too small for both: one of them is preempted. Both must still
    finish with a Root run's output."""
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=8, max_concurrency=2, check_reuse=True),
                num_blocks=num_blocks, num_slots=16)
    a = h.submit(PROMPT, "a", max_tokens=12)
    b = h.submit(PROMPT[::-1], "b", max_tokens=12)
    h.run()
    h.check()
    for rid, prompt in ((a, PROMPT), (b, PROMPT[::-1])):
        r = h.request(rid)
        assert r.state == "Finished"
        assert r.outputs == h.engine.model.reference_generate(prompt, 12)
    return h, a, b


def test_a_preempted_request_resumes_and_matches_root():
    h, _, _ = _two_long_requests(num_blocks=40)
    assert _events(h, "RequestPreempted"), "the pool was meant to run out"


def test_a_weakened_predicate_reproduces_the_seed(monkeypatch):
    """Drop the MTP clause: the lagging frontier is published, and the next request of the
    conversation fails to materialize it (the seed's HTTP 500), every time."""
    from dataclasses import replace

    from ninfer.lifecycle import salvage
    real = salvage.materializable
    monkeypatch.setattr(salvage, "materializable",
                        lambda cp, mode: real(cp, replace(mode, spec="none")))
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=8), oracle=False)
    h.engine.log.listeners.clear()  # let the failures happen; the journal records them
    cut = h.submit(PROMPT, "s", max_tokens=64)
    _cancel_at(h, cut, lambda r: r.state == "Prefilling" and r.cursor >= 24)
    assert not _events(h, "PublicationRefused", cut), "the weakened predicate refused nothing"
    for _ in range(3):
        rid = h.submit(PROMPT, "s", max_tokens=6)
        h.run()
        assert h.request(rid).state == "Failed"
        failed = _events(h, "RequestFailed", rid)[0]
        assert failed.failure == "internal" and "missing" in failed.message


def test_parts_written_in_the_step_in_flight_are_not_fenced():
    """The newest lane runs out of blocks and preempts an older one that has already
    worked in this step: its parts are not fenced yet, so nothing of it is published."""
    h, a, _ = _two_long_requests(num_blocks=44)
    assert [e.request for e in _events(h, "RequestPreempted")] == [a]
    refused = _events(h, "PublicationRefused", a)
    assert refused and all("device work" in e.reason for e in refused)


def test_a_capture_is_fenced_once_its_step_commits():
    h = _harness()
    h.submit(PROMPT, "s", max_tokens=4)
    h.step(2)
    captured = _events(h, "CheckpointCaptured")
    assert captured and not captured[-1].checkpoint.fenced  # captured mid-step
    live = next(iter(h.engine.live.values()))
    assert all(h.engine._facts(held).fenced for held in live.captures)


def test_a_request_preempted_while_decoding_resumes_from_its_frontier():
    """Found by `ninfer fuzz stateful`: preempted in Active under MTP, the request resumes
    from its own published frontier with nothing to prefill; its first draft must still come
    from an MTP forward at frontier-1 (whose entry was already written)."""
    h = _harness()
    rid = h.submit(PROMPT, "s", max_tokens=12)
    h.step()
    while h.request(rid).state != "Active" or len(h.request(rid).outputs) < 3:
        h.step()
    h.engine.preempt(rid)
    h.run()
    h.check()
    r = h.request(rid)
    assert r.state == "Finished" and r.plan.kind == "PrivateEndpoint"
    assert r.plan.reuse_base > len(PROMPT)  # prompt and decoded tokens were kept
    assert r.outputs == h.engine.model.reference_generate(PROMPT, 12)
