"""The journal reader: the one schema check on opening, reads filtered by kind, seq, request
or conversation, envelopes, the one unreadable-event error, and a file left as it was."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from pathlib import Path

import pytest

from ninfer.lifecycle import events as ev
from ninfer.lifecycle.events import (
    PrefillAdvanced,
    RequestCancelled,
    RequestQueued,
    RequestStarted,
    with_envelope,
)
from ninfer.lifecycle.journal import Journal, JournalError
from ninfer.lifecycle.journalfile import SCHEMA_VERSION
from ninfer.lifecycle.reader import JournalReader, UnreadableEvent

from .test_journal import copy_open_journal, sample, write_three_appends


def mixed(n_requests: int = 4) -> list:
    """Each request queued, started, two prefill steps; every other one cancelled."""
    out = []
    for i in range(n_requests):
        rid, conv = f"r{i}", f"c{i % 2}"
        out += [RequestQueued(request=rid, conversation=conv, tenant="t", prompt_len=4,
                              block_hashes=(i,), tokens=(1, 2, 3, i)),
                RequestStarted(request=rid, conversation=conv, plan="Root", endpoint=None,
                               reuse_base=0, target=4),
                PrefillAdvanced(request=rid, conversation=conv, cursor=2),
                PrefillAdvanced(request=rid, conversation=conv, cursor=4)]
        if i % 2:
            out.append(RequestCancelled(request=rid, conversation=conv, at_state="Prefilling"))
    return [with_envelope(e, seq, 100.0 + seq) for seq, e in enumerate(out, 1)]


@pytest.fixture
def journal(tmp_path) -> tuple[Path, list]:
    events = mixed()
    path = tmp_path / "j.db"
    with Journal.open(path) as j:
        j.append(events)
    return path, events


def unchanged(path: Path):
    """The files of `path`'s folder and their bytes, to compare before and after a read."""
    return {p.name: p.read_bytes() for p in sorted(path.parent.iterdir())}


# --- reading -------------------------------------------------------------------------------


def test_events_in_seq_order_filtered_by_kind_and_from_a_seq(journal):
    path, events = journal
    with JournalReader.open(path) as r:
        assert list(r.events()) == events
        assert [e.seq for e in r.events(start_seq=7)] == list(range(7, len(events) + 1))
        assert list(r.events(start_seq=len(events) + 1)) == []
        kinds = ("RequestStarted", "RequestCancelled")
        want = [e for e in events if e.kind in kinds]
        assert list(r.events(kinds=kinds)) == want and len(want) == 6
        assert list(r.events(9, kinds)) == [e for e in want if e.seq >= 9]
        assert list(r.events(kinds=())) == []


def test_events_of_one_request_or_conversation(journal):
    path, events = journal
    with JournalReader.open(path) as r:
        assert list(r.events(request="r1")) == [e for e in events if e.request == "r1"]
        assert list(r.events(conversation="c0")) == [e for e in events
                                                      if e.conversation == "c0"]
        assert list(r.events(request="r1", conversation="c0")) == []
        assert list(r.events(request="nobody")) == []


def test_rows_are_the_events_undecoded(journal):
    path, events = journal
    with JournalReader.open(path) as r:
        rows = list(r.rows(kinds=("RequestQueued",)))
        assert [r.decode(row) for row in rows] == [e for e in events
                                                   if e.kind == "RequestQueued"]
        # the raw row packs its token ids (schema version 2)
        assert json.loads(rows[0][5])["tokens"] == ev.pack((1, 2, 3, 0))
        assert ev.token_ids(json.loads(rows[0][5])["tokens"]) == (1, 2, 3, 0)
        lean = list(r.rows(kinds=("RequestQueued",), lean=True))
        assert [row[:5] for row in lean] == [row[:5] for row in rows]
        assert all(json.loads(row[5])["tokens"] is None for row in lean)


