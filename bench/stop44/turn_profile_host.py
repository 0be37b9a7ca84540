"""py-spy over a CPU server while it answers many next turns (each a different short new
message on one 16K-token conversation): what the host does besides the engine's forward.

    .venv/bin/python bench/stop44/turn_profile_host.py --size 16384 --turns 30 --out /tmp/turns.txt
"""
from __future__ import annotations

import argparse
import dataclasses
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from ninfer.bench.serve_outside import server_options, sizes_for
from ninfer.bench.server_process import started
from ninfer.bench.sized_prompts import PromptMaker
from ninfer.bench.timed_stream import stream_chat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--out", default="/tmp/turns.txt")
    a = ap.parse_args()
    # the quick CPU sizes with this conversation the longest: the context and the KV
    # pool that `server_options` gives for it
    opts = server_options("cpu", None, dataclasses.replace(sizes_for("cpu", True),
                          next_turn=(a.size,)), 2, [])
    folder = Path(tempfile.mkdtemp(prefix="turn-host-"))
    prompts = PromptMaker.for_model(None)
    session = "s1"
    with started(["--spec", "none", *opts], folder) as server:
        history = prompts.messages(a.size, 1)
        t1 = stream_chat(server.url, history, session=session, max_tokens=8)
        history = [*history, {"role": "assistant", "content": t1.text}]
        port = server.url.rsplit(":", 1)[1]
        pid = int(subprocess.check_output(["pgrep", "-f", f"port {port}"]).split()[0])
        spy = subprocess.Popen([".venv/bin/py-spy", "record", "-p", str(pid), "-r", "1500",
                                "--nonblocking", "-f", "raw", "-o", a.out, "--threads",
                                "--idle"])
        time.sleep(1.0)
        ttfts = []
        for k in range(a.turns):
            t2 = stream_chat(server.url, prompts.follow_up(history, 26, 100 + k), session=session,
                             max_tokens=1)
            ttfts.append(round(1000 * t2.ttft, 1))
        spy.send_signal(signal.SIGINT)
        spy.wait()
        print("client TTFT ms:", ttfts)
        lines = server.log.read_text().splitlines()
        print("\n".join("|".join(x.split("|")[4:8]) for x in lines if "TTFT" in x)[-2000:])


if __name__ == "__main__":
    main()
