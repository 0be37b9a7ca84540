"""`ninfer bench serve --outside` (and `--device cuda`, or `--model PATH`): the server as a
user meets it, measured from outside through HTTP. A fresh `ninfer serve` process (its own
journal in a temporary folder, a free port, the device, the model and the options recorded
in the JSON) is timed from its start to `/health` 200; then, by `serve_probes`: the first
requests after ready against the same sizes again with other text; cold prefill of long
prompts; the next turn of a conversation (its reply sent back with ~26 new tokens) against
its first turn; total tokens/s at several concurrent streams; a streaming client's gap
between tokens while another request prefills a long prompt; and the same decode probes on
a second server started with `--spec mtp`, against `--spec none`.

On the CPU (the tiny model) the sizes are small, so the run takes about a minute; on CUDA
they are the issue's (1K/4K first requests, 16K/32K cold, 1/4/8/32 streams), and the JSON
goes to bench/results/serve-cuda-<card>.json unless `--json` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .report import report


@dataclass(frozen=True)
class Sizes:
    first: tuple[int, ...]        # first requests after ready (prompt tokens), then again
    cold: tuple[int, ...]         # cold prefill
    next_turn: tuple[int, ...]    # conversation lengths before the next turn
    streams: tuple[int, ...]      # concurrent streams decoding
    mtp_streams: tuple[int, ...]  # the same, on the --spec mtp server
    decode_tokens: int            # tokens each decoding stream asks for
    long_prefill: int             # the prompt prefilled beside a streaming client
    new_turn_tokens: int = 26     # the next turn's new tokens
    reply_tokens: int = 16        # the first turn's reply

    @property
    def longest(self) -> int:
        return max(*self.first, *self.cold, *self.next_turn, self.long_prefill)


SIZES = {
    "cuda": Sizes(first=(1024, 4096), cold=(16384, 32768), next_turn=(1024, 4096, 16384, 32768),
                  streams=(1, 4, 8, 32), mtp_streams=(1, 8), decode_tokens=256,
                  long_prefill=32768),
    "cuda-quick": Sizes(first=(1024, 4096), cold=(16384,), next_turn=(1024, 4096, 16384),
                        streams=(1, 8), mtp_streams=(1, 8), decode_tokens=64,
                        long_prefill=16384),
    "cpu": Sizes(first=(256, 512), cold=(1024, 2048), next_turn=(256, 512, 1024, 2048),
                 streams=(1, 2, 4), mtp_streams=(1, 2), decode_tokens=32, long_prefill=2048),
    "cpu-quick": Sizes(first=(256,), cold=(512,), next_turn=(256, 512), streams=(1, 2),
                       mtp_streams=(1,), decode_tokens=12, long_prefill=1024,
                       reply_tokens=8),
}

# the goals (32, "the GPU serving path as users feel it"), checked on CUDA only
TARGETS = {"ready_s": ("<=", 60), "ready_warm_s": ("<=", 15), "first_over_repeat_1024": ("<=", 1.2),
           "first_over_repeat_4096": ("<=", 1.2), "turn2_ttft_ms_4096": ("<=", 15),
           "turn2_ttft_ms_16384": ("<=", 15), "turn2_ttft_ms_32768": ("<=", 15),
           "prefill_gap_ratio": ("<=", 3), "http_over_engine_8": (">=", 0.9)}


SLOW_STEP_MS = 10   # on CUDA, the server logs steps this long (`--log-slow-steps`)


def sizes_for(device: str, quick: bool) -> Sizes:
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return SIZES[f"{kind}-quick" if quick else kind]


def server_options(device: str, model: str | None, sizes: Sizes, max_concurrency: int,
                   extra: list[str]) -> list[str]:
    """`ninfer serve`'s options, every one that matters to a figure given explicitly: a
    context that holds the longest prompt and a stream beside it, a KV pool of four such
    contexts (the conversations' endpoints stay while the probes go on; on CUDA the
    server's own, from the free memory), the device's dtype and prefill chunk (the server's
    defaults for it, written out)."""
    from ..server.serve import default_dtype, default_prefill_chunk
    context = 1 << (sizes.longest + 2 * sizes.decode_tokens + 1024).bit_length()
    # (on CUDA the KV pool is the server's default, sized from the GPU's free memory, and
    # the log names each step of 10 ms or more: what a stalled stream waited for)
    pool = ["--log-slow-steps", str(SLOW_STEP_MS)] if device.startswith("cuda") \
        else ["--kv-capacity", str(4 * context)]
    return [*([model] if model else []), "--device", device, "--dtype", default_dtype(device),
            "--prefill-chunk", str(default_prefill_chunk(device)), "--max-context",
            str(context), *pool, "--max-concurrency",
            str(max_concurrency), "--max-pending", "256", "--log-level", "INFO", *extra]


def card_name(device: str) -> str:
    """The device's card as a file name's part: "h100" for "NVIDIA H100 80GB HBM3"."""
    if not device.startswith("cuda"):
        return "cpu"
    import torch
    name = torch.cuda.get_device_name(torch.device(device))
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w != "nvidia"]
    return next((w for w in words if re.search(r"\d", w)), "-".join(words) or "gpu")


def default_json_path(device: str, card: str) -> str | None:
    """Where a run's JSON goes without `--json`: bench/results/serve-cuda-<card>.json on
    CUDA; nowhere on the CPU (printed only)."""
    if not device.startswith("cuda"):
        return None
    return f"bench/results/serve-cuda-{card}.json"


def rows(results: dict, sizes: Sizes) -> list[tuple]:
    """The table: each figure beside its baseline of the same run."""
    out: list[tuple] = [("port_open_s", "server start -> port answers", "s", ".2f"),
                        ("ready_s", "server start -> /health 200 (empty kernel cache)", "s",
                         ".2f"),
                        ("warm_up_s", "  of it, the warm-up", "s", ".2f"),
                        ("warm_up_graphs", "  CUDA graphs it captured", "graphs", ".0f"),
                        ("graph_memory_mib", "  their memory", "MiB", ",.0f"),
                        ("kernels_after_ready", "  kernel shapes first met after ready",
                         "kernels", ".0f"),
                        ("ready_warm_s", "again, the cache kept: start -> /health 200", "s",
                         ".2f")]
    for n in sizes.first:
        out += [(f"first_ttft_ms_{n}", f"first request after ready, {n} tokens: TTFT", "ms",
                 ",.1f"),
                (f"repeat_ttft_ms_{n}", "  same size again, other text", "ms", ",.1f"),
                (f"first_over_repeat_{n}", "  first / repeat", "x", ".2f")]
    for n in sizes.cold:
        out += [(f"cold_ttft_ms_{n}", f"cold prompt, {n} tokens: TTFT", "ms", ",.1f"),
                (f"cold_prefill_tok_s_{n}", "  prompt tokens / TTFT", "tok/s", ",.0f")]
    for n in sizes.next_turn:
        out += [(f"turn2_ttft_ms_{n}", f"next turn at {n} tokens: TTFT", "ms", ",.1f"),
                (f"turn1_ttft_ms_{n}", "  its first turn", "ms", ",.1f"),
                (f"turn2_cached_tokens_{n}", "  prompt tokens reused", "tokens", ",d"),
                (f"turn2_new_tokens_{n}", "  prompt tokens computed", "tokens", ",d"),
                (f"retry_ttft_ms_{n}", "  the turn again, another message: TTFT", "ms",
                 ",.1f"),
                (f"retry_new_tokens_{n}", "    prompt tokens computed", "tokens", ",d")]
    for n in sizes.streams:
        out += [(f"decode_tok_s_{n}", f"decode, {n} streams: total", "tok/s", ",.0f"),
                (f"decode_per_stream_tok_s_{n}", "  per stream (median)", "tok/s", ",.0f"),
                (f"decode_gap_ms_median_{n}", "  gap between deltas, median", "ms", ".2f"),
                (f"decode_gap_ms_p99_{n}", "  gap between deltas, p99", "ms", ".2f"),
                (f"decode_together_tok_s_{n}", "  total while every stream decoded",
                 "tok/s", ",.0f"),
                (f"engine_decode_tok_s_{n}", "  the bare engine's decode at that batch",
                 "tok/s", ",.0f"),
                (f"http_over_engine_{n}", "  through HTTP / bare engine", "x", ".2f")]
    out += [("prefill_gap_max_ms", f"a stream's largest gap, {sizes.long_prefill} prefilling",
             "ms", ",.1f"),
            ("prefill_gap_usual_ms", "  its usual gap (median before)", "ms", ".2f"),
            ("prefill_gap_ratio", "  largest / usual", "x", ".1f")]
    if "mtp_ready_s" in results:
        out += [("mtp_ready_s", "--spec mtp server start -> /health 200", "s", ".2f"),
                ("mtp_warm_up_graphs", "  CUDA graphs its warm-up captured", "graphs", ".0f"),
                ("mtp_graph_memory_mib", "  their memory", "MiB", ",.0f"),
                ("mtp_kernels_after_ready", "  kernel shapes first met after ready",
                 "kernels", ".0f")]
        for n in sizes.mtp_streams:
            out += [(f"mtp_decode_tok_s_{n}", f"decode, {n} streams, --spec mtp: total",
                     "tok/s", ",.0f"),
                    (f"decode_tok_s_{n}", "  --spec none", "tok/s", ",.0f"),
                    (f"mtp_over_none_{n}", "  mtp / none", "x", ".2f")]
        out.append(("mtp_acceptance", "  drafted tokens accepted", "fraction", ".2f"))
    return [row for row in out if row[0] in results]  # (no graphs: no graph figures)


def warm_up_figures(log: Path) -> dict:
    """The warm-up's figures from a server's log (`ninfer.server.warmup`): its seconds,
    the CUDA graphs it captured and their memory (absent without graphs), and the kernel
    specialisations requests met after ready (`kernels.compiles`; absent on the CPU)."""
    lines = log.read_text(errors="replace").splitlines()
    line = next((x for x in lines if "warm-up:" in x and "requests" in x), "")
    out: dict = {}
    if any("kernel specialisations compiled or loaded" in x for x in lines):
        late = [x.split("this request waits for it): ", 1)[-1] for x in lines
                if "new specialisation after ready" in x]
        out.update(kernels_after_ready=len(late), kernels_after_ready_list=late[:40])
    for key, pattern in (("warm_up_s", r"([\d.]+) s in all"),
                         ("warm_up_graphs", r"([\d,]+) CUDA graphs"),
                         ("graph_memory_mib", r"graph memory ([\d,]+) MiB")):
        found = re.search(pattern, line)
        if found:
            out[key] = float(found.group(1).replace(",", ""))
    return out


def measure(options: list[str], sizes: Sizes, prompts, mtp: bool = True) -> dict:
    """Every probe on a fresh `--spec none` server started with `options`, then (with
    `mtp`) the decode probes on a fresh `--spec mtp` one: the flat figures."""
    from tqdm import tqdm

    from .serve_probes import Probes
    from .server_process import started
    from .timed_stream import metric
    keys = itertools.count(1)   # one numbering for both servers: no two prompts alike
    folder = Path(tempfile.mkdtemp(prefix="ninfer-bench-outside-"))
    # the first start compiles into an empty kernel cache; a second start reuses it
    env = {"TRITON_CACHE_DIR": str(folder / "triton-cache")}
    results: dict = {}
    with started(["--spec", "none", *options], folder / "none", env=env) as server:
        probes = Probes(server.url, prompts, keys)
        results.update(port_open_s=server.port_open_s, ready_s=server.ready_s)
        steps = [lambda: probes.first_requests(sizes.first),   # first: nothing ran before
                 lambda: probes.cold_prefill(sizes.cold),
                 lambda: probes.next_turn(sizes.next_turn, sizes.new_turn_tokens,
                                          sizes.reply_tokens),
                 lambda: probes.decode(sizes.streams, sizes.decode_tokens),
                 lambda: probes.gap_under_prefill(
                     sizes.long_prefill, stream_tokens=sizes.longest + 4 * sizes.decode_tokens)]
        for step in tqdm(steps, desc="bench serve (--spec none)", file=sys.stderr,
                         leave=False):
            results.update(step())
        results.update(warm_up_figures(server.log))   # (after the probes: what they met)
    with started(["--spec", "none", *options], folder / "again", env=env) as server:
        results["ready_warm_s"] = server.ready_s
    if not mtp:
        return results
    with started(["--spec", "mtp", *options], folder / "mtp", env=env) as server:
        probes = Probes(server.url, prompts, keys)
        results["mtp_ready_s"] = server.ready_s
        results.update(probes.decode(sizes.mtp_streams, sizes.decode_tokens, "mtp_"))
        drafted = metric(server.url, "ninfer_drafted_tokens_total")
        accepted = metric(server.url, "ninfer_accepted_tokens_total")
        results.update({f"mtp_{k}": v for k, v in warm_up_figures(server.log).items()})
    for n in sizes.mtp_streams:
        results[f"mtp_over_none_{n}"] = (results[f"mtp_decode_tok_s_{n}"]
                                         / results[f"decode_tok_s_{n}"])
    results.update(mtp_drafted_tokens=drafted,
                   mtp_acceptance=accepted / drafted if drafted else 0.0)
    return results


def engine_baseline(model: str | None, device: str, sizes: Sizes, results: dict) -> dict:
    """The bare engine in this process (no HTTP; after the servers stopped) on the same
    model, device and dtype: decode tokens/s at each stream count, the prompts prefilled
    first (`Bench.decode`, best of two: the first run captures its graphs), and through
    HTTP over it where every stream decoded at once (`decode_together_tok_s_<n>`)."""
    from ..server.serve import default_dtype
    from .engine import Bench
    from .serve_probes import PROMPT_TOKENS
    bench = Bench(model, device, default_dtype(device))
    out: dict = {}
    for n in sizes.streams:
        out[f"engine_decode_tok_s_{n}"] = max(
            bench.decode(n, tokens=sizes.decode_tokens, context=PROMPT_TOKENS)["tok_s"]
            for _ in range(2))
        together = results.get(f"decode_together_tok_s_{n}")
        if together is not None:
            out[f"http_over_engine_{n}"] = together / out[f"engine_decode_tok_s_{n}"]
    del bench
    if device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()
    return out


def main(device: str = "cpu", model: str | None = None, quick: bool = False,
         json_path: str | None = None, max_concurrency: int | None = None,
         extra: list[str] | None = None, sizes: Sizes | None = None, mtp: bool = True) -> int:
    """`measure` on `model` on `device`, the table printed and the JSON written (default
    on CUDA: bench/results/serve-cuda-<card>.json). Fails (1) when a next turn did not
    reuse its conversation: a probe that measures a re-prefill measures the wrong thing."""
    from ..model.runtime import benchmark_on_the_random_model
    from .sized_prompts import PromptMaker
    benchmark_on_the_random_model()
    sizes = sizes or sizes_for(device, quick)
    # on CUDA every stream of the widest probe decodes at once (a graph per batch size)
    lanes = max_concurrency or (max(8, *sizes.streams) if device.startswith("cuda") else 4)
    options = server_options(device, model, sizes, lanes, extra or [])
    results = measure(options, sizes, PromptMaker.for_model(model), mtp)
    results.update(engine_baseline(model, device, sizes, results))
    card = card_name(device)
    results.update(device=device, card=card, model=model or "default",
                   server_options=options, max_concurrency=lanes,
                   sizes=dataclasses.asdict(sizes))
    results["next_turn_reused"] = all(
        results[f"turn2_cached_tokens_{n}"] >= results[f"turn1_prompt_tokens_{n}"]
        for n in sizes.next_turn)
    if not results["next_turn_reused"]:
        print("bench serve: a next turn did not reuse its conversation", file=sys.stderr)
    print(f"ninfer bench serve, from outside: {model or 'the default model'} on {card} "
          f"({lanes} lanes; streams past them wait)")
    targets = {k: t for k, t in TARGETS.items() if k in results} \
        if device.startswith("cuda") else {}   # (--quick measures fewer sizes)
    report("serve-outside", results, rows(results, sizes), targets,
           json_path or default_json_path(device, card))
    return 0 if results["next_turn_reused"] else 1


def add_outside_options(parser: argparse.ArgumentParser) -> None:
    """`ninfer bench serve`'s options for measuring from outside; its func then runs
    `main` when any of them asks for it (`--outside`, a device other than the CPU, or a
    model), else the in-process bench as before."""
    group = parser.add_argument_group(
        "measured from outside", "--outside, --device cuda or --model: a fresh `ninfer serve` "
        "process measured through HTTP (time to ready, first request after it, cold "
        "prefill, next turn, 1/4/8/32 streams, a stream beside a long prefill, --spec mtp "
        "against none); JSON to bench/results/serve-cuda-<card>.json on CUDA")
    group.add_argument("--outside", action="store_true",
                       help="measure a `ninfer serve` subprocess (on the CPU: small sizes)")
    group.add_argument("--device", default="cpu", help="the server's device (default cpu)")
    group.add_argument("--model", default=None,
                       help="model directory or .ninfer file (default: the random tiny "
                            "model)")
    group.add_argument("--quick", action="store_true",
                       help="fewer and shorter probes (a smoke run, not the reported figures)")
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="the server's lanes (default on CUDA: the most streams a probe "
                            "runs, at least 8; 4 on the CPU)")
    group.add_argument("--server-args", default="",
                       help="more `ninfer serve` options, one shell-quoted string")
    group.add_argument("--no-mtp", action="store_true",
                       help="skip the second server (--spec mtp)")
    inside = parser.get_default("func")

    def run(args: argparse.Namespace) -> int:
        if not (args.outside or args.device != "cpu" or args.model):
            return inside(args)
        return main(device=args.device, model=args.model, quick=args.quick,
                    json_path=args.json, max_concurrency=args.max_concurrency,
                    extra=shlex.split(args.server_args), mtp=not args.no_mtp)
    parser.set_defaults(func=run)
