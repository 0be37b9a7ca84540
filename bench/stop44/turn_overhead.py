"""Where a served next turn's time goes beside the engine's: the client's time to first
token against the server's own log line (arrival to first token event), for next turns on
conversations of 4K, 16K and 32K tokens, on the CPU with the default model.

    .venv/bin/python bench/stop44/turn_overhead.py [--sizes 4096,16384,32768] [--repeat 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
import tempfile
from pathlib import Path

from ninfer.bench.serve_outside import server_options, sizes_for
from ninfer.bench.serve_probes import Probes
from ninfer.bench.server_process import started
from ninfer.bench.sized_prompts import PromptMaker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,16384,32768")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    # the quick CPU sizes with this conversation the longest: the context and the KV
    # pool that `server_options` gives for it
    opts = server_options("cpu", a.model, dataclasses.replace(sizes_for("cpu", True),
                          next_turn=(max(sizes),)), 2, [])
    folder = Path(tempfile.mkdtemp(prefix="turn-overhead-"))
    prompts = PromptMaker.for_model(a.model)
    out = {}
    with started(["--spec", "none", *opts], folder) as server:
        probes = Probes(server.url, prompts, itertools.count(1))
        for _r in range(a.repeat):
            res = probes.next_turn(sizes, 26, 8)
            for n in sizes:
                out.setdefault(n, []).append(res[f"turn2_ttft_ms_{n}"])
        log = server.log.read_text()
    ttfts = [float(m) for m in re.findall(r"TTFT ([\d.]+) ?ms", log)]
    print("client turn-2 TTFT ms:", json.dumps(out))
    print("server TTFT lines (ms):", ttfts)
    print("\n".join(line for line in log.splitlines() if "TTFT" in line)[-3000:])


if __name__ == "__main__":
    main()
