"""`ninfer bench agent`: a short run end to end against real servers (`ninfer serve`
subprocesses), its figures checked against the journals and the client's own usage; and
the figures' arithmetic on made-up turns."""

from __future__ import annotations

import contextlib
import json
import sqlite3

import pytest

from ninfer.bench.agent import Options, Turn, figures, main, schedule

OPTIONS = Options(turns=4, context=1600, max_tokens=8, seed=0, cancel_fraction=0.5,
                  step_delay_ms=50)


def _journal_count(path: str) -> tuple[dict[str, int], set[str]]:
    """Prompt positions each request prefilled, counted with SQL alone (the largest cursor
    of each start past its reuse base), and the requests the journal has cancelled."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT request, kind, json_extract(data, '$.reuse_base'), "
            "json_extract(data, '$.cursor') FROM events "
            "WHERE kind IN ('RequestStarted', 'PrefillAdvanced') ORDER BY seq").fetchall()
        cancelled = {r for (r,) in db.execute(
            "SELECT request FROM events WHERE kind = 'RequestCancelled'")}
    starts: dict[str, list[list[int]]] = {}  # request -> [base, furthest cursor] per start
    for request, kind, base, cursor in rows:
        if kind == "RequestStarted":
            starts.setdefault(request, []).append([base, base])
        else:
            starts[request][-1][1] = max(starts[request][-1][1], cursor)
    return {r: sum(end - base for base, end in s) for r, s in starts.items()}, cancelled


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("agentbench")
    out = workdir / "agent.json"
    assert main(OPTIONS, ["single", "cancels"], workdir=str(workdir), json_path=str(out)) == 0
    return json.loads(out.read_text())


def test_both_runs_of_each_scenario_complete(run):
    for scenario in ("single", "cancels"):
        for mode in ("key", "no_key"):
            turns = run["scenarios"][scenario][mode]["turns"]
            assert [t["turn"] for t in turns] == [1, 2, 3, 4], (scenario, mode)
            assert all(t["completion_tokens"] >= 1 for t in turns), (scenario, mode)
    expected = list(schedule("cancels", OPTIONS).cut_turns)
    assert len(expected) == 2
    for mode in ("key", "no_key"):
        assert run["scenarios"]["cancels"][mode]["cut_turns"] == expected


def test_single_with_a_key_reuses_the_previous_turn(run):
    key = run["scenarios"]["single"]["key"]
    assert key["reuse_min"] >= 0.9
    assert all(t["reuse"] >= 0.9 for t in key["turns"][1:])


def test_prompt_tokens_computed_match_the_journal_and_the_usage(run):
    for scenario in ("single", "cancels"):
        for mode in ("key", "no_key"):
            result = run["scenarios"][scenario][mode]
            counted, cancelled = _journal_count(result["journal"])
            ours = [t["request_id"] for t in result["turns"]]
            cuts = [t["cut_request_id"] for t in result["turns"] if t["cut_request_id"]]
            assert result["prompt_tokens_computed"] == sum(counted[r] for r in ours + cuts)
            for t in result["turns"]:
                # a request that ran to its end prefilled what it did not reuse
                assert t["computed"] == counted[t["request_id"]] \
                    == t["prompt_tokens"] - t["cached_tokens"], (scenario, mode, t)
                if t["cut_request_id"]:
                    assert t["cut_computed"] == counted[t["cut_request_id"]]
            assert set(cuts) <= cancelled  # the client's cuts reached the server


def _turn(turn: int, prompt: int, cached: int, previous: int, ttft: float,
          cut: str | None = None) -> Turn:
    return Turn("A", turn, f"r{turn}", prompt, 10, cached, previous,
                cached / previous if previous else None, ttft, 2 * ttft, cut)


def test_figures_of_made_up_turns():
    turns = [_turn(1, 100, 0, 0, 50.0), _turn(2, 150, 109, 110, 10.0, cut="c2"),
             _turn(3, 200, 80, 160, 20.0), _turn(4, 260, 210, 210, 30.0, cut="c4")]
    computed = {"r1": 100, "r2": 41, "c2": 5, "r3": 120, "r4": 50, "c4": 7}
    out = figures(turns, computed)
    assert out["reuse_min"] == 0.5 and out["reuse_median"] == 109 / 110
    assert out["prompt_tokens_sent"] == 100 + 2 * 150 + 200 + 2 * 260
    assert out["prompt_tokens_new"] == 100 + 40 + 40 + 50
    assert out["prompt_tokens_computed"] == 323 and out["cut_prompt_tokens_computed"] == 12
    # each retry against the nearest uncut turn past the first: turn 3 for both
    assert [(r["uncut_turn"], r["ratio"]) for r in out["retries"]] == [(3, 0.5), (3, 1.5)]
    assert out["retry_ttft_median_ms"] == 20.0
