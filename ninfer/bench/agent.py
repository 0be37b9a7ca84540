"""`ninfer bench agent`: how much of a conversation the server reuses, and what cancels and
retries cost, measured from outside by a simulated agent client over HTTP (issue 28).

Each scenario runs twice, once with an explicit session key and once with none, each time
on a fresh `ninfer serve` (a subprocess on loopback, with only the options the run needs)
or on the server at `--url`. The client streams chat completions with a system prompt and
a tool list, each turn's messages the last turn's plus the reply as streamed plus one new
message, the prompt growing evenly from the first turn's (the system prompt, the tools and a
short first message) to `--context` tokens at turn `--turns` (`ninfer.bench.agent_client`).
Prompt tokens computed are read from the server's journal."""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from .agent_client import TOOLS, BenchError, Conversation, calibrate, get_json, send
from .report import write_line
from .server_process import free_port, stop

SCENARIOS = ("single", "interleaved", "same-key", "cancels")
MODES = ("key", "no_key")
HEADROOM = 1024      # context tokens past --context + --max-tokens: the sizing is an estimate
FIRST_OVERHEAD = 24  # template tokens around the system prompt, tools and first message
TURN_OVERHEAD = 10   # template tokens closing the reply and opening the next message
REUSE_GOAL = 0.99    # issue 28: each next turn reuses >= 99% of the last, with no key sent

HELP = """\
Scenarios (each run with an explicit key and with none, side by side):
  single       one conversation
  interleaved  two conversations alternating turns, on a server with --max-concurrency 1
  same-key     the two interleaved conversations under ONE explicit key (the X-Session-Id
               header and the prompt_cache_key body field, the same value): several
               endpoints per key. With no key sent it is `interleaved`, so it runs once
  cancels      one conversation; a seeded choice of --cancel-fraction of turns 2..N is
               first sent and cut by the client as soon as the response headers arrive
               (ninfer sends them after the request's first prefill step), then resent
               identically (the retry); the server runs with --step-delay-ms so the cut
               reaches it before its next step

Figures:
  reuse            cached_tokens of turn N+1 / (prompt + completion tokens of turn N), of
                   the same conversation: median and minimum over turns 2..N (each turn's
                   in the JSON); issue 28's goal is >= 0.99 with no key sent. A retry may
                   pass 1: it also reuses what its cut request computed
  time to first token   send to the first chunk after the role chunk, median of 2..N
  prompt tokens computed   from the server's journal: for every request (cut ones
                   included) and every start of it, the last PrefillAdvanced cursor past
                   RequestStarted.reuse_base. Beside it, prompt tokens sent (every request's
                   prompt, cut ones included) and new (tokens not in the previous turn's
                   prompt and reply, all of turn 1: what a server that forgets nothing
                   computes for one conversation; computed / new where there is one)
  retry TTFT       the retries' time to first token, median, and over the nearest uncut
                   turn's (one turn's growth apart), median

The servers started get only --port, --journal (in a temporary directory, or --workdir),
--max-context and --kv-capacity when --context + --max-tokens + 1024 passes their
defaults (4x that for the KV pool), --max-concurrency 1 for interleaved and same-key, and
--step-delay-ms for cancels. Requests are greedy (temperature 0), with thinking off
(reasoning_effort none) and --max-tokens output tokens."""


class Options(NamedTuple):
    turns: int
    context: int
    max_tokens: int
    seed: int
    cancel_fraction: float
    step_delay_ms: float


class Schedule(NamedTuple):
    """What one scenario sends: its conversations (in the order their turns alternate),
    whether they share one key, and which turns are cut and retried."""

    conversations: tuple[str, ...]
    shared_key: bool
    cut_turns: tuple[int, ...]


class Turn(NamedTuple):
    """One turn as the client saw it (a retried turn: the retry, with its cut request)."""

    conversation: str
    turn: int
    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    previous_tokens: int       # prompt + completion tokens of the conversation's last turn
    reuse: float | None        # cached / previous; None on turn 1
    ttft_ms: float | None
    total_ms: float
    cut_request_id: str | None


class Served(NamedTuple):
    url: str
    journal: Path | None


