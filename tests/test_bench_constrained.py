"""Smoke test of `ninfer bench constrained --quick`: it runs small (the 4K vocabulary, short
replies) and writes its JSON (no timing assertions: the figures are a benchmark's)."""

import json
import math

from ninfer.bench.constrained import TARGETS, main


def test_bench_constrained_writes_its_results(tmp_path):
    path = tmp_path / "bench.json"
    assert main(json_path=str(path), quick=True) == 0
    report = json.loads(path.read_text())
    assert report["bench"] == "constrained"
    results = report["results"]
    assert {"mask_us_4k", "bitmask_us_4k", "overhead_b1", "overhead_b8",
            "plain_tok_s_b1", "json_tok_s_b8"} <= set(results)
    for key, value in results.items():
        assert isinstance(value, int | float) and math.isfinite(value), key
    assert results["mask_us_4k"] > 0 and results["bitmask_us_4k"] > 0
    assert set(report["targets"]) == set(TARGETS)
