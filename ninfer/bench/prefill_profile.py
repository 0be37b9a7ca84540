"""Issue 32, item 2: where a long prefill's time goes, engine step by engine step.

`python3 -m ninfer.bench.prefill_profile [--sizes 32768,4096] [--chunk 8192]` (on a GPU: anchor-1b,
bf16; `--model` another). One untimed prefill of the size first (its shapes' compiles), one
timed step by step, then one under torch.profiler (whose tracing slows the host: its walls
are shown apart), each engine step inside a named range, until the first token: per step
its wall time, its kernels' device time and launches, and their ratio; then the kernels
that took the most device time over the whole prefill. A step whose wall time
is well above its kernels' time waited on the host (launching, Python, the journal), one
close to it on the kernels: the figures say which to cut for the 1.5x over transformers +
fla at 32K. Written as JSON too (`--json`)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

from .report import write_line

STEP = "ninfer-step-"


def profile_prefill(bench, engine, n: int, top: int = 15) -> dict:
    """Profile one prefill of `n` tokens on `engine` (a `Bench`'s), after an untimed one."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..engine.engine import run_until_idle
    bench.ttft(engine, bench.prompt(n), 1)   # the shapes' compiles and plans
    clean: list[float] = []                   # ms a step, no profiler
    first_s, _ = bench.ttft(engine, bench.prompt(n), 1, steps=clean)
    cuda = torch.cuda.is_available() and str(bench.om.model.device).startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls: list[float] = []
    prompt = bench.prompt(n)
    with profile(activities=activities) as prof:
        rid = bench.submit(engine, prompt, 1)
        t0 = time.perf_counter()
        while not engine.requests.get(rid) or not engine.requests[rid].outputs:
            with record_function(f"{STEP}{len(walls)}"):
                s0 = time.perf_counter()
                engine.step()   # (a step ends with the device synchronised)
                walls.append(time.perf_counter() - s0)
        total = time.perf_counter() - t0
    events, kinds = prof.events(), torch.autograd.DeviceType
    # (a named range shows on the device's timeline too, as an annotation: not a kernel)
    ranges = sorted((int(e.name[len(STEP):]), e.time_range.start, e.time_range.end)
                    for e in events if e.name.startswith(STEP) and e.device_type == kinds.CPU)
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in events
               if e.device_type == kinds.CUDA and not e.name.startswith(STEP)]
    steps, slowest = attribute(ranges, walls, clean, kernels, top)
    run_until_idle(engine)
    return {"tokens": n, "ttft_ms": 1e3 * first_s, "profiled_ttft_ms": 1e3 * total,
            "steps": steps, "kernels": slowest,
            "device_ms": sum(s["device_ms"] for s in steps)}


def attribute(ranges: list[tuple[int, float, float]], walls: list[float],
              clean: list[float], kernels: list[tuple[float, float, str]], top: int
              ) -> tuple[list[dict], list[dict]]:
    """Each step (`ranges`: its index and profiler range, us; `walls`: its profiled wall,
    s; `clean`: its wall without the profiler, ms) with the kernels that started inside its
    range (`kernels`: start, end in us, name); and the `top` kernels by device time."""
    steps = []
    for (i, start, end), wall in zip(ranges, walls, strict=True):
        inside = [k for k in kernels if start <= k[0] <= end]
        device_ms = sum(k[1] - k[0] for k in inside) / 1e3
        unprofiled = clean[i] if i < len(clean) else None
        steps.append({"step": i, "wall_ms": unprofiled, "profiled_wall_ms": 1e3 * wall,
                      "device_ms": device_ms, "launches": len(inside),
                      "device_share": device_ms / unprofiled if unprofiled else None})
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for start, end, name in kernels:
        by_name[name[:90]][0] += 1
        by_name[name[:90]][1] += (end - start) / 1e3
    slowest = sorted(({"kernel": k, "launches": v[0], "device_ms": v[1]}
                      for k, v in by_name.items()), key=lambda r: -r["device_ms"])[:top]
    return steps, slowest


def print_table(r: dict, file=None) -> None:
    file = file or sys.stdout
    print(f"prefill of {r['tokens']:,} tokens: {r['ttft_ms']:.1f} ms to the first token "
          f"({r['profiled_ttft_ms']:.1f} profiled), kernels {r['device_ms']:.1f} ms",
          file=file)
    print(f"{'step':>4} {'wall ms':>9} {'profiled':>9} {'kernels ms':>11} {'launches':>9} "
          f"{'share':>6}", file=file)
    for s in r["steps"]:
        wall = "-" if s["wall_ms"] is None else f"{s['wall_ms']:.1f}"
        share = "-" if s["device_share"] is None else f"{s['device_share']:.0%}"
        print(f"{s['step']:>4} {wall:>9} {s['profiled_wall_ms']:>9.1f} "
              f"{s['device_ms']:>11.1f} {s['launches']:>9} {share:>6}", file=file)
    for k in r["kernels"]:
        print(f"  {k['device_ms']:8.2f} ms {k['launches']:>5}x  {k['kernel']}", file=file)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m ninfer.bench.prefill_profile",
                                 description=__doc__.split("\n\n")[1])
    ap.add_argument("--sizes", default="32768",
                    help="prompt tokens, comma-separated (default 32768)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="prefill chunk (default: the server's for the device)")
    ap.add_argument("--model", default=None,
                    help="a model directory or .ninfer file (default on a GPU: anchor-1b)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    from .engine import Bench
    path = a.model
    if path is None and a.device.startswith("cuda"):
        from .gpu_engine import anchor_dir
        path = str(anchor_dir())
    dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    bench = Bench(path, a.device, dtype)
    engine = bench.engine(**({"prefill_chunk": a.chunk} if a.chunk else {}))
    out = {"device": a.device, "chunk": engine.config.prefill_chunk,
           "card": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"}
    for n in (int(x) for x in a.sizes.split(",")):
        out[str(n)] = r = profile_prefill(bench, engine, n)
        print_table(r)
    write_line({"bench": "prefill-profile", "results": out}, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