def schedule(scenario: str, options: Options) -> Schedule:
    if scenario == "cancels":
        eligible = range(2, options.turns + 1)
        count = min(len(eligible), round(options.cancel_fraction * options.turns))
        cut = sorted(random.Random(f"{options.seed}/cancels").sample(eligible, count))
        return Schedule(("A",), False, tuple(cut))
    pair = scenario in ("interleaved", "same-key")
    return Schedule(("A", "B") if pair else ("A",), scenario == "same-key", ())


def modes(scenario: str) -> tuple[str, ...]:
    return ("key",) if scenario == "same-key" else MODES


def server_options(scenario: str, options: Options) -> list[str]:
    """What a scenario's server needs beyond `ninfer serve`'s defaults."""
    from ..server.serve import add_serve_parser
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    defaults = parser.parse_args(["serve"])
    needed = options.context + options.max_tokens + HEADROOM
    extra = []
    if needed > defaults.max_context:
        extra += ["--max-context", str(needed)]
    from ..model.runtime import DEFAULT_KV_CAPACITY  # (the CPU server's pool)
    if 4 * needed > (defaults.kv_capacity or DEFAULT_KV_CAPACITY):
        extra += ["--kv-capacity", str(4 * needed)]
    if scenario in ("interleaved", "same-key"):
        extra += ["--max-concurrency", "1"]
    if scenario == "cancels" and options.step_delay_ms > 0:
        extra += ["--step-delay-ms", f"{options.step_delay_ms:g}"]
    return extra


@contextlib.contextmanager
def serving(extra: list[str], workdir: Path, name: str, model: str | None) -> Iterator[Served]:
    """`ninfer serve` in a subprocess on a free loopback port, its journal and log in
    `workdir`; yields once /health answers 200 and stops the server on exit."""
    port = free_port()
    journal, log = workdir / f"{name}.db", workdir / f"{name}.log"
    command = [sys.executable, "-m", "ninfer.cli", "serve", *([model] if model else []),
               "--port", str(port), "--journal", str(journal), *extra]
    url = f"http://127.0.0.1:{port}"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise BenchError(f"`{' '.join(command)}` exited with {proc.returncode}:\n{tail}")
            with contextlib.suppress(BenchError, OSError):
                if get_json(url, "/health").get("status") == "ok":
                    break
            if time.monotonic() > deadline:
                raise BenchError(f"{url}/health did not answer 200 within 600 s")
            time.sleep(0.1)
        yield Served(url, journal)
    finally:
        stop(proc)


def computed_prompt_tokens(journal: Path, requests: Collection[str]) -> dict[str, int]:
    """Prompt positions each of `requests` prefilled, from the journal: over every start
    (a preempted request starts again), its last PrefillAdvanced cursor past the start's
    RequestStarted.reuse_base."""
    from ..lifecycle.reader import JournalReader
    computed = dict.fromkeys(requests, 0)
    cursor: dict[str, int] = {}
    with JournalReader.open(journal) as j:
        for event in j.events(kinds=("RequestStarted", "PrefillAdvanced")):
            if event.request not in computed:
                continue
            if event.kind == "RequestStarted":
                cursor[event.request] = event.reuse_base
            else:
                computed[event.request] += event.cursor - cursor[event.request]
                cursor[event.request] = event.cursor
    return computed


