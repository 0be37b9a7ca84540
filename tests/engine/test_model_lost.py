"""A model lost mid-step (a tensor-parallel rank died or stalled, `ModelLost`): every request
in flight or waiting fails as `interrupted`, in one committed transaction, the journal passes
every check, and the step raises (the engine cannot go on); the thread ends its handles
likewise and says the model was lost."""

import pytest

from ninfer.engine.engine import EngineConfig, Submit
from ninfer.engine.thread import EngineThread
from ninfer.lifecycle.request import SamplingParams
from ninfer.model.protocol import ModelLost
from ninfer.sim.harness import Harness

PROMPT = tuple(range(1, 30))


def _lose_after(model, calls: int, monkeypatch) -> None:
    real, seen = model.forward_batch, [0]

    def forward_batch(*args, **kwargs):
        seen[0] += 1
        if seen[0] > calls:
            raise ModelLost("rank 1 lost during forward_batch: Connection closed by peer")
        return real(*args, **kwargs)
    monkeypatch.setattr(model, "forward_batch", forward_batch)


def test_a_lost_model_fails_every_request_as_interrupted_and_the_step_raises(monkeypatch):
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=8, max_concurrency=2))
    ids = [h.submit(PROMPT, f"s{i}", max_tokens=32) for i in range(3)]  # one waits
    h.step(6)
    assert {h.request(r).state for r in ids} >= {"Active", "Queued"}
    _lose_after(h.engine.model, 0, monkeypatch)
    with pytest.raises(ModelLost):
        h.engine.step()
    assert [h.request(r).state for r in ids] == ["Failed"] * 3
    failed = [e for e in h.journal.read() if e.kind == "RequestFailed"]
    assert sorted(e.request for e in failed) == ids  # committed, not left in the log
    assert all(e.failure == "interrupted" and "lost" in e.message for e in failed)
    h.check()  # the journal checker (fed every event) and the store's fold agree


def test_the_thread_stops_saying_the_model_was_lost_and_ends_its_handles(monkeypatch):
    h = Harness(EngineConfig(spec="none", prefill_chunk=8))
    _lose_after(h.engine.model, 2, monkeypatch)
    thread = EngineThread(h.engine).start()
    try:
        handle = thread.submit(Submit("t1", PROMPT, "s", "t", SamplingParams(max_tokens=64)))
        assert handle.done.wait(10)
        assert handle.outcome.kind == "RequestFailed"
        assert handle.outcome.failure == "interrupted"
        thread._thread.join(10)
        assert thread.model_lost and not thread.alive
    finally:
        thread.stop()
