"""The crash the simulator injects is real: the step runs, its one journal transaction
never commits, the file is reopened as a killed process leaves it, and recovery closes
what the lost step had left open."""

from ninfer.engine.engine import EngineConfig
from ninfer.lifecycle.checks import JournalChecker
from ninfer.lifecycle.journal import Journal
from ninfer.sim.clock import VirtualClock
from ninfer.sim.faults import reopen_after_crash, step_without_commit
from ninfer.sim.harness import Harness

PROMPT = tuple((i * 11 + 3) % 97 for i in range(1, 30))


def test_a_crash_cuts_the_journal_between_two_commits(tmp_path):
    clock = VirtualClock()
    journal = Journal.open(tmp_path / "j.db")
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=4), journal=journal, clock=clock)
    seen = []
    h.engine.log.listeners.append(seen.append)
    rid = h.submit(PROMPT, "s", max_tokens=8)
    h.step(3)
    committed = journal.last_seq
    clock.advance(1.5)
    step_without_commit(h.engine)
    assert seen[-1].seq > committed, "the lost step emitted events (clients saw them)"
    reopened = reopen_after_crash(journal)
    assert reopened.last_seq == committed  # cut at the transaction boundary
    h.checker = JournalChecker().feed_all(reopened.read())
    h.restart(keep_tensors=True, journal=reopened)
    h.check()
    interrupted = [e for e in reopened.read(committed + 1) if e.kind == "RequestFailed"]
    assert [(e.request, e.failure, e.time) for e in interrupted] == [(rid, "interrupted", 1.5)]
    assert h.submit(PROMPT, "s", max_tokens=4)  # and serving goes on
    h.run()
    h.check()
    JournalChecker().feed_all(reopened.read())
    reopened.close()


def test_a_crash_during_recovery_loses_only_recovery(tmp_path):
    """Killed again before recovery commits: the next recovery starts from the same
    journal and closes the same requests."""
    from ninfer.sim.faults import boot_without_commit

    journal = Journal.open(tmp_path / "j.db")
    h = Harness(EngineConfig(spec="none", prefill_chunk=4), journal=journal)
    rid = h.submit(PROMPT, "s", max_tokens=8)
    h.step(2)
    committed = journal.last_seq
    journal = reopen_after_crash(journal)
    boot_without_commit(lambda: h.restart(keep_tensors=True, journal=journal))
    journal = reopen_after_crash(journal)
    assert journal.last_seq == committed
    h.checker = JournalChecker().feed_all(journal.read())
    h.restart(keep_tensors=True, journal=journal)
    h.check()
    failed = [e for e in journal.read(committed + 1) if e.kind == "RequestFailed"]
    assert [e.request for e in failed] == [rid]
    journal.close()
