"""`ninfer journal redrive`: the recorded request stream through today's code. The same
code decides the same; a changed planner or predicate shows up as the decisions it changes;
the seed's journal (a fixed failure) redrives clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ninfer.engine.engine import EngineConfig
from ninfer.lifecycle import planner, salvage
from ninfer.lifecycle.journal import Journal
from ninfer.lifecycle.reader import JournalReader
from ninfer.sim.harness import Harness
from ninfer.tools.journal import main as journal_main
from ninfer.tools.redrive import RedriveError, read_recording, redrive

FIXTURES = Path(__file__).parents[1] / "fixtures"
PROMPT = tuple((i * 29 + 11) % 97 for i in range(1, 50))
SYSTEM = tuple((i * 5 + 1) % 97 for i in range(1, 21))


def _until(h, rid, predicate, limit=200):
    h.step()  # admitted
    for _ in range(limit):
        if predicate(h.request(rid)):
            return
        h.step()
    raise AssertionError(f"{rid} never got there")


def record(path: Path, spec: str = "mtp", journal_tokens: bool = True,
           detach: bool = False) -> Harness:
    """A session with every kind of outside input: turns, cuts in every state, a retry, a
    stop string, an operator eviction, restarts keeping and losing tensors. `detach`: the
    cut prefill goes on detached and its retry adopts it."""
    config = EngineConfig(spec=spec, prefill_chunk=8, max_concurrency=2, check_reuse=True,
                          journal_tokens=journal_tokens, detach_prefills=detach)
    h = Harness(config, num_blocks=2000, num_slots=64, journal=Journal.open(path))
    one = h.submit(PROMPT, "s1", max_tokens=6, boundaries=(20,))
    h.run()
    turn2 = PROMPT + tuple(h.request(one).outputs) + PROMPT[:30]
    cut = h.submit(turn2, "s1", max_tokens=20, boundaries=(len(PROMPT),))
    _until(h, cut, lambda r: r.state == "Prefilling" and r.cursor > len(PROMPT) + 14)
    h.engine.cancel(cut)
    h.step()
    retry = h.submit(turn2, "s1", max_tokens=6, boundaries=(len(PROMPT),))  # the seed's
    shared = h.submit(SYSTEM + PROMPT[:9], "s2", "b", max_tokens=12, shared_prefix=len(SYSTEM))
    _until(h, shared, lambda r: r.state == "Active" and len(r.outputs) >= 2)
    h.engine.cancel(shared)
    queued = h.submit(PROMPT[::-1], "s3", max_tokens=4)  # both lanes busy: it waits
    h.engine.cancel(queued)
    h.run()
    stopped = h.submit(SYSTEM + PROMPT[:5], "s4", "b", max_tokens=30, shared_prefix=len(SYSTEM))
    _until(h, stopped, lambda r: r.state == "Active" and len(r.outputs) >= 3)
    h.engine.stop_request(stopped)  # a stop string the server found
    h.run()
    h.engine.evict(next(iter(h.engine.store.endpoints)))
    h.restart(keep_tensors=True)
    h.submit(turn2 + tuple(h.request(retry).outputs), "s1", max_tokens=5)
    h.run()
    h.restart(keep_tensors=False, spec="ngram")
    h.submit(SYSTEM + PROMPT[:7], "s5", "b", max_tokens=5, shared_prefix=len(SYSTEM))
    h.run()
    h.check()
    return h


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("redrive") / "journal.db"
    record(path).journal.close()
    return path


def _redrive(path):
    with JournalReader.open(path) as src:
        return redrive(src.events(), src.meta)


def _recording(path):
    with JournalReader.open(path) as src:
        return read_recording(src.events())


def test_the_recording_holds_every_kind_of_input(recorded):
    rec = _recording(recorded)
    cuts = sorted(str(r.cut) for r in rec.requests.values() if r.cut is not None)
    assert len(cuts) == 3  # prefilling, active, queued
    assert any(r.stop_string_at for r in rec.requests.values())
    kinds = [a.kind for a in rec.actions]
    assert kinds.count("restart") == 2 and "evict" in kinds
    assert [a.lose_tensors for a in rec.actions if a.kind == "restart"] == [False, True]


def test_todays_code_decides_as_recorded(recorded):
    out = _redrive(recorded)
    assert out.violations == [] and out.stalls == []
    assert out.differences == [] and out.same
    assert out.compared == 8


def test_detached_prefills_and_their_adoption_redrive_as_recorded(tmp_path):
    path = tmp_path / "detached.db"
    record(path, detach=True).journal.close()
    with JournalReader.open(path) as src:
        kinds = [e.kind for e in src.events()]
    assert "PrefillDetached" in kinds and "PrefillAdopted" in kinds
    out = _redrive(path)
    assert out.violations == [] and out.stalls == []
    assert out.differences == [] and out.same and out.compared == 8


def test_a_planner_that_never_reuses_shows_up_as_changed_plans(recorded, monkeypatch):
    real = planner.plan
    monkeypatch.setattr(planner, "plan", lambda tokens, hashes, tenant, session, store, mode,
                        usable=None: real(tokens, hashes, tenant, session, type(store)(), mode))
    out = _redrive(recorded)
    rec = _recording(recorded)
    reused = {rid for rid, r in rec.requests.items()
              if r.decisions.plan and r.decisions.plan[0] != "Root"}
    changed = {d["request"] for d in out.differences if "plan" in d["fields"]}
    assert reused and changed == reused
    assert all(d["redriven"]["plan"][0] == "Root" for d in out.differences if "plan" in d["fields"])


def test_a_predicate_that_refuses_everything_shows_up_as_changed_publications(recorded,
                                                                            monkeypatch):
    monkeypatch.setattr(salvage, "materializable",
                        lambda cp, mode: salvage.Refused("refuses everything"))
    out = _redrive(recorded)
    fields = {f for d in out.differences for f in d["fields"]}
    assert {"published", "refused"} <= fields


def test_the_command(recorded, capsys):
    assert journal_main(["journal", "redrive", str(recorded)]) == 0
    assert "every plan, publication, refusal and outcome is as recorded" in \
        capsys.readouterr().out
    assert journal_main(["journal", "redrive", "--json", str(recorded)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["same"] and doc["requests"] == 8 and doc["differing"] == 0


def test_a_hashes_only_journal_cannot_be_redriven(tmp_path, capsys):
    path = tmp_path / "hashes.db"
    h = Harness(EngineConfig(journal_tokens=False), journal=Journal.open(path))
    h.submit(PROMPT, "s", max_tokens=3)
    h.run()
    h.journal.close()
    with pytest.raises(RedriveError, match="no token ids"):
        _redrive(path)
    assert journal_main(["journal", "redrive", str(path)]) == 2
    assert "--journal-content hashes" in capsys.readouterr().err


def test_the_seeds_journal_redrives_clean():
    """tests/fixtures/seed-mtp-lagging-frontier.db was written with the MTP clause dropped
    from the predicate (tests/fixtures/generate.py): the cut prefill published a frontier
    the MTP layer had not reached, and every retry failed. `journal check` still finds that;
    today's code refuses the frontier and every retry finishes."""
    fixture = FIXTURES / "seed-mtp-lagging-frontier.db"
    assert journal_main(["journal", "check", str(fixture)]) == 1
    out = _redrive(fixture)
    assert out.violations == [] and out.stalls == []
    rec = _recording(fixture)
    failed = [rid for rid, r in rec.requests.items() if r.decisions.outcome[0] == "RequestFailed"]
    assert len(failed) == 3
    by_request = {d["request"]: d for d in out.differences}
    for rid in failed:
        assert by_request[rid]["redriven"]["outcome"] == ("RequestFinished", None)
    cut = next(rid for rid, r in rec.requests.items() if r.cut is not None)
    assert "MTP KV covers" in str(by_request[cut]["redriven"]["refused"])