def test_envelopes_name_who_came_and_went_without_payloads(journal):
    path, events = journal
    kinds = ("RequestQueued", "RequestCancelled")
    with JournalReader.open(path) as r:
        got = list(r.envelopes(kinds))
    assert got == [(e.seq, e.request, e.conversation, e.kind) for e in events if e.kind in kinds]
    assert [kind for *_, kind in got].count("RequestCancelled") == 2
    assert got[1] == (5, "r1", "c1", "RequestQueued")


def test_meta_count_and_seq_bounds(journal, tmp_path):
    path, events = journal
    with JournalReader.open(path) as r:
        assert r.meta["application"] == "ninfer" and r.meta["schema_version"] == SCHEMA_VERSION
        assert r.count() == len(events)
        assert (r.first_seq(), r.last_seq()) == (1, len(events))
    with Journal.open(tmp_path / "next.db", identity={"first_seq": 42}):
        pass  # a rotated file before its first event: it goes on at 42
    with JournalReader.open(tmp_path / "next.db") as r:
        assert (r.count(), r.first_seq(), r.last_seq()) == (0, 42, 41)


def test_the_writer_reads_through_a_reader_of_its_own_connection(journal):
    path, events = journal
    with Journal.open(path) as j:
        assert isinstance(j.reader, JournalReader) and j.reader.conn is j.db.conn
        assert list(j.read(3, ("PrefillAdvanced",))) == list(j.reader.events(3,
                                                                               ("PrefillAdvanced",)))
        assert list(j.envelopes(("RequestQueued",))) == list(j.reader.envelopes(
            ("RequestQueued",)))
        j.append(sample(len(events) + 1, 2))  # what it wrote is read at once, file or not
        assert [e.seq for e in j.reader.events(len(events))] == [len(events) + i for i in (0, 1, 2)]


def test_a_second_reader_of_the_same_file_connects_on_its_own(journal):
    path, events = journal
    with JournalReader.open(path) as r, r.reopen() as again:
        assert again.conn is not r.conn and again.path == r.path
        assert list(again.events()) == list(r.events()) == events
    with Journal.open(path) as j, pytest.raises(JournalError, match="cannot connect again"):
        j.reader.reopen()


def test_reading_leaves_the_file_as_it_was(journal):
    path, _ = journal
    before, mtime = unchanged(path), os.stat(path).st_mtime_ns
    with JournalReader.open(path) as r:
        list(r.events())
        list(r.rows(lean=True))
        r.count()
    assert unchanged(path) == before and os.stat(path).st_mtime_ns == mtime
    # no -wal or -shm left behind (the lock file is the writer's, made when it opened)
    assert sorted(before) == ["j.db", "j.db.lock"]


# --- events that cannot be read -------------------------------------------------------------


def tampered(path: Path, sql: str, *params) -> Path:
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER IF EXISTS events_refuse_update")
    conn.execute(sql, params)
    conn.commit()
    conn.close()
    return path


def test_an_unknown_kind_is_an_unreadable_event_after_those_before_it(journal):
    path, events = journal
    tampered(path, "INSERT INTO events VALUES (?, 0, 'r9', NULL, 'SomethingNew', '{}')",
             len(events) + 1)
    with JournalReader.open(path) as r:
        stream = r.events()
        assert [next(stream) for _ in events] == events
        with pytest.raises(UnreadableEvent) as caught:
            next(stream)
    e = caught.value
    assert (e.seq, e.kind) == (len(events) + 1, "SomethingNew")
    assert str(e) == (f"journal {path}: undecodable 'SomethingNew' event at seq {e.seq}: "
                      "unknown event kind 'SomethingNew'")


@pytest.mark.parametrize("data, why", [("{\"cursor\": ", "payload is not JSON"),
                                       ("[1, 2]", "payload is not one JSON object"),
                                       ("{}", "cursor")])
def test_a_payload_that_is_not_the_kinds_names_its_seq(journal, data, why):
    path, _ = journal
    tampered(path, "UPDATE events SET data = ? WHERE seq = 3", data)
    with JournalReader.open(path) as r:
        with pytest.raises(UnreadableEvent, match=rf"undecodable 'PrefillAdvanced' event at "
                                                  rf"seq 3: .*{why}") as caught:
            list(r.events())
        assert caught.value.seq == 3
        assert [e.seq for e in r.events(4)][0] == 4  # the others still read


