"""`ninfer journal replay | check | show | stats | export | redrive`: read a journal, never
write it.

Every command reads through a `JournalReader` (the file opened read-only, after the
journal's own checks). Exit status: 0 fine, 1 an invariant violation (check, replay) or
nothing to show, 2 a journal that cannot be read (a JournalError: not SQLite, a foreign or
newer schema, an event that does not decode)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

from ..lifecycle import events as ev
from ..lifecycle.journal import JournalError
from ..lifecycle.reader import COLUMNS, JournalReader
from ..lifecycle.store import InvariantViolation
from . import scan
from .scan import check, replay_summary

LEAD_UP = 8              # events of the request printed before a violation
_TICK = 4096             # items between two updates of a progress bar
T = TypeVar("T")


def _progress(items: Iterable[T], total: int) -> Iterator[T]:
    """`items`, with a progress bar on stderr while they come when `total` (how many there
    will be at most) is above scan.PROGRESS_MIN."""
    if total <= scan.PROGRESS_MIN:
        yield from items
        return
    bar = tqdm(total=total, file=sys.stderr, unit="ev", leave=False)
    try:
        for n, item in enumerate(items, 1):
            yield item
            if not n % _TICK:
                bar.update(_TICK)
    finally:
        bar.close()


def lead_up(src: JournalReader, v: InvariantViolation, n: int = LEAD_UP) -> list[dict]:
    """The last `n` events up to the violation `v`'s seq (its request's, when it names
    one), oldest first, with a detail line each."""
    where, params = ("request = ? AND seq <= ?", (v.request, v.seq)) if v.request \
        else ("seq <= ? AND seq > ?", (v.seq, v.seq - n))
    with src.errors("reading events"):  # newest first: SQLite stops after n
        rows = src.query(f"SELECT {COLUMNS} FROM events WHERE {where} ORDER BY seq DESC "
                         f"LIMIT {int(n)}", params).fetchall()
    return [src.readable(r) | {"detail": describe(src.decode(r))} for r in reversed(rows)]


def describe(e: ev.Event) -> str:
    """The fields of `e` that matter to a person reading a timeline."""
    k = e.kind
    if k == "RequestQueued":
        return f"tenant={e.tenant} prompt_len={e.prompt_len} max_tokens=" \
               f"{e.params.get('max_tokens')} boundaries={list(e.boundaries)}"
    if k == "RequestStarted":
        return f"plan={e.plan} reuse_base={e.reuse_base} endpoint={e.endpoint} target={e.target}"
    if k in ("PrefillAdvanced", "PrefillCompleted"):
        first = f" first_token={e.first_token}" if k == "PrefillCompleted" else ""
        return f"cursor={e.cursor}{first}"
    if k == "TokensCommitted":
        return f"tokens={e.committed} frontier={e.frontier} drafted={e.drafted} " \
               f"accepted={e.accepted}"
    if k == "CheckpointCaptured":
        return f"checkpoint={e.checkpoint.id} @{e.checkpoint.position}"
    if k == "EndpointPublished":
        return f"PUBLISH {e.endpoint.kind} {e.endpoint.id} @{e.endpoint.position}"
    if k == "PublicationRefused":
        return f"REFUSE {e.checkpoint} @{e.position}: {e.reason}"
    if k == "PlanFallback":
        return f"candidate={e.candidate} @{e.position}: {e.reason}"
    skip = set(ev.Event.ENVELOPE) | {"options"}
    return " ".join(f"{f.name}={getattr(e, f.name)}" for f in dataclasses.fields(e)
                    if f.name not in skip)


def timeline(src: JournalReader, request: str | None, conversation: str | None) -> list[dict]:
    which = {"request": request} if request is not None else {"conversation": conversation}
    out, t0 = [], None
    for e in _progress(src.events(lean=True, **which), src.count()):
        t0 = e.time if t0 is None else t0
        out.append({"seq": e.seq, "offset": e.time - t0, "request": e.request, "kind": e.kind,
                    "detail": describe(e), "terminal": e.kind in ev.TERMINAL_KINDS})
    return out


def _quantile(xs: list[float], q: float) -> float | None:
    """Nearest-rank quantile of `xs` (None when empty)."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs) - 1e-9) - 1)]


