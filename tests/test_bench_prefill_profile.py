"""`python3 -m ninfer.bench.prefill_profile`: a long prefill step by step, each step's wall
time beside its kernels' device time (CUDA), on the CPU without kernels."""

from ninfer.bench.engine import Bench
from ninfer.bench.prefill_profile import attribute, print_table, profile_prefill


def test_each_step_is_charged_the_kernels_that_started_inside_it():
    ranges = [(0, 100.0, 200.0), (1, 210.0, 400.0)]
    kernels = [(120.0, 150.0, "gdn"), (190.0, 205.0, "gdn"), (220.0, 320.0, "attn"),
               (500.0, 510.0, "late")]
    steps, slowest = attribute(ranges, [0.1, 0.19], [0.2, 0.4], kernels, top=2)
    assert [s["launches"] for s in steps] == [2, 1]
    assert [s["device_ms"] for s in steps] == [0.045, 0.1]
    assert steps[1]["device_share"] == 0.1 / 0.4 and steps[0]["profiled_wall_ms"] == 100.0
    assert slowest == [{"kernel": "attn", "launches": 1, "device_ms": 0.1},
                       {"kernel": "gdn", "launches": 2, "device_ms": 0.045}]


def test_a_prefill_of_three_chunks_is_profiled_step_by_step(capsys):
    bench = Bench(None, "cpu", "float32")
    engine = bench.engine(prefill_chunk=256)
    r = profile_prefill(bench, engine, 600)
    assert len(r["steps"]) == 3 and [s["step"] for s in r["steps"]] == [0, 1, 2]
    assert all(s["wall_ms"] > 0 and s["profiled_wall_ms"] > 0 for s in r["steps"])
    assert sum(s["wall_ms"] for s in r["steps"]) <= r["ttft_ms"] + 1
    assert r["device_ms"] == 0 and r["kernels"] == []   # no CUDA here
    print_table(r)
    assert len(capsys.readouterr().out.splitlines()) == 2 + 3
