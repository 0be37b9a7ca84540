"""`ninfer train corpus | run | eval`, also runnable as `python -m ninfer.train ...` where the
server's packages are absent (the GPU machine has torch, triton, tokenizers, jinja2 and tqdm,
which is all `run` needs)."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Train the default model: a small Qwen3.5-layout hybrid (GDN and gated attention 3:1, with
an MTP head) learnt from this machine's Python standard library.

  1. `corpus OUT` builds the corpus here, once (the stdlib's files with their sha256s,
     chat examples made from its functions, a BPE tokenizer, the token ids, the held-out
     evaluation set); carry the folder to the GPU machine, never rebuild it there.
  2. `run --corpus OUT --out model.ninfer --report report.json --device cuda` trains
     (--steps N, or --minutes M to fit a time budget) and writes a .ninfer that
     `ninfer serve MODEL` loads.
  3. `eval model.ninfer --corpus OUT --json eval.json` measures it on the held-out
     modules: bits per byte against xz, docstring replies that parse, valid tool calls,
     MTP and n-gram drafting.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the three subcommands to `parser` (`ninfer train`, or `python -m ninfer.train`)."""
    from .corpus import (
        MADE_UP_NAMES,
        MADE_UP_NAMING,
        MADE_UP_TOOLS,
        TEMPLATES,
        TOOL_EXAMPLES_PER_FUNCTION,
        TOOL_ORDER,
    )
    from .recipe import TrainSettings
    defaults = TrainSettings()
    sub = parser.add_subparsers(dest="train_command", required=True)

    corpus = sub.add_parser("corpus", help="build the training corpus (CPU, ~20 s)",
                            description="Build the corpus folder from this Python's stdlib.")
    corpus.add_argument("out", help="the folder to write (absent or empty), e.g. build/corpus")
    corpus.add_argument("--modules", default=None,
                        help="only these top-level stdlib modules, comma-separated (a slice)")
    corpus.add_argument("--vocab-size", type=int, default=None,
                        help="BPE tokens plus the added ones (default 8192; a slice needs "
                             "fewer)")
    corpus.add_argument("--seed", type=int, default=0, help="examples' seed (default 0)")
    corpus.add_argument("--made-up-tools", type=_share, default=MADE_UP_TOOLS, metavar="SHARE",
                        help="the share of tool examples whose functions and parameters get "
                             "made-up names, so a call is right only when its names are "
                             f"copied from the tools listed (default {MADE_UP_TOOLS})")
    corpus.add_argument("--made-up-names", choices=MADE_UP_NAMES, default=MADE_UP_NAMING,
                        help="how made-up tool and parameter names are made: syllables "
                             "(\"kuba_lo\") or words, real names' parts recombined "
                             "(\"month_lines\": a familiar-looking name must still be "
                             "copied, not finished as the model would; default "
                             f"{MADE_UP_NAMING})")
    corpus.add_argument("--tool-examples", type=int, default=None, metavar="N",
                        help="tool conversations per function usable as a tool (default "
                             f"{TOOL_EXAMPLES_PER_FUNCTION})")
    corpus.add_argument("--near-tools", type=_share, default=0.0, metavar="SHARE",
                        help="the share of tool examples whose other listed tools come from "
                             "the target's own module (alike descriptions: the call must "
                             "follow the request's words; default 0: the recipe's)")
    corpus.add_argument("--tool-order", choices=list(TEMPLATES), default=TOOL_ORDER,
                        help="how the chat template lists a tool: as given (name-first) or "
                             "with its description before its name, so a model told what a "
                             "function does finds the name after the matching text; the "
                             f"trained model keeps that template (default {TOOL_ORDER})")
    corpus.set_defaults(func=_corpus)

    run = sub.add_parser("run", help="train the model on a built corpus",
                         description="Train, writing the .ninfer (also at checkpoints) and "
                                     "a JSON report of losses, tokens, seconds and config.")
    run.add_argument("--corpus", required=True, help="the folder `corpus` built")
    run.add_argument("--out", required=True, help="the .ninfer file to write")
    run.add_argument("--report", default=None, help="the JSON report to write")
    run.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps (default {defaults.steps})")
    budget.add_argument("--minutes", type=float, default=None,
                        help="train about this long instead: the steps are fixed from the "
                             "first steps' pace and recorded in the report")
    run.add_argument("--seed", type=int, default=defaults.seed,
                     help=f"weights' and batches' seed (default {defaults.seed})")
    run.add_argument("--batch", type=int, default=defaults.batch,
                     help=f"windows per step (default {defaults.batch})")
    run.add_argument("--seq-len", type=int, default=defaults.seq_len,
                     help=f"tokens per window (default {defaults.seq_len})")
    run.add_argument("--lr", type=float, default=defaults.lr,
                     help=f"peak learning rate (default {defaults.lr})")
    run.add_argument("--mtp-weight", type=float, default=defaults.mtp_weight,
                     help="weight of the MTP head's mean loss beside the main loss "
                          f"(default {defaults.mtp_weight})")
    run.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                     help=f"AdamW's, on matrices (default {defaults.weight_decay})")
    run.add_argument("--whole-chats", action=argparse.BooleanOptionalAction,
                     default=defaults.whole_chats,
                     help="start a window drawn inside a chat example at that example's "
                          "first token, so every reply is learned with its whole prompt "
                          f"(default {'on' if defaults.whole_chats else 'off'})")
    run.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every,
                     help="also write <out stem>.step<N>.ninfer every N steps (0: never; "
                          f"default {defaults.checkpoint_every})")
    run.add_argument("--shape", choices=["default", "smoke"], default="default",
                     help="default: the 8.2M-parameter shape; smoke: a tiny one for CPU checks")
    run.add_argument("--compile", action="store_true",
                     help="torch.compile the loss (minutes of compiling first; not timed on a "
                          "GPU yet)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.set_defaults(func=_run)

    ev = sub.add_parser("eval", help="measure a trained model on the held-out set",
                        description="Bits per byte against xz, docstring replies that "
                                    "parse, valid tool calls, drafting's tokens per verify.")
    ev.add_argument("model", help="the .ninfer file (or model folder)")
    ev.add_argument("--corpus", required=True, help="the corpus folder it was trained on")
    ev.add_argument("--json", default=None, help="also write the figures to this file")
    ev.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ev.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="compute dtype (default float32 on the CPU, bfloat16 on a GPU)")
    ev.add_argument("--parts", default="bpb,docstrings,tools,drafting",
                    help="comma-separated: bpb, docstrings, tools, drafting (default all)")
    ev.add_argument("--limit", type=int, default=None,
                    help="at most this many prompts (and files) per part")
    ev.add_argument("--window", type=int, default=1024,
                    help="tokens per window for bits per byte (default 1024)")
    ev.add_argument("--stride", type=int, default=None,
                    help="tokens a window scores (it slides on by this many) for bits per "
                         "byte; the rest of it is context (default half the window)")
    ev.add_argument("--concurrency", type=int, default=8,
                    help="replies generated at once (default 8)")
    ev.add_argument("--quiet", action="store_true", help="no progress bars")
    ev.set_defaults(func=_eval)