def stats(src: JournalReader) -> dict:
    count = src.count()
    first = last = None
    queued_at, prompt, outputs, ttft, ratios = {}, {}, Counter(), {}, []
    drafted = accepted = committed = requests = computed = 0
    cancels, cuts = Counter(), Counter()
    frontier: dict[str, int] = {}   # each request's prefill cursor, to count computed tokens
    for e in _progress(src.events(lean=True), count):
        first = e.time if first is None else first
        last, k = e.time, e.kind
        if k == "RequestQueued":
            requests += 1
            queued_at[e.request], prompt[e.request] = e.time, e.prompt_len
        elif k == "StoreSnapshotted":  # a rotated file: carried requests' lengths so far
            for rid, r in e.requests.items():
                prompt.setdefault(rid, r["prompt_len"])
                outputs[rid] += r["outputs"] if rid not in queued_at else 0
        elif k == "RequestStarted":
            ratios.append(e.reuse_base / (prompt[e.request] + outputs[e.request]))
            frontier[e.request] = e.reuse_base
        elif k == "PrefillAdvanced":
            computed += e.cursor - frontier.get(e.request, e.cursor)
            frontier[e.request] = e.cursor
        elif k in ("PrefillDetached", "PrefillAdopted"):
            cuts[k.removeprefix("Prefill").lower()] += 1
        elif k == "TokensCommitted":
            drafted, accepted = drafted + e.drafted, accepted + e.accepted
            committed += e.committed
            outputs[e.request] += e.committed
            if e.request in queued_at:  # not for requests queued in an earlier file
                ttft.setdefault(e.request, e.time - queued_at[e.request])
        elif k == "RequestCancelled":
            cancels[e.at_state] += 1
    span = (last - first) if first is not None else 0.0
    lat = list(ttft.values())
    return {"events": count, "requests": requests, "span_s": span,
            "requests_per_s": requests / span if span > 0 else None,
            "tokens_committed": committed,
            "tokens_per_s": committed / span if span > 0 else None,
            "mean_reuse_ratio": sum(ratios) / len(ratios) if ratios else None,
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "ttft_median_s": _quantile(lat, 0.5), "ttft_p90_s": _quantile(lat, 0.9),
            "cancellations": dict(cancels),
            "prefill_tokens_computed": computed,
            "cut_prefills": dict(cuts)}


# --- the commands ---------------------------------------------------------------------------


def _table(title: str, counts: dict) -> list[str]:
    rows = [f"  {k:<40} {v:>8}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])]
    return [f"{title}:"] + (rows or ["  (none)"])


def _replay(args: argparse.Namespace, src: JournalReader) -> int:
    try:
        s = replay_summary(src)
    except InvariantViolation as v:
        print(f"replay stopped: {v}", file=sys.stderr)
        return 1
    if args.json:
        return _dump(s)
    st = s["store"]
    lines = [f"{s['events']} events, {s['requests']} requests"]
    for title, key in (("outcomes", "outcomes"), ("plans", "plans"), ("published", "published"),
                       ("refused (reason)", "refused"), ("evicted (reason)", "evicted"),
                       ("lost (reason)", "lost"), ("store at the end (kind)", "by_kind")):
        lines += _table(title, st[key] if key == "by_kind" else s[key])
    lines.append(f"store: {st['endpoints']} endpoints held of {st['max_endpoints']}, "
                 f"folded to seq {st['applied_seq']}")
    print("\n".join(lines))
    return 0


def _check(args: argparse.Namespace, src: JournalReader) -> int:
    done, v = check(src)
    if v is None:
        doc = {"ok": True, "events": done.events, "requests": done.requests}
        if args.json:
            return _dump(doc)
        print(f"{done.events} events, {done.requests} requests: every "
              "journal-checkable invariant holds")
        return 0
    if isinstance(v, JournalError):  # unreadable from here on: say what did check out
        doc = {"ok": False, "error": str(v), "verified_events": done.events,
               "verified_up_to_seq": done.last_seq}
        if args.json:
            _dump(doc)
        else:
            print(f"ninfer journal check: {v}", file=sys.stderr)
            print(f"{done.events} events (up to seq {done.last_seq}) were read and every "
                  "journal-checkable invariant held up to there", file=sys.stderr)
        return 2
    before = lead_up(src, v)
    doc = {"ok": False, "invariant": v.invariant, "seq": v.seq, "request": v.request,
           "message": str(v), "verified_events": done.events, "lead_up": before}
    if args.json:
        _dump(doc)
        return 1
    print(f"VIOLATION of invariant {v.invariant} at seq {v.seq}, request {v.request}:\n  {v}")
    print(f"{doc['verified_events']} events verified before it; the events that led there:")
    for r in before:
        print(f"  seq {r['seq']:>8} {r['request'] or '-':<10} {r['kind']:<20} "
              f"{r['detail']}")
    return 1


def _show(args: argparse.Namespace, src: JournalReader) -> int:
    lines = timeline(src, args.request, args.conversation)
    if not lines:
        what = f"request {args.request}" if args.request is not None \
            else f"conversation {args.conversation}"
        print(f"no events for {what} in {src.path}", file=sys.stderr)
        return 1
    if args.json:
        return _dump(lines)
    for x in lines:
        off = "+" + format(x["offset"], ".4f") + "s"
        print(f"{off:>11}  #{x['seq']:<8} {x['request'] or '-':<8} "
              f"{x['kind']:<20} {x['detail']}")
    return 0


def _stats(args: argparse.Namespace, src: JournalReader) -> int:
    s = stats(src)
    if args.json:
        return _dump(s)
    for k, v in s.items():
        shown = f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else v)
        print(f"{k:<23} {shown}")
    return 0


