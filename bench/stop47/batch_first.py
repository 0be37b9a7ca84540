"""Issue 32, item 1 (a GPU): what several lanes' first turns cost when their shape is new,
and where a new prompt length's GEMMs spend their first call. On anchor-1b (random weights):
8 lanes of n-token prompts prefilled together (the served 8-stream start), each n twice, in
one process; then F.linear over the model's weight shapes at row counts not run before,
first call against second, with each cuBLAS library torch offers.

    python3 bench/stop47/batch_first.py [--json out.json]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ninfer.bench.engine import Bench
from ninfer.bench.gpu_engine import anchor_dir
from ninfer.bench.report import write_line


def _lanes(b, engine, n: int, lanes: int = 8) -> float:
    """Seconds until every one of `lanes` fresh n-token prompts has its first token."""
    rids = [b.submit(engine, b.prompt(n), 2, session=f"s{b.ids}-{i}") for i in range(lanes)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while not all(engine.requests.get(r) and engine.requests[r].outputs for r in rids):
        engine.step()
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    while any(engine.requests.get(r) and engine.requests[r].state not in
              ("Finished", "Cancelled", "Failed") for r in rids):
        engine.step()
    return round(took * 1e3, 1)


def _gemms(net, rows: tuple[int, ...]) -> dict:
    shapes = sorted({tuple(m.weight.shape) for m in net.modules()
                     if isinstance(m, torch.nn.Linear)})[:6]
    out = {}
    for m_rows in rows:
        first, second = 0.0, 0.0
        for shape in shapes:
            w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(m_rows, shape[1], device="cuda", dtype=torch.bfloat16)
            for k in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(4):   # a layer's worth of calls of one shape
                    F.linear(x, w)
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) * 1e3
                first, second = (first + dt, second) if k == 0 else (first, second + dt)
        out[m_rows] = [round(first, 3), round(second, 3)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    b = Bench(str(anchor_dir()), "cuda", "bfloat16")
    engine = b.engine(prefill_chunk=8192)
    engine.model.prepare_prefill(chunk=8192, max_context=engine.config.max_context)
    r: dict = {"lanes_ms": [(n, _lanes(b, engine, n)) for n in (55, 55, 61, 61, 40, 40)]}
    net = engine.model.net
    r["gemm_default"] = _gemms(net, (1015, 1016, 2999))
    for lib in ("cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(lib)
            r[f"gemm_{lib}"] = _gemms(net, (1017 + len(r), 2001 + len(r), 733 + len(r)))
        except Exception as exc:   # a build without it
            r[f"gemm_{lib}"] = repr(exc)[:200]
    write_line({"bench": "batch-first", "results": r}, a.json)


if __name__ == "__main__":
    main()