def test_a_pass_stopped_by_sqlite_is_named_by_the_payload_that_stopped_it(journal):
    path, _ = journal
    tampered(path, "UPDATE events SET data = '{\"cursor\": ' WHERE seq = 8")
    with JournalReader.open(path) as r:
        sql = "SELECT seq, json_extract(data, '$.cursor') FROM events ORDER BY seq"
        with pytest.raises(sqlite3.OperationalError) as stopped:
            list(r.query(sql))
        found = r.failure(stopped.value, after=2)
        assert isinstance(found, UnreadableEvent) and found.seq == 8
        assert "undecodable 'PrefillAdvanced' event at seq 8: payload is not JSON" in str(found)
        other = r.failure(sqlite3.OperationalError("disk I/O error"), after=8)
        assert not isinstance(other, UnreadableEvent)
        assert str(other) == f"journal {path}: reading events: disk I/O error"


# --- the one schema check on opening --------------------------------------------------------


def test_no_such_file(tmp_path):
    with pytest.raises(JournalError, match=r"missing\.db: no such file"):
        JournalReader.open(tmp_path / "missing.db")
    assert not (tmp_path / "missing.db").exists()


@pytest.mark.parametrize("make, match", [
    (lambda p: p.write_bytes(b"not a database at all" * 10), "file is not a database"),
    (lambda p: p.write_bytes(b""), r"foreign schema \(tables \[\]"),
    (lambda p: sqlite3.connect(p).execute("CREATE TABLE other (a)").connection.commit(),
     r"foreign schema \(tables \['other'\]"),
])
def test_a_file_that_is_not_a_journal_is_refused_and_left_alone(tmp_path, make, match):
    path = tmp_path / "x.db"
    make(path)
    before = unchanged(path)
    with pytest.raises(JournalError, match=rf"x\.db: {match}"):
        JournalReader.open(path)
    assert unchanged(path) == before


def test_a_newer_schema_is_refused(journal):
    path, _ = journal
    tampered(path, "UPDATE meta SET value = '9' WHERE key = 'schema_version'")
    with pytest.raises(JournalError, match=r"j\.db: written by a newer ninfer: schema version 9, "
                                           rf"this build reads up to {SCHEMA_VERSION}"):
        JournalReader.open(path)


@pytest.mark.parametrize("sql, match", [
    ("UPDATE meta SET value = 'x' WHERE key = 'schema_version'",
     "damaged meta: schema_version is 'x'"),
    ("INSERT INTO meta VALUES ('model', '{not json')", "damaged meta table"),
])
def test_a_damaged_meta_table_is_refused(journal, sql, match):
    path, _ = journal
    tampered(path, sql)
    with pytest.raises(JournalError, match=match):
        JournalReader.open(path)


def test_a_truncated_file_is_refused(tmp_path):
    path = tmp_path / "j.db"
    with Journal.open(path) as j:
        j.append(sample(1, 3000))
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(JournalError, match="damaged database: truncated"):
        JournalReader.open(path)


def test_a_torn_wal_tail_reads_up_to_the_last_complete_transaction(tmp_path, caplog):
    j, sizes = write_three_appends(tmp_path / "j.db")
    copy = copy_open_journal(tmp_path / "j.db", tmp_path / "copy")
    j.close()
    os.truncate(f"{copy}-wal", (sizes[1] + sizes[2]) // 2)
    database, wal = copy.read_bytes(), Path(f"{copy}-wal").read_bytes()
    with caplog.at_level(logging.WARNING, logger="ninfer.journal"), \
            JournalReader.open(copy) as r:
        assert list(r.events()) == sample(1, 3, "r1") + sample(4, 3, "r4")
    [record] = caplog.records
    assert f"discarded {len(wal) - sizes[1]} bytes" in record.getMessage()
    assert "incomplete transaction" in record.getMessage()
    assert copy.read_bytes() == database and Path(f"{copy}-wal").read_bytes() == wal
