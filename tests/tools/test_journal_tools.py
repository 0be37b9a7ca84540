"""`ninfer journal` commands on journals the SimModel harness writes."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3

import pytest

from ninfer.engine.engine import EngineConfig
from ninfer.lifecycle import events as ev
from ninfer.lifecycle.journal import Journal
from ninfer.lifecycle.reader import JournalReader
from ninfer.sim.harness import Harness
from ninfer.tools.journal import main


@pytest.fixture(scope="module")
def journal(tmp_path_factory) -> str:
    """A cancel mid-prefill under MTP (two refused publications), then the same conversation
    resumed from the salvaged endpoint to the end."""
    path = tmp_path_factory.mktemp("j") / "j.db"
    j = Journal.open(path)
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=8), journal=j)
    rid = h.submit(tuple(range(1, 40)), "s", max_tokens=6)
    h.step(2)
    h.engine.cancel(rid)
    h.step()
    h.submit(tuple(range(1, 40)), "s", max_tokens=6)
    h.run()
    j.close()
    return str(path)


def events_of(path: str) -> list[ev.Event]:
    with Journal.open(path) as j:
        return list(j.read())


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["journal", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv: str):
    rc, out, _ = run(capsys, *argv, "--json")
    return rc, json.loads(out)


def test_replay_summary_counts_match_the_events(journal, capsys):
    before = os.stat(journal).st_mtime_ns, open(journal, "rb").read()
    evs = events_of(journal)
    rc, s = run_json(capsys, "replay", journal)
    assert rc == 0
    assert s["events"] == len(evs)
    assert s["requests"] == sum(e.kind == "RequestQueued" for e in evs) == 2
    assert s["outcomes"] == {"cancelled(Prefilling)": 1, "finished": 1, "open": 0}
    assert s["plans"] == {"Root": 1, "PrivateEndpoint": 1}
    assert s["published"] == {"private": sum(e.kind == "EndpointPublished" for e in evs)}
    refusals = [e.reason for e in evs if e.kind == "PublicationRefused"]
    assert refusals and sum(s["refused"].values()) == len(refusals)
    assert set(s["refused"]) == set(refusals)
    # the retry's endpoint extends the cut request's: that branch moved forward
    assert s["evicted"] == {"superseded": 1} and s["lost"] == {}
    assert s["store"]["endpoints"] == 1 and s["store"]["by_kind"] == {"private": 1}
    rc, out, _ = run(capsys, "replay", journal)
    assert rc == 0 and "2 requests" in out and refusals[0] in out
    assert (os.stat(journal).st_mtime_ns, open(journal, "rb").read()) == before  # read-only
    assert not os.path.exists(journal + "-wal") and not os.path.exists(journal + "-shm")


def test_check_passes_on_a_good_journal(journal, capsys):
    rc, out, _ = run(capsys, "check", journal)
    n = len(events_of(journal))
    assert rc == 0
    assert out.strip() == f"{n} events, 2 requests: every journal-checkable invariant holds"


def damaged_copy(src: str, dst, extra_after_seq: int) -> None:
    """`src`'s events copied into `dst` with a second copy of the event at `extra_after_seq`
    inserted after it, the seqs renumbered so they stay gap-free."""
    evs = events_of(src)
    dup = next(e for e in evs if e.seq == extra_after_seq)
    out = []
    for e in evs[:extra_after_seq] + [dup] + evs[extra_after_seq:]:
        out.append(dataclasses.replace(e, seq=len(out) + 1))
    with Journal.open(dst) as j:
        j.append(out)


def test_check_names_the_invariant_seq_and_request_of_a_second_terminal(journal, tmp_path,
                                                                        capsys):
    cancel = next(e for e in events_of(journal) if e.kind == "RequestCancelled")
    bad = tmp_path / "bad.db"
    damaged_copy(journal, bad, cancel.seq)
    rc, out, _ = run(capsys, "check", str(bad))
    assert rc == 1
    assert f"invariant 4 at seq {cancel.seq + 1}, request {cancel.request}" in out
    assert "after the request's terminal event" in out
    lead = [line for line in out.splitlines() if line.startswith("  seq")]
    assert lead[-2:] and all("RequestCancelled" in line for line in lead[-2:])
    rc, doc = run_json(capsys, "check", str(bad))
    assert rc == 1 and (doc["invariant"], doc["seq"], doc["request"]) == (
        4, cancel.seq + 1, cancel.request)
    assert [e["seq"] for e in doc["lead_up"]][-1] == cancel.seq + 1
    assert all(e["request"] == cancel.request for e in doc["lead_up"])


def test_check_catches_a_wrong_cached_tokens_inserted_behind_the_triggers(journal, tmp_path,
                                                                           capsys):
    bad = tmp_path / "bad.db"
    bad.write_bytes(open(journal, "rb").read())
    conn = sqlite3.connect(bad)
    conn.execute("DROP TRIGGER events_refuse_update")
    row = conn.execute("SELECT seq, data FROM events WHERE kind='RequestFinished'").fetchone()
    data = json.loads(row[1]) | {"cached_tokens": 0}
    conn.execute("UPDATE events SET data=? WHERE seq=?", (json.dumps(data), row[0]))
    conn.commit()
    conn.close()
    rc, doc = run_json(capsys, "check", str(bad))
    assert rc == 1 and doc["invariant"] == 10 and doc["seq"] == row[0]


@pytest.mark.parametrize("content", [b"not a database at all" * 10, None])
def test_unreadable_journals_exit_2(tmp_path, capsys, content):
    path = tmp_path / "x.db"
    if content is None:
        sqlite3.connect(path).execute("CREATE TABLE other (a)").connection.close()
    else:
        path.write_bytes(content)
    for command in ("check", "replay", "stats", "export"):
        rc, _, err = run(capsys, command, str(path))
        assert rc == 2 and str(path) in err and "Traceback" not in err
    rc, _, err = run(capsys, "check", str(tmp_path / "missing.db"))
    assert rc == 2 and "no such file" in err


def test_check_reports_an_unknown_kind_with_exit_2(journal, tmp_path, capsys):
    bad = tmp_path / "bad.db"
    bad.write_bytes(open(journal, "rb").read())
    conn = sqlite3.connect(bad)
    conn.execute("INSERT INTO events VALUES (999, 0.0, NULL, NULL, 'Bogus', '{}')")
    conn.commit()
    conn.close()
    rc, _, err = run(capsys, "check", str(bad))
    assert rc == 2 and "'Bogus'" in err and "seq 999" in err


def test_show_lists_a_request_in_order_with_the_refusal_reason(journal, capsys):
    evs = [e for e in events_of(journal) if e.request == "r1"]
    rc, out, _ = run(capsys, "show", journal, "--request", "r1")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == len(evs)
    assert [line.split()[1] for line in lines] == [f"#{e.seq}" for e in evs]
    assert [line.split()[3] for line in lines] == [e.kind for e in evs]
    refusal = next(e for e in evs if e.kind == "PublicationRefused")
    assert any(f"@{refusal.position}: {refusal.reason}" in line for line in lines)
    assert "plan=Root reuse_base=0" in out and "at_state=Prefilling" in out
    rc, doc = run_json(capsys, "show", journal, "--conversation", "s")
    assert rc == 0 and [x["request"] for x in doc][0] == "r1"
    assert [x["seq"] for x in doc] == sorted(x["seq"] for x in doc)
    # the conversation's own events, and the eviction of the endpoint its retry superseded
    assert {x["request"] for x in doc} == {"r1", "r2", None}
    assert [x["kind"] for x in doc if x["request"] is None] == ["EndpointEvicted"]
    assert [x for x in doc if x["request"]][-1]["terminal"]
    assert "plan=PrivateEndpoint reuse_base=8" in " ".join(x["detail"] for x in doc)
    rc, _, err = run(capsys, "show", journal, "--request", "nope")
    assert rc == 1 and "no events" in err


def test_stats_are_consistent_with_the_events(journal, capsys):
    evs = events_of(journal)
    rc, s = run_json(capsys, "stats", journal)
    assert rc == 0
    commits = [e for e in evs if e.kind == "TokensCommitted"]
    drafted, accepted = sum(e.drafted for e in commits), sum(e.accepted for e in commits)
    assert (s["drafted"], s["accepted"]) == (drafted, accepted) and drafted > 0
    assert s["acceptance"] == pytest.approx(accepted / drafted)
    assert s["span_s"] == pytest.approx(evs[-1].time - evs[0].time)
    assert s["requests_per_s"] == pytest.approx(2 / s["span_s"])
    starts = [e for e in evs if e.kind == "RequestStarted"]
    assert s["mean_reuse_ratio"] == pytest.approx(sum(e.reuse_base / 39 for e in starts) / 2)
    queued = next(e for e in evs if e.kind == "RequestQueued" and e.request == "r2")
    ttft = commits[0].time - queued.time
    assert s["ttft_median_s"] == pytest.approx(ttft) == s["ttft_p90_s"]
    assert s["cancellations"] == {"Prefilling": 1}
    assert s["tokens_committed"] == sum(len(e.tokens) for e in commits) == 6
    def reached(rid):
        return [e.cursor for e in evs if e.kind == "PrefillAdvanced" and e.request == rid][-1]

    assert starts[0].reuse_base == 0  # each request prefilled from its start to its last cursor
    assert s["prefill_tokens_computed"] == reached("r1") + reached("r2") - starts[1].reuse_base
    assert s["cut_prefills"] == {}
    rc, out, _ = run(capsys, "stats", journal)
    assert rc == 0 and "acceptance" in out


def test_export_round_trips(journal, tmp_path, capsys):
    evs = events_of(journal)
    out = tmp_path / "out.jsonl"
    rc, _, _ = run(capsys, "export", journal, "--jsonl", "-o", str(out))
    lines = out.read_text().splitlines()
    assert rc == 0 and len(lines) == len(evs)
    back = [ev.from_row(d["seq"], d["time"], d["request"], d["conversation"], d["kind"],
                        json.dumps(d["data"])) for d in map(json.loads, lines)]
    assert back == evs
    # the ids a row packs are exported as lists, for a person or a script
    queued = [d["data"] for d in map(json.loads, lines) if d["kind"] == "RequestQueued"]
    assert queued and all(isinstance(d["tokens"], list) for d in queued)
    assert [tuple(d["tokens"]) for d in queued] == [e.tokens for e in evs
                                                     if e.kind == "RequestQueued"]
    rc, stdout, _ = run(capsys, "export", journal, "--jsonl")
    assert rc == 0 and stdout.splitlines() == lines
    rc, doc = run_json(capsys, "export", journal)
    assert [d["seq"] for d in doc] == [e.seq for e in evs]


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["journal", "--help"])
    out = capsys.readouterr().out
    assert all(c in out for c in ("replay", "check", "show", "stats", "export"))


def test_a_progress_bar_on_stderr_above_the_threshold(journal, capsys, monkeypatch):
    import ninfer.tools.scan as tools  # the threshold of every journal command
    monkeypatch.setattr(tools, "PROGRESS_MIN", 0)
    rc, out, err = run(capsys, "check", journal)
    assert rc == 0 and "ev" in err and "holds" in out
    monkeypatch.setattr(tools, "PROGRESS_MIN", 100_000)
    assert run(capsys, "check", journal)[2] == ""


def _copy_with(journal, tmp_path, sql: str, *params) -> str:
    bad = tmp_path / "bad.db"
    bad.write_bytes(open(journal, "rb").read())
    conn = sqlite3.connect(bad)
    conn.execute("DROP TRIGGER events_refuse_update")
    conn.execute("DROP TRIGGER events_refuse_delete")
    conn.execute(sql, params)
    conn.commit()
    conn.close()
    return str(bad)


def test_a_gap_in_seq_is_named_by_check_and_replay(journal, tmp_path, capsys):
    bad = _copy_with(journal, tmp_path, "DELETE FROM events WHERE seq = 7")
    rc, doc = run_json(capsys, "check", bad)
    assert rc == 1 and doc["invariant"] == 4 and doc["seq"] == 8
    rc, out, err = run(capsys, "replay", bad)
    assert rc == 1 and "seq gap after 6" in err and "Traceback" not in err


def test_check_says_how_far_it_verified_before_an_unreadable_event(journal, tmp_path, capsys):
    bad = _copy_with(journal, tmp_path, "UPDATE events SET data = '{\"cursor\": ' WHERE seq = 12")
    rc, out, err = run(capsys, "check", bad)
    assert rc == 2 and "undecodable" in err and "seq 12" in err
    assert "11 events (up to seq 11) were read" in err and "Traceback" not in err
    rc, doc = run_json(capsys, "check", bad)
    assert rc == 2 and doc["verified_up_to_seq"] == 11 and not doc["ok"]
    for command in ("replay", "stats"):
        rc, _, err = run(capsys, command, bad)
        assert rc == 2 and "seq 12" in err and "Traceback" not in err


def test_a_newer_schema_is_refused_by_name(journal, tmp_path, capsys):
    bad = _copy_with(journal, tmp_path,
                     "UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    for command in ("check", "replay", "stats", "export", "redrive"):
        rc, _, err = run(capsys, command, bad)
        assert rc == 2 and "newer ninfer" in err, command


def test_lean_reading_leaves_token_ids_out_and_nothing_else(journal):
    with JournalReader.open(journal) as src:
        full, lean = list(src.events()), list(src.events(lean=True))
    assert len(full) == len(lean)
    for a, b in zip(full, lean, strict=True):
        if a.kind == "RequestQueued":
            assert b.tokens is None and a.tokens and a.prompt_len == b.prompt_len
        elif a.kind in ("EndpointPublished", "CheckpointCaptured"):
            fa = a.endpoint.checkpoint if a.kind == "EndpointPublished" else a.checkpoint
            fb = b.endpoint.checkpoint if b.kind == "EndpointPublished" else b.checkpoint
            assert fb.tokens is None
            assert fa.tokens or a.kind == "CheckpointCaptured"  # a capture's: never journaled
            assert dataclasses.replace(fa, tokens=None) == fb
        else:
            assert a == b


def test_a_torn_wal_tail_is_read_up_to_the_last_complete_transaction(journal, tmp_path,
                                                                     capsys, caplog):
    """As README says of the journal commands: a warning, then the complete transactions
    (the files a killed server leaves: the database and its WAL, the second append in it
    cut mid-write)."""
    evs = events_of(journal)
    path, killed = tmp_path / "j.db", tmp_path / "killed"
    path.write_bytes(open(journal, "rb").read())
    j = Journal.open(path)
    j.db.execute("PRAGMA wal_autocheckpoint=0")  # the next two appends stay in the WAL
    more = [dataclasses.replace(e, seq=len(evs) + 1 + i) for i, e in enumerate(evs[:2])]
    j.append(more[:1])
    committed = os.path.getsize(f"{path}-wal")
    j.append(more[1:])
    killed.mkdir()
    for name in ("j.db", "j.db-wal"):
        (killed / name).write_bytes((tmp_path / name).read_bytes())
    j.close()
    os.truncate(killed / "j.db-wal", committed + 100)
    with caplog.at_level("WARNING", logger="ninfer.journal"):
        rc, s = run_json(capsys, "stats", str(killed / "j.db"))
    assert rc == 0 and s["events"] == len(evs) + 1
    assert any("discarded 100 bytes" in r.getMessage() for r in caplog.records)
