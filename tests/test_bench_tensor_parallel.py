"""`ninfer bench engine --tensor-parallel 2 --quick`: the same rows whole and on two gloo
ranks, in one run, with the all-reduce time per step; a degree the model cannot take is
refused before anything is spawned."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_the_rows_at_one_and_two_ranks_with_the_all_reduce_time_per_step(tmp_path):
    out = tmp_path / "tp.json"
    done = subprocess.run([sys.executable, "-m", "ninfer.cli", "bench", "engine",
                           "--tensor-parallel", "2", "--quick", "--json", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["tp1"]) == set(r["tp2"]) == {"prefill", "decode_b1", "decode_b4",
                                              "decode_b8", "mtp_model", "turn2_1k"}
    for name in ("decode_b1", "decode_b8", "mtp_model"):
        row = r["tp2"][name]
        assert row["steps"] > 0 and row["allreduce_ms_per_step"] > 0
        assert row["collectives"] >= 17 * row["steps"]  # 8 layers x 2 blocks + the head
        assert row["tokens"] == r["tp1"][name]["tokens"]
    assert "all-reduce ms/step" in done.stdout and "N=2" in done.stdout


def test_a_degree_the_model_cannot_take_is_refused_with_status_2():
    done = subprocess.run([sys.executable, "-m", "ninfer.cli", "bench", "engine",
                           "--tensor-parallel", "3", "--quick"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "cannot be split over 3 ranks" in done.stderr
