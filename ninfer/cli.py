"""The `ninfer` command: serve | fuzz | bench | train (more subcommands arrive with their
issues)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap

from .bench.agent import add_bench_parser as add_bench_agent_parser
from .bench.drafting import add_bench_parser as add_bench_drafting_parser
from .bench.serve import add_bench_parser as add_bench_serve_parser
from .bench.serve_outside import add_outside_options
from .bench.turn import add_bench_parser as add_bench_turn_parser
from .model.presets import PRESETS
from .server.serve import add_serve_parser
from .tools.journal import add_journal_parser


def _fuzz(args: argparse.Namespace) -> int:
    from .fuzz.command import run_stateful
    return run_stateful(minutes=args.minutes, max_examples=args.max_examples, seed=args.seed)


def _bench(args: argparse.Namespace) -> int:
    from .bench.lifecycle import main as bench_lifecycle
    return bench_lifecycle(events=args.events, requests=args.requests, json_path=args.json)


def _bench_journal(args: argparse.Namespace) -> int:
    from .bench.journal import main as bench_journal
    return bench_journal(events=args.events, json_path=args.json, repeat=args.repeat)


def _bench_engine(args: argparse.Namespace) -> int:
    from .bench.engine import main as bench_engine
    from .server.serve import default_dtype
    if args.tensor_parallel > 1:
        from .bench.tensor_parallel import main as bench_tensor_parallel
        return bench_tensor_parallel(model=args.model, device=args.device,
                                     dtype=args.dtype or default_dtype(args.device),
                                     world=args.tensor_parallel, json_path=args.json,
                                     quick=args.quick, threads=args.threads)
    return bench_engine(model=args.model, device=args.device,
                        dtype=args.dtype or default_dtype(args.device),
                        json_path=args.json, quick=args.quick)


def _bench_constrained(args: argparse.Namespace) -> int:
    from .bench.constrained import main as bench_constrained
    return bench_constrained(json_path=args.json, quick=args.quick, tokens=args.tokens)


def _make_tiny(args: argparse.Namespace) -> int:
    from .model.tiny import make_tiny
    print(make_tiny(args.dir, family=args.family, moe=args.moe, seed=args.seed,
                    dtype=args.dtype, max_shard_bytes=args.max_shard_bytes,
                    preset=args.preset, text_head=args.text_head))
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .model.fileformat import convert
    from .model.loader import LoadError
    try:
        print(convert(args.hf_dir, args.out, progress=not args.quiet))
    except LoadError as exc:
        print(f"ninfer convert: {exc}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ninfer",
        description="Inference server for hybrid (Gated DeltaNet + attention) models, with "
                    "an event journal behind every request.")
    parser.add_argument("--log-level", default="WARNING",
                        help="logging level: DEBUG, INFO, WARNING (default), ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_journal_parser(sub)

    tiny = sub.add_parser(
        "make-tiny", help="write a small random model (Hugging Face layout) with a trained BPE "
                          "tokenizer, a chat template and an MTP layer",
        description=textwrap.fill(
            "Write a random model directory (config, safetensors weights, a trained BPE "
            "tokenizer, a chat template, an MTP layer) of a preset shape.", 78)
        + "\n\npresets:\n" + "\n".join(
            textwrap.fill(f"{name}: {p.description}", 78, initial_indent="  ",
                          subsequent_indent="    ") for name, p in PRESETS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    tiny.add_argument("dir", help="output directory (absent or empty)")
    tiny.add_argument("--preset", choices=list(PRESETS), default="tiny",
                      help="the model's shape (default tiny; see above)")
    tiny.add_argument("--family", choices=["qwen3_next", "qwen3_5"], default="qwen3_next",
                      help="config and weight-name family (default qwen3_next)")
    tiny.add_argument("--moe", action="store_true", help="sparse-MoE blocks instead of dense MLPs")
    tiny.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    tiny.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                      help="stored weight dtype (default bfloat16)")
    tiny.add_argument("--text-head", action="store_true",
                      help="zero the LM head's rows past the tokenizer's ids, so greedy "
                           "decoding writes text a client sees (bench serve's model)")
    tiny.add_argument("--max-shard-bytes", type=int, default=None,
                      help="shard the weights (with an index) above this many bytes")
    tiny.set_defaults(func=_make_tiny)

    convert = sub.add_parser(
        "convert", help="pack a Hugging Face model directory into one .ninfer file")
    convert.add_argument("hf_dir", help="the model directory (config, tokenizer, weights)")
    convert.add_argument("out", help="the .ninfer file to write")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=_convert)

    from .train.cli import DESCRIPTION as TRAIN_DESCRIPTION
    from .train.cli import configure as configure_train
    train = sub.add_parser("train", help="build the corpus, train and evaluate the default model",
                           description=TRAIN_DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    configure_train(train)

    fuzz = sub.add_parser("fuzz", help="long invariant fuzzing (not CI)")
    fuzz_sub = fuzz.add_subparsers(dest="target", required=True)
    stateful = fuzz_sub.add_parser(
        "stateful", help="run the Hypothesis state machine over the engine with SimModel, "
                         "with fresh random seeds, until the time is up or a failure")
    stateful.add_argument("--minutes", type=float, default=10.0,
                          help="how long to fuzz (default 10)")
    stateful.add_argument("--max-examples", type=int, default=2_000,
                          help="examples per round; rounds repeat with new seeds (default 2000)")
    stateful.add_argument("--seed", type=int, default=None,
                          help="run one round with this seed (reproduces a reported failure)")
    stateful.set_defaults(func=_fuzz)
    from .sim.cli import add_sim_parser
    add_sim_parser(fuzz_sub)

    bench = sub.add_parser("bench", help="benchmarks; print a table and JSON")
    bench_sub = bench.add_subparsers(dest="target", required=True)
    lifecycle = bench_sub.add_parser(
        "lifecycle", help="journal, fold and replay rates; lifecycle + journal cost per request")
    lifecycle.add_argument("--events", type=int, default=1_000_000,
                           help="events in the replayed journal (default 1,000,000)")
    lifecycle.add_argument("--requests", type=int, default=20_000,
                           help="requests driven through the lifecycle (default 20,000)")
    lifecycle.add_argument("--json", default=None, help="also write the results to this file")
    lifecycle.set_defaults(func=_bench)
    engine = bench_sub.add_parser(
        "engine", help="prefill and decode rates, drafting gains, checkpoint sizes, and turn-2 "
                       "over turn-1 time to first token at 4K and 16K tokens")
    engine.add_argument("--model", default=None,
                        help="model directory or .ninfer file (default: the random tiny model)")
    engine.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    engine.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float64"],
                        help="compute dtype (default float32 on the CPU, bfloat16 on a GPU)")
    engine.add_argument("--quick", action="store_true",
                        help="short prompts only (a smoke run, not the reported figures)")
    engine.add_argument("--json", default=None, help="also write the results to this file")
    engine.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="also shard the model over N ranks (gloo on the CPU) and print "
                             "the rows at N=1 and N side by side, with rank 0's all-reduce "
                             "time and command overhead per engine step")
    engine.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank, with --tensor-parallel")
    engine.set_defaults(func=_bench_engine)
    constrained = bench_sub.add_parser(
        "constrained", help="a grammar's mask per token at a 4K and a ~152K vocabulary, and "
                            "decode tok/s held to a JSON schema against unconstrained")
    constrained.add_argument("--tokens", type=int, default=128,
                             help="tokens each reply decodes (default 128)")
    constrained.add_argument("--quick", action="store_true",
                             help="the 4K vocabulary and short replies only (a smoke run)")
    constrained.add_argument("--json", default=None, help="also write the results to this file")
    constrained.set_defaults(func=_bench_constrained)
    journal_bench = bench_sub.add_parser(
        "journal", help="journal replay and check rates, and the cost of recovery at "
                        "start-up, on a large journal (against a raw read of its rows)")
    journal_bench.add_argument("--events", type=int, default=1_000_000,
                               help="events in the journal (default 1,000,000)")
    journal_bench.add_argument("--json", default=None, help="also write the results here")
    journal_bench.add_argument("--repeat", type=int, default=3,
                               help="runs of each timed pass; the best is reported (default 3)")
    journal_bench.set_defaults(func=_bench_journal)
    add_outside_options(add_bench_serve_parser(bench_sub))
    add_bench_agent_parser(bench_sub)
    add_bench_drafting_parser(bench_sub)
    add_bench_turn_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    try:
        return args.func(args)
    except BrokenPipeError:  # `ninfer journal show ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