def run_scenario(url: str, model: str, scenario: str, keyed: bool, options: Options,
                 chars_per_token: float, bar) -> list[Turn]:
    """Drive a scenario's conversations to the end; its turns in the order they were sent."""
    script = schedule(scenario, options)
    conversations = {name: Conversation(f"{scenario}-{name}", options.seed, chars_per_token)
                     for name in script.conversations}
    first = options.context // options.turns
    for conversation in conversations.values():
        conversation.first(first - conversation.fixed_tokens() - FIRST_OVERHEAD)
    turns: list[Turn] = []
    start: dict[str, int] = {}  # each conversation's first prompt, in tokens
    for k in range(1, options.turns + 1):
        for name, conversation in conversations.items():
            key = f"agentbench-{scenario}" + ("" if script.shared_key else f"-{name}")
            body: dict[str, Any] = {
                "model": model, "messages": list(conversation.messages), "tools": TOOLS,
                "max_tokens": options.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "reasoning_effort": "none"}
            headers = {"X-Session-Id": key} if keyed else {}
            if keyed and script.shared_key:
                body["prompt_cache_key"] = key
            cut = None
            if k in script.cut_turns:
                cut = send(url, body, headers, cut=True)
                bar.update()
            reply = send(url, body, headers)
            bar.update()
            usage, previous = reply.usage, conversation.context
            turns.append(Turn(
                name, k, reply.request_id, usage.prompt_tokens, usage.completion_tokens,
                usage.cached_tokens, previous,
                usage.cached_tokens / previous if previous else None,
                None if reply.ttft_s is None else 1000 * reply.ttft_s, 1000 * reply.total_s,
                cut.request_id if cut else None))
            if k == 1:
                start[name] = usage.prompt_tokens
            if k < options.turns:  # the prompt grows evenly from turn 1's to --context
                target = start[name] + (options.context - start[name]) * k // (options.turns - 1)
                grown = usage.prompt_tokens + usage.completion_tokens
                conversation.answer(reply, target - grown - TURN_OVERHEAD)
    return turns


def _nearest_uncut(turn: Turn, turns: list[Turn]) -> Turn | None:
    """The uncut turn (2..N) of the same conversation nearest `turn`; the earlier on a tie."""
    same = [t for t in turns if t.conversation == turn.conversation and t.turn > 1
            and t.cut_request_id is None and t.ttft_ms is not None]
    return min(same, key=lambda t: (abs(t.turn - turn.turn), t.turn), default=None)


def figures(turns: list[Turn], computed: dict[str, int] | None) -> dict[str, Any]:
    """Every figure of one run (see HELP), with its turns."""
    later = [t for t in turns if t.turn > 1]
    reuse = [t.reuse for t in later]
    out: dict[str, Any] = {
        "reuse_median": statistics.median(reuse), "reuse_min": min(reuse),
        "ttft_median_ms": statistics.median(t.ttft_ms for t in later if t.ttft_ms is not None),
        "prompt_tokens_sent": sum(t.prompt_tokens * (2 if t.cut_request_id else 1)
                                  for t in turns),
        "prompt_tokens_new": sum(t.prompt_tokens - t.previous_tokens for t in turns)}
    names = sorted({t.conversation for t in turns})
    if len(names) > 1:
        out["conversations"] = {
            name: {"reuse_median": statistics.median(r), "reuse_min": min(r)}
            for name in names for r in [[t.reuse for t in later if t.conversation == name]]}
    if computed is not None:
        out["prompt_tokens_computed"] = sum(computed.values())
        if len(names) == 1:  # two conversations share a system prompt that "new" counts twice
            out["computed_over_new"] = out["prompt_tokens_computed"] / out["prompt_tokens_new"]
    retried = [t for t in turns if t.cut_request_id]
    if retried:
        out["cut_turns"] = [t.turn for t in retried]
        if computed is not None:
            out["cut_prompt_tokens_computed"] = sum(computed[t.cut_request_id] for t in retried)
        retries = []
        for t in retried:
            base = _nearest_uncut(t, turns)
            ratio = t.ttft_ms / base.ttft_ms if base and t.ttft_ms is not None else None
            retries.append({"turn": t.turn, "ttft_ms": t.ttft_ms,
                            "uncut_turn": base.turn if base else None,
                            "uncut_ttft_ms": base.ttft_ms if base else None, "ratio": ratio})
        out["retries"] = retries
        out["retry_ttft_median_ms"] = statistics.median(
            r["ttft_ms"] for r in retries if r["ttft_ms"] is not None)
        ratios = [r["ratio"] for r in retries if r["ratio"] is not None]
        out["retry_ttft_ratio_median"] = statistics.median(ratios) if ratios else None
    out["turns"] = [t._asdict() | ({} if computed is None else {
        "computed": computed[t.request_id],
        "cut_computed": computed[t.cut_request_id] if t.cut_request_id else None})
        for t in turns]
    return out


def _value(run: dict[str, Any] | None, key: str, fmt: str) -> str:
    if run is None:
        return "(= interleaved)"
    path = key.split(".")
    value: Any = run
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "-"
    return f"{value:{fmt}}"


