"""`ninfer serve [MODEL]`: options -> model, engine, journal, engine thread -> FastAPI app on
uvicorn. The port opens at once; `/health` answers 503 until the model is loaded and warmed."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..lifecycle.journalfile import JournalError

log = logging.getLogger("ninfer.server")


def default_journal() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "ninfer" / "journal.db"


MAX_LANES = 64   # the largest batch a decode graph is captured for (ninfer.model.graphs)


def _concurrency(value: str) -> int:
    n = int(value)
    if not 1 <= n <= MAX_LANES:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_LANES}")
    return n


def _alias(value: str) -> tuple[str, str]:
    name, sep, model = value.partition("=")
    if not sep or not name or not model:
        raise argparse.ArgumentTypeError("must be NAME=ID")
    return name, model


def _budget(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError("must be at least 0")
    return n


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def _positive_ms(value: str) -> float:
    ms = float(value)
    if not ms > 0:
        raise argparse.ArgumentTypeError("must be more than 0")
    return ms


def _decode_gap_steps(value: str) -> float:
    gap = float(value)
    if gap != 0 and not gap > 1:
        raise argparse.ArgumentTypeError("must be 0 (no pacing) or more than 1 step")
    return gap


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, but not None: those options say in their help
    what they default to (it depends on the device or the model)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """The `serve` subcommand (its func is `run_serve`)."""
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (an HF directory or a .ninfer file; when omitted, "
                    "$NINFER_MODEL's, else the trained default shipped in the package, "
                    "ninfer-stdlib-8m) at /v1/chat/completions, /v1/completions, /v1/responses, "
                    "/v1/messages and /v1/messages/count_tokens (Anthropic's), /v1/models, "
                    "/health and /metrics, described at /openapi.json and /docs. A "
                    "conversation's session key comes from the X-Session-Id header, else the "
                    "session_id body field, else the prompt_cache_key body field (or "
                    "Anthropic's metadata.user_id), else (unless --no-derive-session-keys) "
                    "from the instructions and first user message. The tenant is the API key "
                    "together with the request's cache_salt.",
        formatter_class=_Defaults)
    p.add_argument("model", nargs="?", default=None,
                   help="model directory or .ninfer file (default: $NINFER_MODEL, a path or "
                        "tiny-qwen3-next-v1 for the random tiny model; else the trained "
                        "ninfer-stdlib-8m shipped in the package)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--model-id", default=None,
                   help="the model name clients send (default: the model's name)")
    p.add_argument("--model-alias", type=_alias, action="append", default=[],
                   metavar="NAME=ID",
                   help="clients may also call the model ID (the served model's id) NAME; "
                        "repeatable")
    p.add_argument("--claude-names", action=argparse.BooleanOptionalAction, default=True,
                   help="the Messages API serves any claude-* model name with the loaded "
                        "model, so Claude Code's model choices all reach it")
    p.add_argument("--reasoning-budget", type=_budget, default=None, metavar="N",
                   help="reasoning tokens a request may write before the server closes its "
                        "reasoning block itself, when the request names no budget or effort "
                        "(default: none, the model closes it or runs out of tokens)")
    # an agent's system prompt and tools run to tens of KB (Claude Code 2.1's with every tool
    # in the prompt: 80 KB, 42K tokens of the random tiny model's tokenizer; the Codex CLI's
    # about 20K), so the defaults fit one and its conversation
    p.add_argument("--max-context", type=_positive, default=65_536,
                   help="most tokens per request, prompt and output together")
    p.add_argument("--kv-capacity", type=_positive, default=None,
                   help="KV positions the block pool holds, shared by lanes and endpoints "
                        "(default: on one GPU, sized from its memory free once the weights "
                        "are on it, logged at start; elsewhere 131,072)")
    p.add_argument("--max-concurrency", type=_concurrency, default=2,
                   help=f"requests prefilling or decoding at once (1-{MAX_LANES}); on CUDA a "
                        "decode graph is captured for each batch size up to it")
    p.add_argument("--prefill-chunk", type=_positive, default=None,
                   help="prompt tokens per prefill step (a cancel lands between chunks, a "
                        "cut prefill resumes from the last one); default 512 on the CPU, "
                        "8192 on a GPU, where a forward's host time does not grow with its "
                        "length (a 32K prompt took 405 ms in 2048-token chunks, 231 ms in "
                        "8192-token ones on an H100)")
    p.add_argument("--decode-gap", type=_decode_gap_steps, default=None, metavar="STEPS",
                   help="while requests decode, another request's long prompt (over one "
                        "--prefill-chunk) is prefilled one chunk per step, sized from "
                        "measured step times so a decoding "
                        "client waits at most this many decode steps between tokens (0: "
                        "every prefilling request takes a whole --prefill-chunk each step); "
                        "default 3; on a GPU, where a forward's host time does not shrink "
                        "with its length, prompts over 2048 tokens are paced, in chunks of "
                        "2048 or more")
    p.add_argument("--log-slow-steps", type=_positive_ms, default=None, metavar="MS",
                   help="log each engine step that takes MS milliseconds or more, with where "
                        "its time went (admitting, launching, the device wait, publishing, "
                        "the journal) and what it prefilled and decoded: what stalled a "
                        "stream (default: not logged)")
    p.add_argument("--spec", choices=["none", "mtp", "ngram"], default="none",
                   help="speculative decoding: the model's MTP head, n-gram lookup, or none")
    p.add_argument("--draft-tokens", type=_positive, default=3,
                   help="most tokens drafted per speculative round")
    p.add_argument("--max-endpoints", type=_positive, default=64,
                   help="endpoints (continuation checkpoints) the store keeps")
    p.add_argument("--state-slots", type=_positive, default=None,
                   help="recurrent-state snapshot slots (lanes, captures and endpoints); "
                        "default 96, or twice --max-concurrency where that is more")
    p.add_argument("--derive-session-keys", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="derive a session key from the instructions and the first user "
                        "message when the request names none (--no-derive-session-keys: "
                        "such a request reuses only shared prefixes; --derive-session-keys, "
                        "the default, is kept for older command lines)")
    p.add_argument("--endpoints-per-session", type=_positive, default=4, metavar="N",
                   help="private endpoints one session key keeps, one per branch (an agent's "
                        "main loop, its sub-agents and side calls share a key); past N the "
                        "least recently used goes")
    p.add_argument("--detach-prefills", action=argparse.BooleanOptionalAction, default=True,
                   help="a prefill its client cuts (agents cancel and resend) is cancelled for "
                        "the client at once but goes on, detached, while no other request "
                        "waits for its lane, and publishes its state at the end of the prompt; "
                        "a resend of the same prompt (or one that extends it) takes it over in "
                        "place (--no-detach-prefills: a cut prefill stops within one step)")
    p.add_argument("--auto-long-anchors", type=int, default=2, metavar="N",
                   help="private anchors at up to N of the last message boundaries of every "
                        "prompt, so a client that rewrites recent history resumes from the "
                        "nearest one (0: none)")
    p.add_argument("--default-max-tokens", type=_positive, default=512,
                   help="output limit when a chat or text completion sets none (capped by "
                        "the context); a Responses API request without max_output_tokens "
                        "runs to the context's end, as OpenAI's does")
    p.add_argument("--journal", default=None,
                   help=f"event journal (SQLite) path (default {default_journal()})")
    p.add_argument("--journal-content", choices=["tokens", "hashes"], default="tokens",
                   help="what the journal keeps of prompts and outputs: token ids and block "
                        "hashes, or only the hashes and the number of tokens (prefix matching "
                        "needs only those; `ninfer journal redrive` needs the ids)")
    p.add_argument("--journal-max-mb", type=float, default=1024.0, metavar="MB",
                   help="rotate the journal past this size: the file is renamed "
                        "<name>.<first seq>-<last seq>.db and a new one opens with a snapshot "
                        "of the store at the next seq (0: never rotate)")
    p.add_argument("--persist-endpoints", default=None, metavar="DIR",
                   help="write published checkpoints to DIR (safetensors, in the background) "
                        "and restore them after a restart, so conversations resume with "
                        "reuse; a damaged or mismatched file is dropped, never loaded "
                        "(default: off)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this API key (repeatable; @PATH reads a file of keys, one a "
                        "line); each key is its own tenant. No key: the server is open")
    p.add_argument("--max-pending", type=_positive, default=64,
                   help="requests waiting for a lane before new ones get 429")
    p.add_argument("--pending-timeout", type=float, default=600.0,
                   help="seconds a request may wait for a lane before it gets 503")
    p.add_argument("--grammar-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="seconds a request's output grammar (a JSON schema, a regex, a Lark "
                        "grammar, forced tool calls) may take to compile before it gets 400")
    p.add_argument("--max-body-bytes", type=_positive, default=8 * 2**20,
                   help="largest request body (413 above it)")
    p.add_argument("--keepalive", type=float, default=5.0,
                   help="seconds between SSE keep-alive comments while nothing is streamed")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default=None,
                   help="model dtype; default float32 on the CPU, bfloat16 on a GPU (where "
                        "the decode path's kernels are tuned for it)")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--tensor-parallel", type=_positive, default=1, metavar="N",
                   help="shard the model over N processes on this host (torch.distributed: "
                        "gloo on the CPU, NCCL on GPUs, one GPU per rank): attention and GDN "
                        "heads, MLP and expert widths and the vocabulary split N ways, one "
                        "all-reduce per block. This process is rank 0 (engine, journal, HTTP) "
                        "and spawns N-1 followers. The degree is part of the model identity: "
                        "endpoints of another N are lost at a restart, never loaded. A rank "
                        "that dies or stalls past --tp-timeout fails the requests in flight "
                        "(503) and the server exits with status 3 for its supervisor to "
                        "restart it. A model whose heads do not divide by N is refused")
    p.add_argument("--tp-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long a tensor-parallel collective waits for another rank "
                        "before the model counts as lost")
    p.add_argument("--torch-threads", type=_positive,
                   default=max(1, (os.cpu_count() or 2) // 2),
                   help="torch intra-op threads (CPU); more than the free cores makes every "
                        "step far slower, since the HTTP side needs a core too")
    p.add_argument("--step-delay-ms", type=float, default=0.0,
                   help="sleep this long after every engine step: a testing aid that slows "
                        "the model so a client can disconnect in a chosen phase")
    p.add_argument("--log-level", default="INFO",
                   help="logging level: DEBUG, INFO (one line per request), WARNING, ERROR")
    p.set_defaults(func=run_serve)
    return p


@dataclass
class Loaded:
    thread: object
    tokenizer: object
    template: object
    model_name: str
    ranks: object = None  # ranks.Ranks of a tensor-parallel run

    def close(self) -> None:
        self.thread.stop()
        self.thread.engine.journal.close()  # the current file, after any rotation
        if self.thread.engine.files is not None:
            self.thread.engine.files.close()  # writes in flight land
        if self.ranks is not None:
            self.ranks.close()  # the followers are told to stop


EXIT_MODEL_LOST = 3  # the status `ninfer serve` exits with when a tensor-parallel rank is lost


def _on_gpu(device: str) -> bool:
    import torch
    return torch.device(device).type == "cuda"


def default_dtype(device: str) -> str:
    """The model dtype when --dtype is not given: bfloat16 on a GPU (half the bytes a
    decode step reads, and what its kernels are tuned for), float32 elsewhere."""
    return "bfloat16" if _on_gpu(device) else "float32"


def default_prefill_chunk(device: str) -> int:
    """Prompt tokens per prefill step when --prefill-chunk is not given: 8192 on a GPU
    (each forward costs ~20 ms of host time whatever its length: a 4K prompt took 45.7 ms
    in chunks of 2048 and 24.2 ms in one, a 32K prompt 405 and 231 ms in chunks of 2048
    and 8192, anchor-1b on an H100, bench/results/prefill-chunks-h100.json; beside
    decoding lanes the pacing takes smaller chunks), 512 elsewhere (a CPU forward's time
    grows with its tokens: smaller chunks let a cancel land sooner)."""
    return 8192 if _on_gpu(device) else 512


def _decode_gap(args: argparse.Namespace) -> float:
    """The engine's decode gap (0: prefill not paced): --decode-gap, else 3 steps."""
    return 3.0 if args.decode_gap is None else args.decode_gap


