"""`bench/gpu.sh turn-profile` (a GPU): where the next turn's time goes inside the engine.

For each context size, a conversation of n tokens (turn 1, a 4-token reply), then turn 2:
turn 1 + its reply + a 30-token message, with the message boundaries the server would send
(the reply's end, the message's end), so the delta is prefilled in the pieces a served next
turn has. Turn 2 runs once unprofiled (its time to first token, the engine steps it took
and each step's wall time) and once more, as a conversation of its own, under torch.profiler:
the CUDA kernels launched and their device time, the host's synchronisations and copies
to the host, and the host operations that took the most time of their own. A next turn
whose wall time is far above its device time is bound by the host. Then a cold prompt of n
tokens, profiled the same way: the whole prefill, kernel by kernel. Turn 2 is timed first
with the delta's forward run eagerly (the model's turn graphs set aside: the baseline), then
as served (a turn graph's replay, `ninfer.model.turn_graphs`, where the model has them).
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

SIZES = (4096, 16384, 32768)
MESSAGE = 30
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpyAsync", "cudaMemcpy")


def _turn(bench, engine, prompt, boundaries, steps: list[float]) -> tuple[float, str]:
    """`Bench.ttft` of a 4-token request with `boundaries`, its steps' ms in `steps`."""
    return bench.ttft(engine, prompt, 4, boundaries, steps)


def _conversation(bench, engine, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Turn 1 run; turn 2's prompt and boundaries."""
    first = bench.prompt(n)
    _, rid = _turn(bench, engine, first, (n,), [])
    reply = tuple(engine.requests[rid].outputs)
    second = first + reply + bench.prompt(MESSAGE)
    return second, (n, n + len(reply), len(second) - 3)


def _timed(bench, engine, n: int) -> dict:
    """Turn 2 of a conversation of n tokens, three times (the first may compile or capture;
    the third is the figure): its time to first token, steps and reuse."""
    row: dict = {}
    for attempt in range(3):
        second, bounds = _conversation(bench, engine, n)
        steps: list[float] = []
        ttft, rid = _turn(bench, engine, second, bounds, steps)
        request = engine.requests[rid]
        row = {"ttft_ms": ttft * 1e3, "steps_ms": [round(s, 3) for s in steps],
               "reused": request.reuse_base, "prompt": len(second), "attempt": attempt}
    return row


def profiled(run) -> dict:
    """run() under torch.profiler: kernels, device time, synchronisations, top host ops."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    kernels, device_us = 0, 0.0
    syncs: dict[str, int] = defaultdict(int)
    by_kernel: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
            device_us += e.device_time_total
            by_kernel[e.name[:80]] += e.device_time_total
        elif e.name in SYNCS:
            syncs[e.name] += 1
    host = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:20]
    return {"kernels": kernels, "device_ms": device_us / 1e3, "syncs": dict(syncs),
            "top_kernels_ms": {k: round(v / 1e3, 3) for k, v in
                               sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]},
            "top_host_self_ms": {a.key[:80]: [a.count, round(a.self_cpu_time_total / 1e3, 3)]
                                 for a in host}}


def main(json_path: str | None = None, model: str | None = None, device: str = "cuda",
         sizes: str = "") -> int:
    from .engine import Bench
    from .gpu_engine import anchor_dir
    if device == "cuda" and not torch.cuda.is_available():
        print("turn-profile needs a GPU", file=sys.stderr)
        return 2
    bench = Bench(model or str(anchor_dir()), device,
                  "bfloat16" if device == "cuda" else "float32")
    out: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else device,
                 "sizes": {}}
    for n in [int(s) for s in sizes.split(",") if s] or SIZES:
        engine = bench.engine(max_context=40_000, auto_anchors=2)
        model = engine.model
        graphs, model.turn_graphs = model.turn_graphs, None
        eager = _timed(bench, engine, n)  # the baseline: the delta's forward run eagerly
        model.turn_graphs = graphs
        row = _timed(bench, engine, n)
        row["eager"] = eager
        print(f"turn 2 at {n}, eager forward: {eager['ttft_ms']:.1f} ms", flush=True)
        second, bounds = _conversation(bench, engine, n)
        t0 = time.perf_counter()
        row["profile"] = profiled(lambda s=second, b=bounds, e=engine: _turn(bench, e, s, b, []))
        row["profile"]["wall_ms_profiled"] = (time.perf_counter() - t0) * 1e3
        out["sizes"][n] = row
        print(f"turn 2 at {n}: {row['ttft_ms']:.1f} ms, steps {row['steps_ms']}, "
              f"reused {row['reused']} of {row['prompt']}; kernels "
              f"{row['profile']['kernels']}, device {row['profile']['device_ms']:.2f} ms, "
              f"syncs {row['profile']['syncs']}", flush=True)
        print(json.dumps(row["profile"]["top_host_self_ms"], indent=1), flush=True)
        print(json.dumps(row["profile"]["top_kernels_ms"], indent=1), flush=True)
        cold = bench.prompt(n)  # a cold prompt of n tokens: the whole prefill's kernels
        t0 = time.perf_counter()
        row["prefill"] = profiled(lambda p=cold, e=engine, b=(n,): _turn(bench, e, p, b, []))
        row["prefill"]["wall_ms_profiled"] = (time.perf_counter() - t0) * 1e3
        print(f"cold prefill of {n}: wall {row['prefill']['wall_ms_profiled']:.1f} ms "
              f"(profiled), device {row['prefill']['device_ms']:.2f} ms, kernels "
              f"{row['prefill']['kernels']}", flush=True)
        print(json.dumps(row["prefill"]["top_kernels_ms"], indent=1), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
