"""The journal: round trips, append-only, seq discipline, file modes, opening errors, torn WAL."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ninfer.lifecycle import journal as journal_module
from ninfer.lifecycle import journalfile
from ninfer.lifecycle.events import (
    CheckpointCaptured,
    EndpointPublished,
    PrefillAdvanced,
    RequestFailed,
    RequestQueued,
    ServerStarted,
    TokensCommitted,
    with_envelope,
)
from ninfer.lifecycle.facts import CheckpointFacts, EndpointFacts, Mode
from ninfer.lifecycle.journal import Journal, JournalError
from ninfer.lifecycle.journalfile import SCHEMA_VERSION

CHECKPOINT = CheckpointFacts(
    id="k1", position=32, block_hashes=(11, 22), prefix_hash=22, attn_kv=32, recurrent_at=32,
    mtp_kv=31, hidden_at=None, fenced=True, model="sim", dtypes="int", tokens=None)


def stamped(events, first_seq=1):
    return [with_envelope(ev, first_seq + i, 1000.0 + i) for i, ev in enumerate(events)]


def sample(first_seq=1, n=1, request="r1"):
    """`n` small events, seqs from `first_seq`."""
    return stamped([PrefillAdvanced(request=request, conversation="c1", cursor=i)
                    for i in range(n)], first_seq)


def every_kind():
    return stamped([
        ServerStarted(mode=Mode("none", "sim", "int"), max_concurrency=2, max_endpoints=8,
                      options={"content": "tokens", "nested": {"a": [1, 2]}}),
        RequestQueued(request="r1", conversation="c1", tenant="t", prompt_len=3,
                      block_hashes=(), tokens=(1, 2, 3), params={"temperature": 0.5}),
        RequestQueued(request="r2", tenant="t", prompt_len=3, block_hashes=(7,), tokens=None),
        PrefillAdvanced(request="r1", conversation="c1", cursor=5),
        CheckpointCaptured(request="r1", conversation="c1", checkpoint=CHECKPOINT),
        EndpointPublished(request="r1", conversation="c1", endpoint=EndpointFacts(
            id="e1", kind="private", tenant="t", session="s", checkpoint=CHECKPOINT)),
        TokensCommitted(request="r1", conversation="c1", tokens=(4, 5), frontier=5,
                        drafted=2, accepted=1),
        RequestFailed(request="r2", failure="internal", message="boom \u2014 \u00e9"),
    ])


def mode(path):
    return os.stat(path).st_mode & 0o777


# --- round trips and seq discipline ------------------------------------------------------


def test_round_trip_of_every_kind_through_a_file(tmp_path):
    events = every_kind()
    with Journal.open(tmp_path / "j.db") as j:
        j.append(events[:3])
        j.append(events[3:])
        assert list(j.read()) == events
    with Journal.open(tmp_path / "j.db") as j:
        assert list(j.read()) == events
        assert list(j.read(start_seq=4)) == events[3:]
        assert j.count() == len(events)


def test_read_is_in_seq_order_and_streams(tmp_path):
    with Journal.open(tmp_path / "j.db") as j:
        for first in range(1, 3001, 300):
            j.append(sample(first, 300, request=f"r{first}"))
        seqs = [ev.seq for ev in j.read()]
        assert seqs == list(range(1, 3001))
        stream = j.read(2990)
        assert next(stream).seq == 2990  # a generator: nothing read before the first next()
        assert [ev.seq for ev in stream] == list(range(2991, 3001))


@given(st.lists(st.integers(min_value=0, max_value=5), max_size=8), st.integers(1, 40))
def test_any_batching_reads_back_the_same_events(sizes, start):
    j = Journal.memory()
    events, seq = [], 1
    for n in sizes:
        batch = sample(seq, n, request=f"r{seq}")
        j.append(batch)
        events += batch
        seq += n
    assert list(j.read()) == events
    assert list(j.read(start)) == events[start - 1:]
    assert j.last_seq == len(events) == j.count()


@pytest.mark.parametrize("seqs, word", [
    ([2], "gap"), ([1, 3], "gap"), ([0], "repeats"), ([1, 1], "repeats"), ([1, 2, 2], "repeats"),
])
def test_gap_or_repeat_is_refused_and_nothing_is_written(seqs, word):
    j = Journal.memory()
    j.append(sample(1, 3))
    batch = [with_envelope(ev, s + 3, 0.0) for ev, s in zip(sample(1, len(seqs)), seqs,
                                                             strict=True)]
    with pytest.raises(JournalError, match=word):
        j.append(batch)
    assert j.count() == 3 and j.last_seq == 3
    j.append(sample(4, 1))
    assert j.last_seq == 4


def test_reopening_keeps_last_seq_and_refuses_a_repeat(tmp_path):
    with Journal.open(tmp_path / "j.db") as j:
        j.append(sample(1, 7))
    with Journal.open(tmp_path / "j.db") as j:
        assert j.last_seq == 7
        with pytest.raises(JournalError, match="seq 1 repeats.*expected seq 8"):
            j.append(sample(1, 1))
        j.append(sample(8, 2))
        assert [ev.seq for ev in j.read()] == list(range(1, 10))


def test_append_is_one_transaction(tmp_path):
    with Journal.open(tmp_path / "j.db") as j:
        statements = []
        j.db.conn.set_trace_callback(statements.append)
        j.append(sample(1, 50))
        j.db.conn.set_trace_callback(None)
        assert [s for s in statements if s in ("BEGIN", "COMMIT")] == ["BEGIN", "COMMIT"]
        assert not j.db.conn.in_transaction
        other = sqlite3.connect(tmp_path / "j.db")  # committed: visible to another connection
        assert other.execute("SELECT COUNT(*) FROM events").fetchone() == (50,)
        # a row written behind the journal's back makes the 2nd insert fail: all or nothing
        other.execute("INSERT INTO events VALUES (52, 0, NULL, NULL, 'PrefillAdvanced', '{}')")
        other.commit()
        other.close()
        with pytest.raises(JournalError, match="UNIQUE"):
            j.append(sample(51, 3))
        assert j.count() == 51 and j.last_seq == 50 and not j.db.conn.in_transaction


# --- the database refuses changes, and the files are private ------------------------------


@pytest.mark.parametrize("sql", ["UPDATE events SET kind = 'X' WHERE seq = 1",
                                 "DELETE FROM events WHERE seq = 1", "DELETE FROM events"])
def test_update_and_delete_are_refused_by_the_database(tmp_path, sql):
    with Journal.open(tmp_path / "j.db") as j:
        j.append(sample(1, 2))
    conn = sqlite3.connect(tmp_path / "j.db")
    with pytest.raises(sqlite3.IntegrityError, match="events are append-only"):
        conn.execute(sql)
    conn.close()
    with Journal.open(tmp_path / "j.db") as j:
        assert list(j.read()) == sample(1, 2)


def test_files_are_created_0600(tmp_path):
    path = tmp_path / "j.db"
    with Journal.open(path) as j:
        j.append(sample(1, 10))
        for name in (path, f"{path}-wal", f"{path}-shm"):
            assert mode(name) == 0o600, name


def test_meta_holds_schema_application_and_identity(tmp_path):
    identity = {"model": {"name": "sim", "digest": "ab12"}, "options": {"content": "hashes"}}
    with Journal.open(tmp_path / "j.db", identity=identity) as j:
        j.set_meta("note", [1, "two"])
        with pytest.raises(ValueError, match="reserved"):
            j.set_meta("schema_version", 9)
    with Journal.open(tmp_path / "j.db", identity={"options": {"content": "tokens"}}) as j:
        assert j.meta == {"schema_version": SCHEMA_VERSION, "application": "ninfer",
                          "model": identity["model"], "options": {"content": "tokens"},
                          "note": [1, "two"]}
    raw = dict(sqlite3.connect(tmp_path / "j.db").execute("SELECT key, value FROM meta"))
    assert raw["schema_version"] == str(SCHEMA_VERSION)


def test_memory_journal_is_cheap_and_fresh(monkeypatch):
    """Every Hypothesis example builds one: the schema is prepared once and copied (a count,
    not a timing: timings belong to benchmarks)."""
    from ninfer.lifecycle import journal as journal_module
    prepared = []
    real = journal_module._prepare
    monkeypatch.setattr(journal_module, "_prepare",
                        lambda *a, **kw: (prepared.append(a), real(*a, **kw))[1])
    monkeypatch.setattr(Journal, "_template", None)
    journals = [Journal.memory() for _ in range(200)]
    assert len(prepared) == 1
    journals[0].append(sample(1, 3))
    assert journals[1].count() == 0 and journals[1].last_seq == 0
    assert journals[1].meta["schema_version"] == SCHEMA_VERSION


def test_older_schema_is_migrated_in_order(tmp_path, monkeypatch):
    with Journal.open(tmp_path / "j.db") as j:
        j.append(sample(1, 2))
    applied = []
    later = SCHEMA_VERSION + 1

    def migrate(db):
        applied.append(later)
        db["notes"].create({"id": int, "text": str}, pk="id")

    monkeypatch.setattr(journalfile, "SCHEMA_VERSION", later)
    monkeypatch.setitem(journal_module.MIGRATIONS, later, migrate)
    with Journal.open(tmp_path / "j.db") as j:
        assert j.meta["schema_version"] == later and "notes" in j.db.table_names()
        assert list(j.read()) == sample(1, 2)
    with Journal.open(tmp_path / "j.db"):
        assert applied == [later]


# --- opening errors ----------------------------------------------------------------------


def test_newer_schema_version_is_refused(tmp_path):
    Journal.open(tmp_path / "j.db").close()
    conn = sqlite3.connect(tmp_path / "j.db")
    conn.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(JournalError, match=r"j\.db.*newer ninfer: schema version 7, "
                                           rf"this build reads up to {SCHEMA_VERSION}"):
        Journal.open(tmp_path / "j.db")


def test_a_file_that_is_not_a_database_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("just some text, not SQLite\n" * 100)
    with pytest.raises(JournalError, match=r"notes\.txt.*not a database"):
        Journal.open(path)
    assert path.read_text().startswith("just some text")


@pytest.mark.parametrize("schema", [
    ["CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)"],
    ["CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)",
     "CREATE TABLE events (seq INTEGER PRIMARY KEY)"],
    ["CREATE TABLE meta (k, v)"],
])
def test_a_foreign_sqlite_database_is_refused(tmp_path, schema):
    conn = sqlite3.connect(tmp_path / "other.db")
    for sql in schema:
        conn.execute(sql)
    conn.commit()
    conn.close()
    with pytest.raises(JournalError, match=r"other\.db.*foreign schema"):
        Journal.open(tmp_path / "other.db")


def test_an_unknown_event_kind_names_its_seq(tmp_path):
    with Journal.open(tmp_path / "j.db") as j:
        j.append(sample(1, 3))
    shutil.copy(tmp_path / "j.db", tmp_path / "copy.db")
    conn = sqlite3.connect(tmp_path / "copy.db")
    conn.execute("INSERT INTO events VALUES (4, 0, 'r9', NULL, 'FutureThingHappened', '{}')")
    conn.commit()
    conn.close()
    with Journal.open(tmp_path / "copy.db") as j:
        assert j.last_seq == 4
        stream = j.read()
        assert [next(stream) for _ in range(3)] == sample(1, 3)
        with pytest.raises(JournalError, match="undecodable 'FutureThingHappened' event at seq 4: "
                                               "unknown event kind 'FutureThingHappened'"):
            next(stream)


def test_a_bad_payload_names_its_seq(tmp_path):
    with Journal.open(tmp_path / "j.db") as j:
        j.append(sample(1, 2))
    conn = sqlite3.connect(tmp_path / "j.db")
    conn.execute("INSERT INTO events VALUES (3, 0, 'r1', 'c1', 'PrefillAdvanced', '{\"x\": 1}')")
    conn.commit()
    conn.close()
    with Journal.open(tmp_path / "j.db") as j, pytest.raises(JournalError, match="at seq 3"):
        list(j.read())


def big_journal(path, n=5000):
    with Journal.open(path) as j:
        j.append(stamped([PrefillAdvanced(request=f"r{i}", conversation=f"c{i % 7}", cursor=i)
                          for i in range(n)]))
    return path.read_bytes()


def test_a_truncated_database_is_refused(tmp_path):
    data = big_journal(tmp_path / "j.db")
    for fraction in (0.3, 0.99):
        path = tmp_path / f"cut{fraction}.db"
        path.write_bytes(data[:int(len(data) * fraction)])
        with pytest.raises(JournalError, match=rf"cut{fraction}\.db.*damaged database: truncated"):
            Journal.open(path)


def test_damage_is_only_ever_a_journal_error(tmp_path):
    data = big_journal(tmp_path / "j.db")
    page = 4096
    refused = 0
    for k, offset in enumerate(range(page, len(data) - page, len(data) // 40)):
        damaged = bytearray(data)
        damaged[offset:offset + 300] = bytes((offset + i * 37) % 256 for i in range(300))
        path = tmp_path / f"damaged{k}.db"
        path.write_bytes(bytes(damaged))
        try:
            with Journal.open(path) as j:
                list(j.read())
                j.count()
                assert j.meta["application"] == "ninfer"
        except JournalError as e:
            assert str(path) in str(e)
            refused += 1
    assert refused > 0
    path = tmp_path / "wiped.db"  # every b-tree page after the schema wiped: surely refused
    path.write_bytes(data[:page * 2] + b"\xff" * (len(data) - page * 2))
    with pytest.raises(JournalError, match="damaged database|not a database"):
        with Journal.open(path) as j:
            list(j.read())


# --- torn WAL tail -----------------------------------------------------------------------


def write_three_appends(path):
    """An open journal with three appends in its WAL, and the WAL's size after each append."""
    j = Journal.open(path)
    j.db.execute("PRAGMA wal_autocheckpoint=0")  # keep every transaction in the WAL
    wal = Path(f"{path}-wal")
    sizes = []
    for first in (1, 4, 7):
        j.append(sample(first, 3, request=f"r{first}"))
        sizes.append(wal.stat().st_size)
    return j, sizes