def _share(value: str) -> float:
    share = float(value)
    if not 0 <= share <= 1:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return share


def _corpus(args: argparse.Namespace) -> int:
    from .corpus import TOOL_EXAMPLES_PER_FUNCTION, VOCAB_SIZE, Corpus, build
    if args.tool_examples is not None and args.tool_examples < 1:
        raise SystemExit("--tool-examples: must be at least 1")
    modules = args.modules.split(",") if args.modules else None
    out = build(args.out, modules=modules, seed=args.seed,
                vocab_size=args.vocab_size or VOCAB_SIZE, made_up_tools=args.made_up_tools,
                tool_examples=args.tool_examples or TOOL_EXAMPLES_PER_FUNCTION,
                made_up_names=args.made_up_names, near_tools=args.near_tools,
                tool_order=args.tool_order,
                progress=lambda stage: print(stage, file=sys.stderr, flush=True))
    corpus = Corpus.open(out)
    print(json.dumps({"corpus": str(out), "sha256": corpus.sha256,
                      "files_sha256": corpus.manifest["files_sha256"],
                      **corpus.manifest["counts"]}, indent=1))
    return 0


def _run(args: argparse.Namespace) -> int:
    import dataclasses

    from .corpus import Corpus
    from .loop import train
    from .recipe import TrainSettings, smoke_shape
    settings = TrainSettings()
    settings = dataclasses.replace(settings, steps=args.steps or settings.steps, seed=args.seed,
                                   batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                                   checkpoint_every=args.checkpoint_every,
                                   mtp_weight=args.mtp_weight, weight_decay=args.weight_decay,
                                   whole_chats=args.whole_chats)
    report = train(Corpus.open(args.corpus), args.out, settings=settings, device=args.device,
                   minutes=args.minutes, report_path=args.report,
                   config_overrides=smoke_shape() if args.shape == "smoke" else None,
                   progress=not args.quiet, compile_loss=args.compile,
                   log=lambda line: print(line, file=sys.stderr, flush=True))
    last = report["losses"][-1] if report["losses"] else {}
    print(json.dumps({k: report[k] for k in ("out", "steps_done", "tokens", "epochs",
                                             "train_seconds", "tokens_per_second")}
                     | {"loss": last.get("main"), "heldout_loss": report["heldout"][-1]["loss"]},
                     indent=1))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from ..model.runtime import open_model
    from .corpus import Corpus
    from .evaluate import PARTS, evaluate, goals, goals_table
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"ninfer train eval: unknown parts {unknown} (choose from {PARTS})",
              file=sys.stderr)
        return 2
    stride = args.stride if args.stride is not None else args.window // 2
    if not 0 < stride < args.window:
        print(f"ninfer train eval: need 0 < --stride < --window "
              f"(got {args.window}, {stride})", file=sys.stderr)
        return 2
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    om = open_model(args.model, dtype=dtype, device=args.device)
    figures = evaluate(om, Corpus.open(args.corpus), parts=parts, limit=args.limit,
                       window=args.window, stride=stride, concurrency=args.concurrency,
                       progress=not args.quiet)
    figures |= {"model": str(args.model), "device": args.device, "dtype": dtype,
                "goals": goals(figures)}
    text = json.dumps(figures, indent=1, ensure_ascii=False)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)
    if figures["goals"]:
        print(goals_table(figures["goals"]), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninfer.train", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(parser)
    args = parser.parse_args(argv)
    return args.func(args)
