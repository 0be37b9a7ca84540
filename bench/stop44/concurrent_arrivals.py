"""N streams started at once on a CPU server (short prompts): each one's time to first
token from the server's log, in arrival order, to see whether admissions are serialised.

    .venv/bin/python bench/stop44/concurrent_arrivals.py --streams 4 --rounds 2
"""
from __future__ import annotations

import argparse
import itertools
import re
import tempfile
from pathlib import Path

from ninfer.bench.serve_outside import server_options, sizes_for
from ninfer.bench.serve_probes import Probes
from ninfer.bench.server_process import started
from ninfer.bench.sized_prompts import PromptMaker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    opts = server_options("cpu", None, sizes_for("cpu", True), a.streams,
                          ["--log-slow-steps", "0.001"])
    folder = Path(tempfile.mkdtemp(prefix="arrivals-"))
    with started(["--spec", "none", *opts], folder) as server:
        probes = Probes(server.url, PromptMaker.for_model(None), itertools.count(1))
        for _ in range(a.rounds):
            print(probes.decode([a.streams], a.tokens))
        log = server.log.read_text()
    for line in log.splitlines():
        if "slow step" in line and "warmup" not in line:
            print(line[11:23], line.split("ninfer.engine: ")[1][:200])
        m = re.search(r"(req#\S+) done .*prompt ([\d,]+) .*TTFT ([\d.]+ m?s) .*total ([\d.]+ m?s)",
                      line)
        if m:
            print(line[11:23], *m.groups())


if __name__ == "__main__":
    main()
