"""Size-based rotation: the full file is renamed, the new one opens with StoreSnapshotted at
the next seq; replay and check start from the snapshot, seqs stay gap-free across files,
and a restart on the new file recovers from it alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ninfer.engine.engine import EngineConfig
from ninfer.lifecycle import events as ev
from ninfer.lifecycle.checks import JournalChecker
from ninfer.lifecycle.journal import Journal, chain
from ninfer.lifecycle.reader import JournalReader
from ninfer.lifecycle.store import ContinuationStore, InvariantViolation
from ninfer.sim.harness import Harness
from ninfer.tools.journal import main as journal_main

PROMPT = tuple((i * 11 + 3) % 97 for i in range(1, 50))


def _files(path: Path) -> list[Path]:
    """The rotated files in seq order, then the current one."""
    files = chain(path)
    rotated = sorted(path.parent.glob(f"{path.stem}.*-*{path.suffix}"),
                     key=lambda p: int(p.name.split(".")[1].split("-")[0]))
    assert files == [*rotated, path]  # the meta links name every rotated file, in order
    return files


def _conversation_load(h: Harness, turns: int) -> str:
    """Turns of two conversations, the last request of one left running."""
    prompts = {"a": PROMPT, "b": PROMPT[::-1]}
    for _ in range(turns):
        for session, prompt in prompts.items():
            rid = h.submit(prompt, session, max_tokens=6)
            h.run()
            h.check()
            prompts[session] = prompt + tuple(h.request(rid).outputs) + (5, 6)
    running = h.submit(prompts["a"], "a", max_tokens=40)
    h.step(4)
    h.check()
    return running


@pytest.fixture
def rotating(tmp_path):
    path = tmp_path / "journal.db"
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=8, check_reuse=True), num_blocks=400,
                journal=Journal.open(path, max_bytes=24 * 1024))
    yield h, path
    h.journal.close()


def test_files_chain_gap_free_and_each_opens_with_a_snapshot(rotating):
    h, path = rotating
    running = _conversation_load(h, 6)
    files = _files(path)
    assert len(files) >= 3, "the load should rotate at least twice"
    expected_first, previous = 1, None
    for f in files:   # read-only: the current file's writer is still at work
        with JournalReader.open(f) as j:
            events = list(j.events())
        assert events[0].seq == expected_first
        if previous is not None:
            assert isinstance(events[0], ev.StoreSnapshotted)
            assert events[0].previous == previous.name
        expected_first, previous = events[-1].seq + 1, f
    assert h.request(running).state in ("Prefilling", "Active")
    # checking the whole chain in order verifies every snapshot against the fold before it
    checker = JournalChecker()
    for f in files:
        with JournalReader.open(f) as j:
            checker.feed_all(j.events())


def test_the_current_file_alone_replays_and_checks(rotating):
    h, path = rotating
    running = _conversation_load(h, 6)
    h.run()
    h.check()
    with JournalReader.open(path) as j:
        assert ContinuationStore.replay(j.events()) == h.engine.store
        first = next(iter(j.events()))
        assert isinstance(first, ev.StoreSnapshotted) and first.seq > 1
        JournalChecker().feed_all(j.events())
    assert h.request(running).state == "Finished"
    assert journal_main(["journal", "check", str(path)]) == 0


def test_a_restart_on_a_rotated_file_recovers_from_its_snapshot(rotating):
    h, path = rotating
    running = _conversation_load(h, 6)
    with JournalReader.open(path) as j:
        snapshot = next(iter(j.events()))
    assert len(snapshot.store["endpoints"]) >= 2, "the snapshot carries endpoints"
    h.restart(keep_tensors=True)
    h.check()
    failed = [e for e in h.journal.read() if e.kind == "RequestFailed"]
    assert [e.request for e in failed] == [running]
    assert [e.failure for e in failed] == ["interrupted"]
    # the endpoints survive the restart, and the conversation goes on reusing them
    rid = h.submit(h.request(running).prompt, "a", max_tokens=4)
    h.run()
    h.check()
    assert h.request(rid).plan.kind != "Root"


def test_a_snapshot_that_differs_from_the_fold_is_a_violation(rotating):
    h, path = rotating
    _conversation_load(h, 6)
    files = _files(path)
    store = ContinuationStore()
    with Journal.open(files[0]) as j:
        for e in j.read():
            store.apply(e)
    with Journal.open(files[1]) as j:
        snap = next(iter(j.read()))
    assert store.endpoints, "the first file leaves endpoints behind"
    tampered = dataclasses.replace(snap, store={**snap.store, "endpoints": []})
    with pytest.raises(InvariantViolation) as info:
        store.apply(tampered)
    assert info.value.invariant == 5
    store.apply(snap)  # the real one agrees


def test_an_empty_rotated_file_continues_its_predecessors_seqs(tmp_path):
    path = tmp_path / "j.db"
    with Journal.open(path) as j:
        j.append([ev.with_envelope(ev.PrefillAdvanced(request="r", cursor=i), i + 1, 0.0)
                  for i in range(5)])
        new = j.rotate()  # a crash before the snapshot is written leaves it empty
    new.close()
    with Journal.open(path) as again:
        assert again.last_seq == 5 and again.meta["previous"] == "j.1-5.db"
        with pytest.raises(Exception, match="leaves a gap"):
            again.append([ev.with_envelope(ev.PrefillAdvanced(request="r", cursor=9), 7, 0.0)])
        again.append([ev.with_envelope(ev.PrefillAdvanced(request="r", cursor=9), 6, 0.0)])
    assert (tmp_path / "j.1-5.db").exists()


def test_the_tools_read_a_rotated_file(rotating, capsys):
    h, path = rotating
    _conversation_load(h, 6)
    h.run()
    h.journal.close()
    for command in ("replay", "stats", "check"):
        assert journal_main(["journal", command, "--json", str(path)]) == 0, command
    capsys.readouterr()
    assert journal_main(["journal", "replay", "--json", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["outcomes"]["open"] == 0  # the carried request ended in this file
    assert summary["store"]["endpoints"] == len(h.engine.store.endpoints)
