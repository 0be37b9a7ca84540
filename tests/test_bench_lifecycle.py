"""Smoke test of `ninfer bench lifecycle`: it runs small and writes its JSON (no timing
assertions: the figures are a benchmark's, not a test's)."""

import json
import math

from ninfer.bench.lifecycle import ROWS, TARGETS, main


def test_bench_lifecycle_writes_its_results(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(events=2000, requests=50, json_path=str(path)) == 0
    report = json.loads(path.read_text())
    assert report["bench"] == "lifecycle"
    results = report["results"]
    assert set(results) >= {key for key, *_ in ROWS} | {"replay_events"}
    for key, value in results.items():
        assert isinstance(value, int | float) and value > 0 and math.isfinite(value), key
    assert results["replay_events"] == 2000
    assert set(report["targets"]) == set(TARGETS)
    assert all(isinstance(t["met"], bool) for t in report["targets"].values())
    assert capsys.readouterr().out.strip().splitlines()[-1] == path.read_text().strip()
