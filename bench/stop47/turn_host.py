"""Issue 32, item 3: a next turn's time as the client sees it against the server's own TTFT,
with py-spy over the server (when given), on any device. For each size, conversations of
turn 1 (a 16-token reply), turn 2 (26 new tokens) and a retry of turn 2, as
`ninfer bench serve`'s next-turn probe sends them; prints the client's and the server's
TTFT of each, and the server's slow steps.

    python3 bench/stop47/turn_host.py --device cpu --sizes 16384 --rounds 6
    python3 bench/stop47/turn_host.py --device cuda --model /tmp/ninfer-anchor-1b-text \
        --sizes 16384,32768 --rounds 6 --py-spy build/py-spy --out $OUT/turn-host
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import signal
import subprocess
import time
from pathlib import Path

from ninfer.bench.serve_outside import server_options, sizes_for
from ninfer.bench.server_process import started
from ninfer.bench.sized_prompts import PromptMaker
from ninfer.bench.timed_stream import stream_chat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model")
    ap.add_argument("--sizes", default="16384")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--py-spy")
    ap.add_argument("--spy-format", default="raw", help="raw, or speedscope (a timeline)")
    ap.add_argument("--out", default="/tmp/turn-host")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    quick = dataclasses.replace(sizes_for(a.device, True), next_turn=tuple(sizes))
    opts = server_options(a.device, a.model, quick, 8, [])
    prompts = PromptMaker.for_model(a.model)
    rows = []
    with started(["--spec", "none", *opts], out / "server") as server:
        spy = None
        if a.py_spy:
            port = server.url.rsplit(":", 1)[1]
            pid = int(subprocess.check_output(["pgrep", "-f", f"port {port}"]).split()[0])
            spy = subprocess.Popen([a.py_spy, "record", "-p", str(pid), "-r", "1000",
                                    "--nonblocking", "-f", a.spy_format, "-o", str(out / "spy.txt"),
                                    "--threads", "--idle"])
            time.sleep(1.0)
        for n in sizes:
            for key in range(a.rounds):
                session = f"t{n}-{key}"
                history = prompts.messages(n, 1000 * n + key)
                t1 = stream_chat(server.url, history, session=session, max_tokens=16)
                history = [*history, {"role": "assistant", "content": t1.text}]
                t2 = stream_chat(server.url, prompts.follow_up(history, 26, key),
                                 session=session, max_tokens=4)
                t3 = stream_chat(server.url, prompts.follow_up(history, 26, 500 + key),
                                 session=session, max_tokens=4)
                rows.append({"size": n, "turn1": round(1e3 * t1.ttft, 1),
                             "turn2": round(1e3 * t2.ttft, 1),
                             "retry": round(1e3 * t3.ttft, 1),
                             "cached2": t2.cached_tokens, "prompt2": t2.prompt_tokens})
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait()
        time.sleep(0.3)
        log = server.log.read_text().splitlines()
    ttfts = [re.search(r"TTFT (\S+ \S+)", x).group(1) for x in log
             if "TTFT" in x and "warmup" not in x]
    for row, i in zip(rows, range(0, len(ttfts), 3), strict=False):
        row["server"] = ttfts[i:i + 3]
        print(json.dumps(row))
    print("\n".join(x[24:300] for x in log if "slow step" in x and "warmup" not in x)[-6000:])
    (out / "rows.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
