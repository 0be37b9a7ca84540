"""Issue 32, item 4's gap on this CPU: a streaming client's largest gap between tokens while
another request prefills a long prompt, against its usual gap, through HTTP (the serve
bench's probe, `Probes.gap_under_prefill`), several times on one server.

    .venv/bin/python bench/stop47/gap_cpu.py --long 4096 --rounds 5 [--model PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import tempfile
from pathlib import Path

from ninfer.bench.serve_outside import server_options, sizes_for
from ninfer.bench.serve_probes import Probes
from ninfer.bench.server_process import started
from ninfer.bench.sized_prompts import PromptMaker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stream-tokens", type=int, default=2000)
    ap.add_argument("--model")
    a = ap.parse_args()
    sizes = dataclasses.replace(sizes_for("cpu", True), long_prefill=a.long,
                                next_turn=(a.long,))
    opts = server_options("cpu", a.model, sizes, 4, [])
    prompts = PromptMaker.for_model(a.model)
    rows = []
    with started(["--spec", "none", *opts], Path(tempfile.mkdtemp(prefix="gap-"))) as server:
        probes = Probes(server.url, prompts, itertools.count())
        for _ in range(a.rounds):
            r = probes.gap_under_prefill(a.long, a.stream_tokens)
            rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})
            print(json.dumps(rows[-1]), flush=True)
    ratio = [r["prefill_gap_ratio"] for r in rows]
    print(json.dumps({"median_ratio": statistics.median(ratio),
                      "median_max_ms": statistics.median(r["prefill_gap_max_ms"] for r in rows),
                      "median_usual_ms": statistics.median(r["prefill_gap_usual_ms"]
                                                           for r in rows),
                      "median_long_ttft_ms": statistics.median(r["prefill_long_ttft_ms"]
                                                               for r in rows)}))


if __name__ == "__main__":
    main()