def _export(args: argparse.Namespace, src: JournalReader) -> int:
    rows = _progress(src.rows(), src.count())
    out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        if args.json:
            json.dump([src.readable(r) for r in rows], out)
            out.write("\n")
        else:
            for r in rows:
                out.write(json.dumps(src.readable(r), separators=(",", ":")) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def _redrive(args: argparse.Namespace, src: JournalReader) -> int:
    from .redrive import Recording, Redrive, RedriveError, read_recording
    try:
        recording: Recording = read_recording(_progress(src.events(), src.count()), src.meta)
    except RedriveError as e:
        print(f"ninfer journal redrive: {src.path}: {e}", file=sys.stderr)
        return 2
    factory = grammars = None
    if args.model:
        opened = _recorded_model(args.model, src.meta)
        if isinstance(opened, str):
            print(f"ninfer journal redrive: {opened}", file=sys.stderr)
            return 2
        factory, grammars = opened
    with tqdm(total=len(recording.actions), unit="req", file=sys.stderr, leave=False,
              disable=len(recording.actions) < 50 or args.json) as bar:
        out = Redrive(recording, factory, lambda n: bar.update(n - bar.n),
                      kv_positions=args.kv_capacity, grammars=grammars).run()
    agreed, forced = out.agreement
    doc = {"same": out.same, "requests": out.compared, "differing": len(out.differences),
           "model": out.model, "events": out.events, "violations": out.violations,
           "stalls": out.stalls, "differences": out.differences,
           "grammars_checked": out.grammars_checked,
           "grammar_violations": out.grammar_violations}
    if args.model:
        doc["greedy_agreement"] = {"agreed": agreed, "tokens": forced}
    if args.json:
        _dump(doc)
        return 0 if out.same else 1
    print(f"redrove {out.compared} requests through today's code on {out.model} "
          f"({out.events} events)")
    if args.model and forced:
        print(f"the model's greedy choice agreed with the recorded token {agreed} of {forced} "
              f"times ({agreed / forced:.1%})")
    for v in out.violations:
        print(f"VIOLATION in the redriven run: {v}")
    for s in out.stalls:
        print(f"STALL: {s}")
    if out.grammars_checked:
        print(f"checked {out.grammars_checked} constrained outputs against their grammars")
    for g in out.grammar_violations:
        print(f"GRAMMAR: {g}")
    if not out.differences:
        print("every plan, publication, refusal and outcome is as recorded")
    for d in out.differences:
        print(f"request {d['request']} (conversation {d['conversation']}): "
              f"{', '.join(d['fields'])} differ")
        for k in d["fields"]:
            print(f"  {k:<10} recorded {d['recorded'][k]}")
            print(f"  {'':<10} today    {d['redriven'][k]}")
    return 0 if out.same else 1


def _recorded_model(path: str, meta: dict):
    """A factory of the model the journal names and the grammars of its tokenizer, or a
    message saying why not."""
    from ..model.loader import LoadError
    from ..model.runtime import open_model
    try:
        probe = open_model(path, dtype=meta.get("dtype", "float32"), kv_capacity=16,
                           num_slots=1)
    except (LoadError, OSError) as e:
        return f"cannot load {path}: {e}"
    if meta.get("model") and probe.model.identity != meta["model"]:
        return (f"the journal was written by model {meta['model']}, {path} is "
                f"{probe.model.identity}")

    def factory(num_blocks: int, block_size: int, num_slots: int):
        return open_model(path, dtype=meta.get("dtype", "float32"),
                          kv_capacity=num_blocks * block_size, block_size=block_size,
                          num_slots=num_slots).model
    from ..engine.grammar import Grammars
    return factory, Grammars.for_tokenizer(probe.tokenizer, probe.model.vocab_size)


def _dump(doc) -> int:
    print(json.dumps(doc, indent=2))
    return 0


def _run(command):
    def run(args: argparse.Namespace) -> int:
        try:
            with JournalReader.open(args.path) as src:
                return command(args, src)
        except JournalError as e:
            print(f"ninfer journal {args.journal_command}: {e}", file=sys.stderr)
            return 2
    return run


def add_journal_parser(subparsers) -> argparse.ArgumentParser:
    """Register `journal` and its subcommands on `subparsers` (the `ninfer` command's)."""
    journal = subparsers.add_parser(
        "journal", help="read a journal (opened read-only): replay, check, show, stats, export")
    sub = journal.add_subparsers(dest="journal_command", required=True)
    specs = [
        ("replay", _replay, "rebuild the store from the journal and summarise: requests by "
         "outcome, plans by kind, endpoints published / refused (reasons) / evicted / lost, the "
         "store at the end"),
        ("check", _check, "check every journal-checkable invariant (specs/invariants.md); exit 1 "
         "at the first violation with its invariant, seq, request and the events before it"),
        ("show", _show, "a timeline of one request or conversation, one line per event"),
        ("stats", _stats, "rates, reuse ratio, speculative acceptance, time to first token, "
         "cancellations by state, prompt tokens prefilled, cut prefills detached and adopted"),
        ("export", _export, "one JSON object per event (seq, time, request, conversation, kind, "
         "data)"),
        ("redrive", _redrive, "re-run the recorded requests (arrivals, cuts, stop strings, "
         "evictions, restarts) through today's code, each committing its recorded tokens, and "
         "report every plan, publication, refusal or outcome that differs; exit 1 if any does. "
         "SimModel unless --model names the journal's model. Needs a journal with token ids"),
    ]
    for name, command, text in specs:
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("path", help="the journal (SQLite file); never modified")
        p.add_argument("--json", action="store_true",
                       help="a JSON document instead of the table" if name != "export"
                       else "one JSON array instead of JSON lines")
        p.set_defaults(func=_run(command))
        if name == "show":
            which = p.add_mutually_exclusive_group(required=True)
            which.add_argument("--request", help="a request id")
            which.add_argument("--conversation", help="a conversation (session) key")
        if name == "redrive":
            p.add_argument("--model", default=None,
                           help="the model directory or .ninfer file the journal names (its "
                                "identity is checked); default: SimModel")
            p.add_argument("--kv-capacity", type=int, default=131_072,
                           help="KV positions of the redriven engine's pool (default 131072)")
        if name == "export":
            p.add_argument("--jsonl", action="store_true",
                           help="JSON lines, one event a line (the default)")
            p.add_argument("-o", "--output", default=None, help="write here instead of stdout")
    return journal


def main(argv: list[str] | None = None) -> int:
    """`ninfer journal ...` on its own (tests; the `ninfer` command wires the same parser)."""
    parser = argparse.ArgumentParser(prog="ninfer")
    add_journal_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