def copy_open_journal(path, to):
    to.mkdir()
    shutil.copy(path, to / path.name)
    shutil.copy(f"{path}-wal", to / f"{path.name}-wal")
    return to / path.name


def test_a_torn_wal_tail_opens_up_to_the_last_complete_transaction(tmp_path, caplog):
    j, sizes = write_three_appends(tmp_path / "j.db")
    copy = copy_open_journal(tmp_path / "j.db", tmp_path / "copy")
    j.close()
    cut = (sizes[1] + sizes[2]) // 2  # in the middle of the last transaction's frames
    os.truncate(f"{copy}-wal", cut)
    with caplog.at_level(logging.WARNING, logger="ninfer.journal"):
        torn = Journal.open(copy)
    assert torn.torn_tail_bytes == cut - sizes[1] > 0
    [record] = [r for r in caplog.records if r.name == "ninfer.journal"]
    assert record.levelno == logging.WARNING
    assert f"{cut - sizes[1]} bytes" in record.getMessage()
    assert "incomplete transaction" in record.getMessage()
    assert list(torn.read()) == sample(1, 3, "r1") + sample(4, 3, "r4")
    assert torn.last_seq == 6
    torn.append(sample(7, 1))  # and the journal goes on from there
    torn.close()
    with Journal.open(copy) as again:
        assert again.torn_tail_bytes == 0 and again.last_seq == 7


