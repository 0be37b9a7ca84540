"""Stop 46, on a GPU: a cold prefill's time to first token at 32K and 4K on anchor-1b (the
engine, chunks of 8,192, the chunk attention's shapes prepared as the server's warm-up
does) with each of stop 46's kernel changes off and on, interleaved, in one process:

- the gated RMSNorm of the GDN layers' output: one row (a head of 128) a program, as
  before, against 32 rows (`kernels.fused.GATED_NORM_ELEMENTS` 128 / 4096);
- the GDN state kernel's Dv tile: 32 against 16 (`GDNChunkConfig.state_block_v`; the run
  of stop 46 chose 16 by the SM count, which on the H100 at anchor-1b's 16 value heads is
  the 16 here). It lost (32K 1.009x, 4K 0.966x): the choice was reverted.

Figures: bench/results/prefill-ab-h100-stop46.json.

    python3 bench/stop46/prefill_ab.py [--json OUT] [--rounds 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

import kernels.fused as fused
import kernels.gdn_chunk as gdn_chunk
from ninfer.bench.engine import Bench
from ninfer.bench.gpu_engine import anchor_dir

VARIANTS = {"before": (128, 32), "norm": (4096, 32), "state": (128, 16), "both": (4096, 16)}


def use(variant: str) -> None:
    elements, tile = VARIANTS[variant]
    fused.GATED_NORM_ELEMENTS = elements
    gdn_chunk.DEFAULT_CONFIG = dataclasses.replace(gdn_chunk.DEFAULT_CONFIG, state_block_v=tile)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="32768,4096")
    ap.add_argument("--model", default=None, help="(default anchor-1b; another to try it here)")
    ap.add_argument("--chunk", type=int, default=8192)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    b = Bench(a.model or str(anchor_dir()), "cuda" if cuda else "cpu",
              "bfloat16" if cuda else "float32")
    engine = b.engine(prefill_chunk=a.chunk)
    if cuda:
        engine.model.prepare_prefill(chunk=a.chunk, max_context=engine.config.max_context)
    sizes = [int(s) for s in a.sizes.split(",")]
    times: dict = {(v, n): [] for v in VARIANTS for n in sizes}
    for v in VARIANTS:   # each variant's compiles, untimed
        use(v)
        for n in sizes:
            b.ttft(engine, b.prompt(n), 1)
    for _ in range(a.rounds):
        for v in VARIANTS:
            use(v)
            for n in sizes:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                b.ttft(engine, b.prompt(n), 1)
                if cuda:
                    torch.cuda.synchronize()
                times[(v, n)].append(1e3 * (time.perf_counter() - t0))
    out = {"card": torch.cuda.get_device_name() if cuda else "cpu",
           "model": a.model or "anchor-1b", "rounds": a.rounds,
           "sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None}
    for n in sizes:
        base = statistics.median(times[("before", n)])
        for v in VARIANTS:
            ms = statistics.median(times[(v, n)])
            out[f"{v}_{n}_ms"] = ms
            out[f"{v}_{n}_over_before"] = base / ms
            print(f"{n:>6} {v:>7}: {ms:7.1f} ms  ({base / ms:.3f}x before)  "
                  f"{[round(t, 1) for t in times[(v, n)]]}", file=sys.stderr)
    line = json.dumps({"bench": "prefill-ab-stop46", "results": out})
    print(line)
    if a.json:
        with open(a.json, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
