"""Smoke test of `ninfer bench journal`: it runs small and writes its JSON (no timing
assertions: the figures are a benchmark's, not a test's)."""

import json
import math

from ninfer.bench.journal import ROWS, TARGETS, main


def test_bench_journal_writes_its_results(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(events=3000, json_path=str(path)) == 0
    report = json.loads(path.read_text())
    assert report["bench"] == "journal" and report["results"]["events"] == 3000
    results = report["results"]
    assert set(results) >= {key for key, *_ in ROWS}
    for key, value in results.items():
        assert isinstance(value, int | float) and value > 0 and math.isfinite(value), key
    assert set(report["targets"]) == set(TARGETS)
    assert capsys.readouterr().out.strip().splitlines()[-1] == path.read_text().strip()