def test_an_intact_wal_opens_without_a_warning(tmp_path, caplog):
    j, _ = write_three_appends(tmp_path / "j.db")
    copy = copy_open_journal(tmp_path / "j.db", tmp_path / "copy")
    j.close()
    with caplog.at_level(logging.WARNING, logger="ninfer.journal"), Journal.open(copy) as intact:
        assert intact.torn_tail_bytes == 0
        assert list(intact.read()) == sample(1, 3, "r1") + sample(4, 3, "r4") + sample(7, 3, "r7")
    assert not [r for r in caplog.records if r.name == "ninfer.journal"]


def test_frames_left_from_an_earlier_wal_generation_are_not_a_torn_tail(tmp_path, caplog):
    path = tmp_path / "j.db"
    j = Journal.open(path)
    j.append(sample(1, 2000))
    j.db.execute("PRAGMA wal_checkpoint(RESTART)")
    size = Path(f"{path}-wal").stat().st_size
    j.append(sample(2001, 1))  # restarts the WAL: new salts, the old frames stay behind it
    assert Path(f"{path}-wal").stat().st_size == size
    copy = copy_open_journal(path, tmp_path / "copy")
    j.close()
    assert journalfile.scan_wal(Path(f"{copy}-wal")).torn_bytes == 0
    with caplog.at_level(logging.WARNING, logger="ninfer.journal"), Journal.open(copy) as j2:
        assert j2.torn_tail_bytes == 0 and j2.last_seq == 2001
    assert not caplog.records