PACED_FROM_GPU = 2048


def _paced_from(args: argparse.Namespace, chunk: int) -> int:
    """On a GPU, a prompt beside decoding lanes is paced from 2,048 tokens, in chunks of
    2,048 and up (a forward costs ~20-75 ms of host time at any length there: a smaller chunk
    only slows the prefill; since stop 47 a paced chunk's forward runs a layer a step,
    `Model.forward_steps`, so that time is spread over the decode steps); on the CPU (0)
    the pacing sizes chunks from 16 tokens up, for prompts of over one chunk."""
    return min(PACED_FROM_GPU, chunk) if _on_gpu(args.device) else 0


def process_started() -> float:
    """This process's start, in seconds since the epoch (Linux: /proc; elsewhere this
    module's import)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text()
                    .splitlines() if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


_IMPORTED = time.time()


def load(args: argparse.Namespace) -> Loaded:
    """Model, journal, engine (recovered) and its running thread."""
    import torch

    from ..engine.engine import Engine, EngineConfig
    from ..engine.grammar import Grammars
    from ..engine.thread import EngineThread
    from ..lifecycle.journal import Journal
    from ..model.runtime import open_model
    torch.set_num_threads(args.torch_threads)
    dtype = args.dtype or default_dtype(args.device)
    ranks = None
    if args.tensor_parallel > 1:
        from ..model.runtime import launch_ranks
        ranks = launch_ranks(args.tensor_parallel, timeout=args.tp_timeout,
                             threads=args.torch_threads, device=args.device)
    began = time.monotonic()
    om = open_model(args.model, dtype=dtype, device=args.device,
                    kv_capacity=args.kv_capacity, num_slots=state_slots(args),
                    mtp=args.spec == "mtp", ranks=ranks)
    log.info("model loaded in %.1f s (%.1f s since the process started)",
             time.monotonic() - began, time.time() - process_started())
    if args.spec != "none" and om.model.graphs is not None:
        log.warning("--spec %s on %s: verifies and drafts replay CUDA graphs, but a verify "
                    "of 4 positions costs ~2.6 plain steps and only rounds without drafts "
                    "run ahead, so it decodes slower than plain there, even with every draft "
                    "right (bench/results/mtp-span-h100.json); --spec none is the fast path",
                    args.spec, args.device)
    chunk = args.prefill_chunk or default_prefill_chunk(args.device)
    config = EngineConfig(max_concurrency=args.max_concurrency, prefill_chunk=chunk,
                          spec=args.spec, draft_tokens=args.draft_tokens,
                          max_endpoints=args.max_endpoints,
                          endpoints_per_session=args.endpoints_per_session,
                          max_context=min(args.max_context,
                                          om.blocks.num_blocks * om.blocks.block_size),
                          auto_anchors=max(args.auto_long_anchors, 0), keep_finished=False,
                          journal_tokens=args.journal_content == "tokens",
                          detach_prefills=args.detach_prefills,
                          decode_gap=_decode_gap(args),
                          paced_from=_paced_from(args, chunk),
                          slow_step_s=None if args.log_slow_steps is None
                          else args.log_slow_steps / 1000)
    path = Path(args.journal) if args.journal else default_journal()
    path.parent.mkdir(parents=True, exist_ok=True)
    journal = Journal.open(path, identity={"model": om.model.identity, "model_name": om.name,
                                           "spec": args.spec, "dtype": dtype},
                           max_bytes=int(args.journal_max_mb * 2**20) or None)
    files = None
    if args.persist_endpoints:
        from ..engine.durable import EndpointFiles
        files = EndpointFiles(args.persist_endpoints)
    engine = Engine(om.model, config, blocks=om.blocks, slots=om.slots, journal=journal,
                    endpoint_files=files,
                    grammars=Grammars.for_tokenizer(om.tokenizer, om.model.vocab_size))
    engine.recover()
    thread = EngineThread(engine, step_delay=args.step_delay_ms / 1000).start()
    return Loaded(thread, om.tokenizer, om.template, om.name, ranks)


def recall_history(server) -> int:
    """After a restart, each branch's private endpoint (restored from disk) tells the ids
    its next prompt is spliced onto: the in-memory history died with the process. Returns
    how many branches were recalled."""
    from .history import Known

    def latest(engine) -> list:
        held = sorted((s for s in engine.store.endpoints.values()
                       if s.facts.kind == "private" and s.facts.checkpoint.id in engine.held),
                      key=lambda s: (s.last_used_seq, s.published_seq))  # least recent first
        return [(s.facts.tenant, s.facts.session, engine.held[s.facts.checkpoint.id].tokens)
                for s in held]

    found = server.thread.call(latest).result(60)
    for tenant, session, ids in found:
        # a prefix that ends inside a character decodes with a replacement mark and then
        # never matches a prompt's text: such a conversation is simply not spliced
        server.history.remember(tenant, session, [Known(server.tokenizer.decode(ids), ids)])
    return len(found)


def settings_from(args: argparse.Namespace, model_name: str | None = None):
    from .generation import Settings
    from .sessions import load_keys
    return Settings(model_id=args.model_id or model_name or "ninfer",
                    max_context=min(args.max_context, args.kv_capacity or args.max_context),
                    default_max_tokens=args.default_max_tokens,
                    derive_session_keys=args.derive_session_keys,
                    api_keys=load_keys(args.api_key), max_pending=args.max_pending,
                    pending_timeout=args.pending_timeout, max_body_bytes=args.max_body_bytes,
                    keepalive_s=args.keepalive, spec=args.spec,
                    grammar_timeout=args.grammar_timeout,
                    reasoning_budget=args.reasoning_budget,
                    model_aliases=aliases(args.model_alias, args.model_id or model_name
                                          or "ninfer"),
                    claude_names=args.claude_names)


def aliases(pairs: list[tuple[str, str]], model_id: str) -> tuple[str, ...]:
    """The alias names of `--model-alias NAME=ID` pairs; an ID other than the served model's
    is an error (this server serves one model)."""
    for name, target in pairs:
        if target != model_id:
            raise SystemExit(f"--model-alias {name}={target}: this server serves {model_id!r}")
    return tuple(name for name, _ in pairs)


def build(args: argparse.Namespace):
    """The app, with loading and warm-up started in the background by its lifespan."""
    from ..model.runtime import default_model
    from .app import Server, create_app
    from .warmup import warm_up

    name = args.model_id or (Path(args.model).name.removesuffix(".ninfer") if args.model
                             else default_model()[1])
    server = Server(settings_from(args, name))
    app = create_app(server)
    loaded: list[Loaded] = []

    def start() -> None:
        from ..model.runtime import watch_compiles
        try:
            compiles = watch_compiles(args.device)
            result = load(args)
            loaded.append(result)
            held = result.thread.engine.config.max_context   # (a KV pool sized at load)
            if held < server.settings.max_context:
                log.warning("--max-context %d is more than the KV pool holds: %d",
                            server.settings.max_context, held)
                server.settings = dataclasses.replace(server.settings, max_context=held)
            server.attach(result.thread, result.tokenizer, result.template)
            warm_up(server, verify_tokens=args.draft_tokens + 1 if args.spec != "none" else 0)
            if compiles is not None:
                log.info("warm-up: %d kernel specialisations compiled or loaded; any met "
                         "after ready is logged as a warning", compiles.before_ready)
                compiles.ready()
            recalled = recall_history(server)
            if recalled:
                log.info("recalled %d conversations from durable endpoints", recalled)
            # what loading made (the model's modules, the tokenizer, the template, torch's
            # and the libraries' own objects) lives as long as the server: out of the
            # cyclic collector's way, whose full passes over it stalled the engine or the
            # loop for over 100 ms (bench/NOTES.md, stop 42)
            gc.freeze()
            server.ready = True
            log.info("ready: %s on %s:%s, %.1f s since the process started",
                     server.settings.model_id, args.host, args.port,
                     time.time() - process_started())
        except JournalError as exc:   # a journal in use, damaged, foreign: said in full
            log.critical("loading failed: %s", exc)
            server.failed = True
        except Exception:
            log.critical("loading failed", exc_info=True)
            server.failed = True

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loader = threading.Thread(target=start, name="ninfer-load", daemon=True)
        loader.start()
        yield
        loader.join(0)
        for item in loaded:
            item.close()
        # what was frozen at ready may go now (left frozen, Triton's bindings report
        # their objects as leaked at exit)
        gc.unfreeze()

    def model_lost() -> str | None:
        """Why the model is lost: the engine stopped on it, or (while idle, before a step
        finds out) a follower rank exited."""
        for item in loaded:
            if item.thread.model_lost:
                return str(item.thread.error)
            if item.ranks is not None:
                for rank, p in enumerate(item.ranks.followers, start=1):
                    if p.poll() is not None:
                        return f"tensor-parallel rank {rank} exited with status {p.returncode}"
        return None

    app.router.lifespan_context = lifespan
    app.state.model_lost = model_lost
    return app, server


def check_tensor_parallel(args: argparse.Namespace) -> str | None:
    """Why --tensor-parallel cannot shard this model (None: it can), read from its config
    alone, before anything is spawned or served."""
    if args.tensor_parallel == 1:
        return None
    from ..model.runtime import shard_refusal
    refusal = shard_refusal(args.model, args.tensor_parallel)
    return f"--tensor-parallel {args.tensor_parallel}: {refusal}" if refusal else None


def watch_for_lost_model(model_lost, uvicorn_server, exit_code: list[int],
                         grace: float = 1.0, failed=lambda: False) -> None:
    """Stop the HTTP server once the model is lost (`model_lost()` says why; a rank died or
    stalled): requests in flight have had their 503s; the process exits non-zero so that a
    supervisor restarts it. Also once loading `failed()` (the log said why: a journal
    another server holds, a model that does not load): status 1, not 503s for ever."""
    import time
    while not uvicorn_server.should_exit:
        if failed():
            exit_code[0] = 1
            uvicorn_server.should_exit = True
            return
        why = model_lost()
        if why:
            log.critical("the model was lost (%s); exiting with status %d for a restart",
                         why, EXIT_MODEL_LOST)
            exit_code[0] = EXIT_MODEL_LOST
            time.sleep(grace)
            uvicorn_server.should_exit = True
            return
        time.sleep(0.1)


def state_slots(args: argparse.Namespace) -> int:
    """--state-slots, else room for every lane's state and as many captures and endpoints."""
    return args.state_slots or max(96, 2 * args.max_concurrency)