def table(scenario: str, runs: dict[str, dict[str, Any] | None], server: str) -> None:
    """One scenario's figures, with a key and with none, side by side."""
    rows = [("reuse of the previous turn, median", "reuse_median", ".4f", ""),
            ("reuse of the previous turn, minimum", "reuse_min", ".4f",
             f">= {REUSE_GOAL} (no key)" if scenario != "cancels" else "")]
    key_run = runs["key"] or {}
    for name in key_run.get("conversations", {}):
        rows += [(f"  conversation {name}: median", f"conversations.{name}.reuse_median",
                  ".4f", ""),
                 (f"  conversation {name}: minimum", f"conversations.{name}.reuse_min",
                  ".4f", "")]
    rows += [("time to first token, median of turns 2..N (ms)", "ttft_median_ms", ".0f", ""),
             ("prompt tokens sent", "prompt_tokens_sent", ",d", ""),
             ("prompt tokens new to the conversation", "prompt_tokens_new", ",d", ""),
             ("prompt tokens computed (journal)", "prompt_tokens_computed", ",d", "")]
    if "conversations" not in key_run:
        rows.append(("  computed / new", "computed_over_new", ".3f", ""))
    if scenario == "cancels":
        rows += [("  of which by the cut requests", "cut_prompt_tokens_computed", ",d", ""),
                 ("retries: time to first token, median (ms)", "retry_ttft_median_ms", ".0f", ""),
                 ("retries: TTFT / nearest uncut turn's, median", "retry_ttft_ratio_median",
                  ".2f", "")]
    print(f"\n{scenario}: {server}")
    print(f"  {'figure':<48} {'key':>15} {'no key':>15}  goal (issue 28)")
    for label, key, fmt, goal in rows:
        print(f"  {label:<48} {_value(runs['key'], key, fmt):>15} "
              f"{_value(runs.get('no_key'), key, fmt):>15}  {goal}")


def _model_id(url: str, options: Options) -> str:
    """The served model's name; a BenchError if the context asked for does not fit it."""
    served = get_json(url, "/v1/models")["data"][0]
    limit = served.get("max_model_len")
    if limit and options.context + options.max_tokens + 256 > limit:
        raise BenchError(f"--context {options.context} and --max-tokens {options.max_tokens} "
                         f"do not fit the server's max_model_len {limit}")
    return served["id"]


def _print_tables(doc: dict[str, Any]) -> None:
    options = doc["options"]
    print(f"ninfer bench agent: {options['turns']} turns to ~{options['context']:,} tokens, "
          f"{options['max_tokens']} output tokens a turn, seed {options['seed']}")
    for scenario, entry in doc["scenarios"].items():
        runs = {m: None if "same_as" in (entry[m] or {}) else entry[m] for m in MODES}
        server = (f"the server at {doc['url']}" if doc["url"] else
                  f"ninfer serve {' '.join(entry['server_options']) or '(no options)'}")
        table(scenario, runs, server)
    print()


