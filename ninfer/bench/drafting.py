"""`ninfer bench drafting`: what speculative decoding buys as a user gets it, on the CPU.

Two servers on one model in this process (uvicorn on loopback), `--spec none` and
`--spec mtp` (adaptive drafting up to `--draft-tokens`, as served), answer the same text
completions, greedy, batch 1: continuations of Python code from the modules the default
model's training held out (read from this Python's standard library, so every machine has
them). Requests alternate between the servers, prompt by prompt, and each rate is the best
of `--rounds` passes, so a machine's slow moments fall on both sides alike.

Figures: decode tokens/s of each (tokens after the first over the time from the first to
the last, streamed), the speed-up of mtp over none, and the share of drafted tokens the
mtp server accepted (from its metrics). The replies are compared too: greedy drafting
must not change a token.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from .report import report

PROMPT_CHARS = 1200
PROMPTS = 8
TARGETS = {"speedup": (">=", 1.3)}


def code_prompts(count: int = PROMPTS, chars: int = PROMPT_CHARS) -> list[str]:
    """Beginnings of held-out modules' source, each cut at a line's end after `chars`."""
    from ..train.sources import HELD_OUT, stdlib_root
    out = []
    for module in HELD_OUT[:count]:
        text = (stdlib_root() / f"{module}.py").read_text(encoding="utf-8")
        end = text.find("\n", chars)
        out.append(text[:end + 1 if end >= 0 else len(text)])
    return out


def _stream(url: str, prompt: str, tokens: int) -> tuple[str, int, float]:
    """One streamed greedy completion: its text, tokens, and seconds from the first token
    to the last."""
    import httpx

    from .serve import sse_chunks
    text, first, usage = [], None, None
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for chunk in sse_chunks(r.iter_lines()):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text.append(choice["text"])
    last = time.perf_counter()
    return "".join(text), usage["completion_tokens"], last - (first or last)


def _metric(url: str, name: str) -> float:
    import httpx
    body = httpx.get(url + "/metrics", timeout=60).text
    found = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", body, re.M)
    return float(found.group(1)) if found else 0.0


def main(model: str | None = None, tokens: int = 128, rounds: int = 2, draft_tokens: int = 3,
         threads: int = 1, json_path: str | None = None) -> int:
    import torch

    from .serve import _server
    torch.set_num_threads(threads)
    common = ["--max-concurrency", "1", "--max-context", "8192", "--kv-capacity", "16384",
              "--torch-threads", str(threads), "--log-level", "WARNING",
              "--draft-tokens", str(draft_tokens), *([model] if model else [])]
    folder = Path(tempfile.mkdtemp(prefix="ninfer-bench-drafting-"))
    servers = {spec: _server(["--spec", spec, "--journal", str(folder / f"{spec}.db"),
                              *common])[0] for spec in ("none", "mtp")}
    prompts = code_prompts()
    best: dict[str, list[float]] = {spec: [0.0] * len(prompts) for spec in servers}
    replies: dict[str, list[str]] = {spec: [""] * len(prompts) for spec in servers}
    counts = [0] * len(prompts)
    for url in servers.values():   # warm-up: the first request of each server
        _stream(url, prompts[0][:200], 8)
    steps = [(r, i, spec) for r in range(rounds) for i in range(len(prompts))
             for spec in (("none", "mtp") if (r + i) % 2 == 0 else ("mtp", "none"))]
    for _r, i, spec in tqdm(steps, desc="bench drafting", file=sys.stderr, leave=False):
        text, n, seconds = _stream(servers[spec], prompts[i], tokens)
        replies[spec][i], counts[i] = text, n
        best[spec][i] = max(best[spec][i], (n - 1) / max(seconds, 1e-9))
    # per prompt, the same tokens both ways: the total over the summed best times
    rate = {spec: sum(c - 1 for c in counts) / sum((c - 1) / b for c, b in
                                                    zip(counts, best[spec], strict=True))
            for spec in servers}
    drafted = _metric(servers["mtp"], "ninfer_drafted_tokens_total")
    accepted = _metric(servers["mtp"], "ninfer_accepted_tokens_total")
    flat = {"none_tok_s": rate["none"], "mtp_tok_s": rate["mtp"],
            "speedup": rate["mtp"] / rate["none"],
            "same_replies": replies["none"] == replies["mtp"],
            "drafted": drafted, "acceptance": accepted / max(drafted, 1),
            "prompts": len(prompts), "tokens": tokens, "rounds": rounds,
            "draft_tokens": draft_tokens, "model": model or "default"}
    rows = [("none_tok_s", "decode, --spec none, batch 1", "tok/s", ",.1f"),
            ("mtp_tok_s", f"decode, --spec mtp (adaptive, k <= {draft_tokens})", "tok/s",
             ",.1f"),
            ("speedup", "  speed-up of mtp over none", "x", ".2f"),
            ("acceptance", "  drafted tokens accepted", "fraction", ".2f"),
            ("same_replies", "  greedy replies identical", "", "")]
    report("drafting", flat, rows, TARGETS, json_path)
    return 0 if flat["same_replies"] else 1


def add_bench_parser(bench_subparsers) -> argparse.ArgumentParser:
    """`ninfer bench drafting` (its func is `run`)."""
    p = bench_subparsers.add_parser(
        "drafting", help="served on the CPU, batch 1: decode tok/s of --spec mtp against "
                         "--spec none on held-out code continuations, in one run")
    p.add_argument("model", nargs="?", default=None,
                   help="a .ninfer file or HF folder (default: the default model)")
    p.add_argument("--tokens", type=int, default=128, help="tokens each reply decodes")
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts (best of)")
    p.add_argument("--draft-tokens", type=int, default=3, help="the most tokens drafted")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    return main(args.model, args.tokens, args.rounds, args.draft_tokens, args.torch_threads,
                args.json)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="ninfer bench")
    add_bench_parser(parser.add_subparsers(dest="target", required=True))
    parsed = parser.parse_args(["drafting", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
