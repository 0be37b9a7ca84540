"""One engine thread owns everything; client threads only submit and cancel."""

import random
import threading

import pytest

from ninfer.engine.engine import EngineConfig, Submit
from ninfer.engine.thread import EngineThread
from ninfer.lifecycle.checks import JournalChecker
from ninfer.lifecycle.request import SamplingParams
from ninfer.sim.harness import Harness


def test_clients_on_many_threads_submit_and_cancel():
    h = Harness(EngineConfig(spec="mtp", max_concurrency=3, prefill_chunk=4))
    h.engine.log.listeners.clear()   # the checker reads the journal afterwards instead
    runner = EngineThread(h.engine).start()
    handles, lock = {}, threading.Lock()

    def client(n):
        rng = random.Random(n)
        for i in range(4):
            prompt = tuple(rng.randrange(97) for _ in range(rng.randrange(5, 40)))
            rid = f"c{n}-{i}"
            handle = runner.submit(Submit(rid, prompt, f"s{n}", "t", SamplingParams(8)))
            with lock:
                handles[rid] = (handle, prompt)
            if i % 2:
                runner.cancel(rid)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rid, (handle, prompt) in handles.items():
        outcome = handle.wait(10)
        assert outcome is not None, f"{rid} never ended"
        assert outcome.kind in ("RequestFinished", "RequestCancelled")
        if outcome.kind == "RequestFinished":
            assert h.engine.requests[rid].outputs == h.engine.model.reference_generate(prompt, 8)
    runner.stop()
    assert runner.error is None
    assert sum(o.kind == "RequestCancelled" for o in (x.outcome for x, _ in handles.values()))
    JournalChecker().feed_all(h.journal.read())
    h.engine.check_integrity()


def test_invalid_requests_are_refused_before_admission():
    h = Harness(EngineConfig())
    runner = EngineThread(h.engine).start()
    bad = [Submit("a", (), "s", "t", SamplingParams()),
           Submit("b", (1, 500), "s", "t", SamplingParams()),
           Submit("c", (1, 2), "s", "t", SamplingParams(max_tokens=0)),
           Submit("d", (1, 2), "s", "t", SamplingParams(), boundaries=(5,))]
    for command in bad:
        with pytest.raises(ValueError):
            runner.submit(command)
    ok = runner.submit(Submit("e", (1, 2), "s", "t", SamplingParams(2)))
    assert ok.wait(5).kind == "RequestFinished"
    with pytest.raises(ValueError):
        runner.submit(Submit("e", (1, 2), "s", "t", SamplingParams(2)))
    runner.stop()
    assert [e.request for e in h.journal.read() if e.kind == "RequestQueued"] == ["e"]


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_client_hears_only_of_what_the_journal_holds():
    """Found by `ninfer fuzz sim`: events used to reach clients as they were emitted, before
    their step's commit, so a crash in between told a client "finished" while the journal
    said nothing of it. Now a failed commit leaves the client with the engine's failure."""
    from ninfer.lifecycle.journal import JournalError
    h = Harness(EngineConfig(prefill_chunk=64))
    h.engine.log.listeners.clear()
    runner = EngineThread(h.engine)
    real = h.journal.append

    def fail_on_the_finish(events):
        if any(e.kind == "RequestFinished" for e in events):
            raise JournalError("disk full")
        real(events)

    h.journal.append = fail_on_the_finish
    seen = []
    handle = runner.start().submit(Submit("r1", tuple(range(1, 20)), "s", "t",
                                          SamplingParams(3)), on_event=seen.append)
    outcome = handle.wait(10)
    runner.stop()
    assert outcome is not None and outcome.kind == "RequestFailed"
    assert "disk full" in outcome.message
    assert "RequestFinished" not in [e.kind for e in seen]
    assert "RequestFinished" not in [e.kind for e in h.journal.read()]
    # the thread ended on the failure, which it keeps for its owner (logged once, not
    # raised into threading's excepthook)
    assert not runner.alive and "disk full" in repr(runner.error)


def test_a_batch_is_released_once_every_handle_has_its_events():
    """A step's events reach every handle before any handle hears the batch is complete:
    the server wakes its event loop then, once per step, with every stream's tokens."""
    h = Harness(EngineConfig(prefill_chunk=64, max_concurrency=2))
    h.engine.log.listeners.clear()
    runner = EngineThread(h.engine)
    log: list[tuple[str, str]] = []
    handles = []
    for rid in ("a", "b"):
        handles.append(runner.submit(
            Submit(rid, tuple(range(1, 12)), None, "t", SamplingParams(4)),
            on_event=lambda e: log.append(("event", e.request)),
            on_released=lambda rid=rid: log.append(("released", rid))))
    runner.start()
    for handle in handles:
        assert handle.wait(10) is not None
    runner.stop()
    # the log is blocks of a batch's events then its releases, one per handle that had one
    blocks: list[tuple[list[str], list[str]]] = []
    for what, rid in log:
        if what == "event" and (not blocks or blocks[-1][1]):
            blocks.append(([], []))
        (blocks[-1][0] if what == "event" else blocks[-1][1]).append(rid)
    for events, released in blocks:
        assert sorted(released) == sorted(set(events))
    assert any(sorted(released) == ["a", "b"] for _, released in blocks)