def test_a_torn_frame_checksum_is_a_torn_tail(tmp_path, caplog):
    j, sizes = write_three_appends(tmp_path / "j.db")
    copy = copy_open_journal(tmp_path / "j.db", tmp_path / "copy")
    j.close()
    with open(f"{copy}-wal", "r+b") as f:  # a full-length last frame whose page was not written
        f.seek(sizes[2] - 100)
        f.write(b"\x00" * 100)
    with caplog.at_level(logging.WARNING, logger="ninfer.journal"), Journal.open(copy) as j2:
        assert j2.torn_tail_bytes == sizes[2] - sizes[1]
        assert j2.last_seq == 6
    assert "discarded" in caplog.text


def test_one_writer_at_a_time(tmp_path):
    """A second writer on the same journal (another `ninfer serve` pointed at it) is refused
    by name, before it writes anything; the lock goes with the first writer's close, and
    stays held across a rotation."""
    path = tmp_path / "journal.db"
    first = Journal.open(path)
    with pytest.raises(JournalError, match=f"in use by another writer \\(pid {os.getpid()}\\)"):
        Journal.open(path)
    first = first.rotate()
    with pytest.raises(JournalError, match="in use"):
        Journal.open(path)
    first.close()
    Journal.open(path).close()


def test_the_wal_is_copied_only_once_enough_rows_wait_in_it(tmp_path):
    """A copy that empties the WAL makes the next commit start it over (0.4-0.6 ms where a
    commit takes 0.05): copied every 0.2 s, that was every next turn's first token."""
    import time
    with Journal.open(tmp_path / "j.db") as j:
        j._wal.min_bytes = 3_000
        j.append(sample(1, 20))
        time.sleep(3 * j._wal.every)
        assert j._wal.copies == 0 and 0 < j._wal.pending < 3_000
        j.append(sample(21, 600))
        deadline = time.monotonic() + 10
        while j._wal.copies == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert j._wal.copies == 1 and j._wal.pending < 3_000


def test_the_wal_is_copied_into_the_file_by_a_thread_of_its_own(tmp_path):
    """The writer (the engine thread) never checkpoints: SQLite's automatic checkpoint ran
    inside whichever commit crossed 1,000 pages (16-22 ms at 32K contexts). The copier's
    thread does, and the writer's close, the last, merges and removes the WAL."""
    import time
    path = tmp_path / "j.db"
    with Journal.open(path) as j:
        assert j._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
        before = os.path.getsize(path)
        j._wal.min_bytes = 1   # (the default waits for megabytes of rows)
        j.append(sample(1, 2000))
        deadline = time.monotonic() + 10
        while os.path.getsize(path) <= before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.path.getsize(path) > before   # copied without the writer's doing
        assert j._wal.copies > 0
        thread = j._wal._thread
    assert not thread.is_alive()
    assert not Path(f"{path}-wal").exists() or os.path.getsize(f"{path}-wal") == 0
    with Journal.open(path) as j:   # what was copied reads back, and more goes on
        assert list(j.read()) == sample(1, 2000)
        j.append(sample(2001, 1))