def main(options: Options, scenarios: list[str], *, url: str | None = None,
         journal: str | None = None, workdir: str | None = None, model: str | None = None,
         json_path: str | None = None) -> int:
    """Run `scenarios` with a key and without (on fresh servers, or on the one at `url`
    whose journal is `journal`), print the tables and the JSON line. 0, or 1 when the
    server answered what the run cannot go on from."""
    from ..model.runtime import benchmark_on_the_random_model
    benchmark_on_the_random_model()
    from tqdm import tqdm
    temporary = url is None and workdir is None
    root = Path(tempfile.mkdtemp(prefix="ninfer-agentbench-") if temporary else workdir or ".")
    doc: dict[str, Any] = {"bench": "agent", "options": options._asdict(), "url": url,
                           "scenarios": {}}
    requests = sum(len(schedule(s, options).conversations) * options.turns
                   + len(schedule(s, options).cut_turns) for s in scenarios for _ in modes(s))
    chars_per_token = None
    try:
        with tqdm(total=requests, unit="request", file=sys.stderr) as bar:
            for scenario in scenarios:
                served_with = [] if url else server_options(scenario, options)
                runs: dict[str, Any] = {"key": None, "no_key": {"same_as": "interleaved"}}
                for mode in modes(scenario):
                    bar.set_description(f"{scenario}, {mode.replace('_', ' ')}")
                    with contextlib.ExitStack() as stack:
                        if url:
                            served = Served(url, Path(journal) if journal else None)
                        else:
                            root.mkdir(parents=True, exist_ok=True)
                            served = stack.enter_context(serving(
                                served_with, root, f"{scenario}-{mode}", model))
                        model_id = _model_id(served.url, options)
                        chars_per_token = chars_per_token or calibrate(served.url, model_id,
                                                                       options.seed)
                        turns = run_scenario(served.url, model_id, scenario, mode == "key",
                                             options, chars_per_token, bar)
                    # a started server's journal is read once it has stopped
                    ids = {t.request_id for t in turns} | {t.cut_request_id for t in turns
                                                          if t.cut_request_id}
                    computed = (computed_prompt_tokens(served.journal, ids)
                                if served.journal else None)
                    runs[mode] = figures(turns, computed)
                    if served.journal and not temporary:
                        runs[mode]["journal"] = str(served.journal)
                doc["scenarios"][scenario] = {"server_options": served_with, **runs}
    except BenchError as exc:
        print(f"ninfer bench agent: {exc}", file=sys.stderr)
        return 1
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)
    doc["chars_per_token"] = chars_per_token
    _print_tables(doc)
    write_line(doc, json_path)
    return 0


def _scenarios(value: str) -> list[str]:
    names = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(SCENARIOS)}")
    return names


def add_bench_parser(bench_subparsers) -> argparse.ArgumentParser:
    """`ninfer bench agent` (its func is `run`)."""
    p = bench_subparsers.add_parser(
        "agent", help="an agent client over HTTP, with a session key and without: context "
                      "reuse per turn, interleaved conversations, one key for two, and "
                      "prompt tokens computed and retry TTFT with cancels",
        description=__doc__.split("\n\n")[0], epilog=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=16, help="turns per conversation (default 16)")
    p.add_argument("--context", type=int, default=8192,
                   help="prompt tokens the last turn grows to (default 8192)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="output tokens per turn (default 32: the default model's are noise)")
    p.add_argument("--seed", type=int, default=0, help="what the client sends (default 0)")
    p.add_argument("--scenarios", type=_scenarios, default=list(SCENARIOS),
                   help=f"comma-separated, of {','.join(SCENARIOS)} (default all)")
    p.add_argument("--cancel-fraction", type=float, default=0.4,
                   help="cancels: the share of turns cut and retried (default 0.4)")
    p.add_argument("--step-delay-ms", type=float, default=50.0,
                   help="cancels: the server's --step-delay-ms, so that a cut lands before "
                        "the request's next step (default 50; 0: none)")
    p.add_argument("--model", default=None,
                   help="the servers' MODEL (default: the random tiny model)")
    p.add_argument("--url", default=None,
                   help="use this running server instead of starting one per run: its own "
                        "options apply, and the runs share it")
    p.add_argument("--journal", default=None,
                   help="with --url: that server's journal, read for prompt tokens computed")
    p.add_argument("--workdir", default=None,
                   help="keep the started servers' journals and logs here (default: a "
                        "temporary directory, removed at the end)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.turns < 2 or args.context < 256 or args.max_tokens < 1:
        print("ninfer bench agent: needs --turns >= 2, --context >= 256, --max-tokens >= 1",
              file=sys.stderr)
        return 2
    if args.journal and not args.url:
        print("ninfer bench agent: --journal is for --url (started servers' journals are "
              "read anyway)", file=sys.stderr)
        return 2
    if args.journal and not Path(args.journal).is_file():
        print(f"ninfer bench agent: no journal at {args.journal}", file=sys.stderr)
        return 2
    options = Options(args.turns, args.context, args.max_tokens, args.seed,
                      args.cancel_fraction, args.step_delay_ms)
    return main(options, args.scenarios, url=args.url, journal=args.journal,
                workdir=args.workdir, model=args.model, json_path=args.json)