def check_slots(args: argparse.Namespace) -> str | None:
    """Why the state slots cannot serve --max-concurrency lanes (None: they can): each lane
    holds one while it runs, and its captures and the endpoints hold others."""
    slots = state_slots(args)
    if args.max_concurrency >= slots:
        return (f"--max-concurrency {args.max_concurrency} needs more than --state-slots "
                f"{slots} (a slot per lane, and others for its checkpoints and the "
                f"endpoints): give --state-slots {2 * args.max_concurrency} or more")
    return None


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn
    logging.getLogger("ninfer").setLevel(args.log_level.upper())
    logging.getLogger("transitions").setLevel(logging.WARNING)  # one line per trigger is noise
    refused = check_tensor_parallel(args) or check_slots(args)
    if refused:
        print(f"ninfer serve: error: {refused}", file=sys.stderr)
        return 2
    app, server = build(args)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=5)
    uvicorn_server = uvicorn.Server(config)
    exit_code = [0]
    threading.Thread(target=watch_for_lost_model,
                     args=(app.state.model_lost, uvicorn_server, exit_code),
                     kwargs={"failed": lambda: server.failed},
                     name="ninfer-watch", daemon=True).start()
    try:
        uvicorn_server.run()
    except KeyboardInterrupt:   # uvicorn raises the Ctrl+C it handled again once it has
        log.info("stopped")     # shut down (the journal closed): a stop, not a failure
    if exit_code[0] == EXIT_MODEL_LOST:  # the journal is closed; a process group whose
        logging.shutdown()               # peers are gone cannot be torn down cleanly
        os._exit(EXIT_MODEL_LOST)
    return exit_code[0]


def main(argv: list[str] | None = None) -> int:
    """`python -m ninfer.server.serve ...` (the same options as `ninfer serve`)."""
    parser = argparse.ArgumentParser(prog="ninfer")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(argv if argv is not None else sys.argv[1:])])
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
