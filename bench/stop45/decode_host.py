"""Decode speed served on this CPU at a long context, by speculation mode: a conversation of
`--size` tokens, then `--tokens` more streamed with EOS ignored, greedy; the rate after
the first token, median of `--repeat` conversations (each its own), from the client's clock.
What it shows: the host's per-round work that grew with the context (n-gram drafting's scan
back over it, the sequence copied three times a round).

    .venv/bin/python bench/stop45/decode_host.py --size 32768 --spec ngram --spec mtp
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from ninfer.bench.serve_outside import server_options, sizes_for
from ninfer.bench.server_process import started
from ninfer.bench.sized_prompts import PromptMaker
from ninfer.bench.timed_stream import stream_chat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--spec", action="append", default=[])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    prompts = PromptMaker.for_model(None)
    opts = server_options("cpu", None, dataclasses.replace(sizes_for("cpu", True),
                          next_turn=(a.size,)), 2, [])
    out = {}
    for spec in a.spec or ["ngram"]:
        rates = []
        with started(["--spec", spec, *opts], Path(tempfile.mkdtemp(prefix="dec-"))) as s:
            for key in range(a.repeat):
                t = stream_chat(s.url, prompts.messages(a.size, 500 + key), session=f"d{key}",
                                max_tokens=a.tokens, ignore_eos=True)
                # (tokens ready together share an SSE event: the count is the server's)
                n = t.usage["completion_tokens"]
                rates.append((n - 1) / (t.end - t.arrivals[0]))
        out[spec] = statistics.median(rates)
        print(f"--spec {spec}: {out[spec]:.1f} tokens/s after the first "
              f"({[round(r, 1) for r in rates]})")
    if a.json:
        Path(a.json).write_text(json.dumps({"size": a.size, "tokens": a.tokens,
                                            "tokens_per_s": out}, indent=1))


if __name__ == "__main__":
    main()
