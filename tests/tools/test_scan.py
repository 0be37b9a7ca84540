"""`journal check` and `journal replay` read a journal in fast passes (ninfer/tools/scan.py):
payloads only of the kinds they read, the request checks in a second process. Whatever a
journal holds, they must find what the plain checker finds on the fully decoded events:
the same first problem at the same seq, the same count verified before it."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.lifecycle.checks import JournalChecker
from ninfer.lifecycle.journal import JournalError
from ninfer.lifecycle.reader import JournalReader
from ninfer.lifecycle.store import ContinuationStore, InvariantViolation
from ninfer.sim import run_simulation
from ninfer.tools import scan

SEEDS = (3, 11)   # scenarios with cancels, preemptions and restarts


@pytest.fixture(scope="module")
def journals(tmp_path_factory) -> dict[int, Path]:
    work = tmp_path_factory.mktemp("scan")
    out = {}
    for seed in SEEDS:
        run_simulation(seed, 150, work)
        out[seed] = work / f"sim-{seed}.db"
    return out


def reference(path: Path) -> tuple[str, int | None, int | None, int]:
    """(outcome, invariant, seq, events verified) by decoding every event and feeding the
    one checker the stateful tests use."""
    conn = sqlite3.connect(path)
    checker, verified = JournalChecker(), 0
    decode = JournalReader(conn, str(path)).decode   # (lists that name earlier rows' too)
    try:
        for row in conn.execute("SELECT seq, time, request, conversation, kind, data "
                                "FROM events ORDER BY seq"):
            try:
                e = decode(row)
            except Exception:  # noqa: BLE001 - an unreadable event, as the tools say
                return "unreadable", None, row[0], verified
            try:
                checker.feed(e)
            except InvariantViolation as v:
                return "violation", v.invariant, v.seq, verified
            verified += 1
    finally:
        conn.close()
    return "ok", None, None, verified


def reference_replay(path: Path) -> tuple[str, int | None, int | None]:
    """Where the fold of every decoded event stops, as the first replay did."""
    conn = sqlite3.connect(path)
    store, last = ContinuationStore(), 0
    decode = JournalReader(conn, str(path)).decode
    try:
        for row in conn.execute("SELECT seq, time, request, conversation, kind, data "
                                "FROM events ORDER BY seq"):
            if last and row[0] != last + 1:
                return "violation", 4, row[0]
            last = row[0]
            try:
                e = decode(row)
            except Exception:  # noqa: BLE001
                return "unreadable", None, row[0]
            try:
                store.apply(e)
            except InvariantViolation as v:
                return "violation", v.invariant, v.seq
    finally:
        conn.close()
    return "ok", None, None


def fast_replay(path: Path) -> tuple[str, int | None, int | None]:
    try:
        with JournalReader.open(path) as src:
            scan.replay_summary(src)
    except InvariantViolation as v:
        return "violation", v.invariant, v.seq
    except JournalError as v:
        return "unreadable", None, int(str(v).split(" event at seq ")[1].split(":")[0])
    return "ok", None, None


def fast(path: Path, parallel: bool) -> tuple[str, int | None, int | None, int]:
    with JournalReader.open(path) as src:
        done, v = scan.check(src, parallel=parallel)
    if v is None:
        return "ok", None, None, done.events
    if isinstance(v, InvariantViolation):
        return "violation", v.invariant, v.seq, done.events
    assert isinstance(v, JournalError)
    seq = int(str(v).split(" event at seq ")[1].split(":")[0])
    return "unreadable", None, seq, done.events


# one damage at a time: what a torn copy, a bug in the writer or a hand edit leaves
_INT_FIELDS = ("cursor", "frontier", "reuse_base", "cached_tokens", "prompt_len",
               "max_concurrency", "completion_tokens", "count")


def damage(path: Path, tmp: Path, how: str, at: float, delta: int) -> Path:
    bad = tmp / f"bad-{how}.db"
    shutil.copy(path, bad)
    conn = sqlite3.connect(bad)
    conn.execute("DROP TRIGGER events_refuse_update")
    conn.execute("DROP TRIGGER events_refuse_delete")
    rows = conn.execute("SELECT seq, kind, request, data FROM events ORDER BY seq").fetchall()
    seq, kind, request, data = rows[int(at * (len(rows) - 1))]
    if how == "delete":
        conn.execute("DELETE FROM events WHERE seq = ?", (seq,))
    elif how == "field":
        fields = [f for f in _INT_FIELDS if f'"{f}":' in data and f'"{f}":null' not in data]
        path_ = f"$.{fields[0]}" if fields else "$.endpoint.checkpoint.position"
        conn.execute("UPDATE events SET data = json_set(data, ?, "
                     "coalesce(json_extract(data, ?), 0) + ?) WHERE seq = ? AND "
                     "json_type(data, ?) IS NOT NULL", (path_, path_, delta, seq, path_))
    elif how == "request":
        others = sorted({r[2] for r in rows if r[2] is not None} - {request})
        to = others[delta % len(others)] if others and delta % 2 else "ghost"
        conn.execute("UPDATE events SET request = ? WHERE seq = ?", (to, seq))
    elif how == "torn":
        conn.execute("UPDATE events SET data = substr(data, 1, length(data) - 2) "
                     "WHERE seq = ?", (seq,))
    elif how == "kind":
        conn.execute("UPDATE events SET kind = 'SomethingNew' WHERE seq = ?", (seq,))
    elif how == "endpoint":
        conn.execute("UPDATE events SET data = json_set(data, '$.endpoint', 'ep:gone') "
                     "WHERE seq = (SELECT seq FROM events WHERE seq >= ? AND kind = "
                     "'RequestStarted' AND json_extract(data, '$.endpoint') IS NOT NULL "
                     "ORDER BY seq LIMIT 1)", (seq,))
    conn.commit()
    conn.close()
    return bad


def test_the_undamaged_journals_pass_both_ways(journals):
    for path in journals.values():
        want = reference(path)
        assert want[0] == "ok" and want[3] > 300
        assert fast(path, parallel=True) == fast(path, parallel=False) == want
        assert fast_replay(path) == reference_replay(path) == ("ok", None, None)


@settings(max_examples=40)
@given(seed=st.sampled_from(SEEDS),
       how=st.sampled_from(["delete", "field", "request", "torn", "kind", "endpoint"]),
       at=st.floats(0, 1), delta=st.integers(-3, 3).filter(bool))
def test_a_damaged_journal_gets_the_checkers_verdict(journals, tmp_path_factory, seed, how,
                                                     at, delta):
    bad = damage(journals[seed], tmp_path_factory.mktemp("bad"), how, at, delta)
    want = reference(bad)
    assert fast(bad, parallel=False) == want
    assert fast(bad, parallel=True) == want
    assert fast_replay(bad) == reference_replay(bad)


def test_replay_finds_the_fold_the_checker_finds(journals):
    for path in journals.values():
        with JournalReader.open(path) as src:
            s = scan.replay_summary(src)
        checker = JournalChecker().feed_all(_decoded(path))
        store = checker.store
        assert s["store"]["applied_seq"] == store.applied_seq == s["events"]
        assert s["store"]["endpoints"] == len(store.endpoints)
        assert s["requests"] == len(checker.requests)


def _decoded(path: Path):
    conn = sqlite3.connect(path)
    decode = JournalReader(conn, str(path)).decode
    try:
        yield from (decode(r) for r in conn.execute(
            "SELECT seq, time, request, conversation, kind, data FROM events ORDER BY seq"))
    finally:
        conn.close()
