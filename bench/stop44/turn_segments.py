"""Where a served next turn's time to first token goes, from the wall clock of the client
and the journal's event times (one machine): the request sent -> RequestQueued emitted
(HTTP, render, tokenize, submit, the engine's wake) -> the first TokensCommitted emitted
(the engine's step) -> the first token at the client (the step's commit, delivery, SSE).

Turns alternate: odd ones are next turns, even ones from the third on are retries of the
turn before (the same history, another message). Since stop 45 also `--model`,
`--serve-arg`, and the server's slow-step lines of the last turn (every step logged), so
the engine's segment is split into its forward and the host's work.

    .venv/bin/python bench/stop44/turn_segments.py --size 16384 --turns 9
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from ninfer.bench.serve_outside import server_options, sizes_for
from ninfer.bench.server_process import started
from ninfer.bench.sized_prompts import PromptMaker
from ninfer.lifecycle.reader import JournalReader


def send(url: str, messages: list[dict], max_tokens: int) -> tuple[float, float, str]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "reasoning_effort": "none", "stream": True}
    with httpx.Client(timeout=600) as client:
        sent, first, text = time.time(), None, []
        with client.stream("POST", url + "/v1/chat/completions", json=body,
                           headers={"X-Session-Id": "s"}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:]).get("choices") or ():
                    d = choice["delta"].get("content")
                    if d:
                        first = first or time.time()
                        text.append(d)
    return sent, first, "".join(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server")
    ap.add_argument("--model", default=None, help="a .ninfer file (default: the default model)")
    ap.add_argument("--serve-arg", action="append", default=[], help="another serve option")
    a = ap.parse_args()
    env = dict(e.split("=", 1) for e in a.env)
    # the quick CPU sizes with this conversation the longest: the context and the KV
    # pool that `server_options` gives for it
    opts = server_options("cpu", a.model, dataclasses.replace(sizes_for("cpu", True),
                          next_turn=(a.size,)), 2,
                          ["--log-slow-steps", "0.001", *a.serve_arg])
    folder = Path(tempfile.mkdtemp(prefix="turn-seg-"))
    prompts = PromptMaker.for_model(a.model)
    rows = []
    with started(["--spec", "none", *opts], folder, env=env or None) as server:
        history = prompts.messages(a.size, 1)
        _, _, reply = send(server.url, history, 8)
        history = [*history, {"role": "assistant", "content": reply}]
        for k in range(a.turns):   # a next turn, then a retry of it with another message
            msgs = prompts.follow_up(history, 26, 100 + k)
            sent, first, reply = send(server.url, msgs, 2)
            rows.append([sent, first])
            if k % 2 == 0:
                history = [*msgs, {"role": "assistant", "content": reply}]
        time.sleep(0.5)
        steps = [line.split("slow step", 1)[1].strip() for line in
                 server.log.read_text().splitlines() if "slow step" in line]
        reader = JournalReader.open(folder / "journal.db")
        queued = list(reader.events(kinds=["RequestQueued"]))[-len(rows):]
        firsts = {}
        for e in reader.events(kinds=["TokensCommitted"]):
            firsts.setdefault(e.request, e.time)
    seg = {"to_queued": [], "engine": [], "to_client": [], "client": []}
    for (sent, first), q in zip(rows, queued, strict=True):
        t = firsts[q.request]
        seg["to_queued"].append(1e3 * (q.time - sent))
        seg["engine"].append(1e3 * (t - q.time))
        seg["to_client"].append(1e3 * (first - t))
        seg["client"].append(1e3 * (first - sent))
    for k, v in seg.items():
        print(f"{k:10} median {statistics.median(v):7.2f} ms   {[round(x, 1) for x in v]}")
    print("the last turn's steps:")
    for line in steps[-4:]:
        print("  ", line)


if __name__ == "__main__":
    main()
