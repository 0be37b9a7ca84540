"""`ninfer bench engine --tensor-parallel N`: the engine bench's rows with the model whole
(N = 1) and sharded over N ranks, in one run, side by side, with the time rank 0 spends in
the forward's all-reduces and gathers per engine step and in sending its commands.

On the CPU (gloo) this measures the machinery, not a speed-up: a tiny model's blocks are
microseconds of arithmetic, and every block adds an all-reduce over loopback TCP. Every
rank runs `threads` torch threads (default 1), so N ranks use N times the cores."""

from __future__ import annotations

import json
import sys
import time

import torch
from tqdm import tqdm

from .engine import Bench


def _rows(quick: bool) -> list[tuple[str, object]]:
    prefill = 1024 if quick else 4096
    rows: list[tuple[str, object]] = [("prefill", lambda b: b.prefill(prefill))]
    for batch in (1, 4, 8):
        rows.append((f"decode_b{batch}", lambda b, batch=batch: b.decode(batch)))
    rows.append(("mtp_model", lambda b: b.decode(1, spec="mtp")))
    turn = 1024 if quick else 4096
    rows.append((f"turn2_{turn // 1024}k", lambda b: b.turn2(turn)))
    return rows


def _measure(b: Bench, world: int, quick: bool) -> dict:
    model = b.om.model
    out: dict = {}
    for name, run in tqdm(_rows(quick), desc=f"bench engine, {world} rank(s)",
                          file=sys.stderr, leave=False):
        before = _counters(model, world)
        t0 = time.perf_counter()
        row = run(b)
        row["wall_s"] = time.perf_counter() - t0
        after = _counters(model, world)
        row.update({k: after[k] - before[k] for k in after})
        steps = row.get("steps")
        if world > 1 and steps:  # decode rows: the timed engine steps
            row["allreduce_ms_per_step"] = row["collective_s"] / steps * 1e3
            row["command_us_per_step"] = row["send_s"] / steps * 1e6
        out[name] = row
    return out


def _counters(model, world: int) -> dict:
    if world == 1:
        return {}
    collectives = model.net.collectives
    return {"collective_s": collectives.seconds, "collectives": collectives.calls,
            "send_s": model.wire.send_seconds, "commands": model.wire.sent}


def main(model: str | None = None, device: str = "cpu", dtype: str = "float32",
         world: int = 2, json_path: str | None = None, quick: bool = False,
         threads: int = 1) -> int:
    from ..model.ranks import launch
    from ..model.runtime import shard_refusal
    refusal = shard_refusal(model, world)
    if refusal:
        print(f"ninfer bench engine: error: --tensor-parallel {world}: {refusal}",
              file=sys.stderr)
        return 2
    torch.set_num_threads(threads)
    results: dict = {"device": device, "dtype": dtype, "threads_per_rank": threads}
    for n in (1, world):
        ranks = launch(n, threads=threads, device=device) if n > 1 else None
        try:
            b = Bench(model, device, dtype, ranks=ranks)
            results["model"] = b.om.name
            results[f"tp{n}"] = _measure(b, n, quick)
        finally:
            if ranks is not None:
                ranks.close()
    _report(results, world)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _figure(name: str, row: dict) -> str:
    if name == "prefill":
        return f"{row['prefill_tok_s']:,.0f} tok/s"
    if name.startswith("turn2"):
        return f"{row['turn2_s'] * 1e3:,.1f} ms (turn 1 {row['turn1_s']:.2f} s)"
    return f"{row['tok_s']:,.1f} tok/s"


def _report(r: dict, world: int) -> None:
    one, many = r["tp1"], r[f"tp{world}"]
    header = ("row", "N=1", f"N={world}", "all-reduce ms/step", "command us/step")
    rows = [header]
    for name in one:
        m = many[name]
        rows.append((name, _figure(name, one[name]), _figure(name, m),
                     f"{m['allreduce_ms_per_step']:.2f}" if "allreduce_ms_per_step" in m
                     else f"({m['collective_s'] * 1e3:,.0f} ms in all)",
                     f"{m['command_us_per_step']:.0f}" if "command_us_per_step" in m else ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    print(f"ninfer bench engine --tensor-parallel {world}: {r['model']} on {r['device']} "
          f"({r['dtype']}, {r['threads_per_rank']} torch thread(s) per rank)")
    for row in rows:
        print("  " + "  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True)))
    print(json.dumps({"bench": "engine-tensor-parallel", "results": r}))
