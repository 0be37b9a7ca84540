"""Issue 32, item 1 (a GPU): why a served request of a prompt length the warm-up never ran
costs ~2-3x its repeat (stop 47's quick serve: 1K 136 against 44 ms of launching, no
kernel compiled after ready). In one process on anchor-1b (random weights, the engine
bench's `Bench`): prompts of the warm-up's lengths, then each new length twice, timed;
then a new length under torch.profiler against its repeat (the host ops with the most time
of their own); then the model's GEMM shapes through F.linear at new row counts, first call
against second.

    python3 bench/stop47/first_shape.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from ninfer.bench.engine import Bench
from ninfer.bench.gpu_engine import anchor_dir

WARM = (8229, 4096, 64, 128, 75, 45, 97, 5, 21)
NEW = (1015, 1015, 55, 55, 4087, 4087, 733, 733, 3001, 3001)


def _ttft(b, engine, n: int) -> float:
    torch.cuda.synchronize()
    t, _ = b.ttft(engine, b.prompt(n), 1)
    torch.cuda.synchronize()
    return round(t * 1e3, 2)


def _profiled(b, engine, n: int) -> list:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _ttft(b, engine, n)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]
    return [(e.key[:60], e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in rows]


def _gemms(net) -> dict:
    shapes = sorted({tuple(m.weight.shape) for m in net.modules()
                     if isinstance(m, torch.nn.Linear)})
    out = {}
    for m_rows in (1015, 55, 2999):
        for shape in shapes:
            w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m_rows, shape[1], device="cuda", dtype=torch.bfloat16)
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                F.linear(x, w)
                torch.cuda.synchronize()
                times.append(round((time.perf_counter() - t0) * 1e3, 3))
            out[f"{m_rows}x{shape}"] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    r = {"module_loading": os.environ.get("CUDA_MODULE_LOADING", "(unset)")}
    t0 = time.perf_counter()
    b = Bench(str(anchor_dir()), "cuda", "bfloat16")
    engine = b.engine(prefill_chunk=8192)
    engine.model.prepare_prefill(chunk=8192, max_context=engine.config.max_context)
    r["load_s"] = round(time.perf_counter() - t0, 1)
    r["warm"] = {n: _ttft(b, engine, n) for n in WARM}
    r["new"] = [(n, _ttft(b, engine, n)) for n in NEW]
    r["profile_first_1777"] = _profiled(b, engine, 1777)
    r["profile_repeat_1777"] = _profiled(b, engine, 1777)
    r["gemm_first_second_ms"] = _gemms(engine.model.net)
    print(json.dumps(r, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
