"""The two long passes over a journal, `replay` and `check`, read as cheaply as they can.

A journal is mostly small events whose payload the fold never reads (commits, prefill
progress, state changes). Each pass asks SQLite for the payload of only the kinds it reads
(the rest come back as NULL, known by seq, kind and request), with token ids dropped in
SQLite before Python parses the JSON ("lean"):

- `replay_summary`: the store's fold decodes its kinds (FOLD_KINDS) and the summary the few
  whose fields it counts; every other event is a seq and a kind.
- `check`: `StoreChecks` over the store's kinds in this process, and `RequestChecks` over
  every request's events, read as `PayloadView`s of their JSON (every payload but a
  publication's is parsed and must be one JSON object), in a second process when the
  journal is large, so the two cores share the pass. The first problem is the one at the
  smaller seq.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sqlite3
import sys
from collections import Counter
from dataclasses import dataclass

from tqdm import tqdm

from ..lifecycle import events as ev
from ..lifecycle.checks import (
    STORE_KINDS,
    PayloadView,
    RequestChecks,
    StoreChecks,
)
from ..lifecycle.journal import JournalError
from ..lifecycle.store import FOLD_KINDS, ContinuationStore, InvariantViolation

# the consumers that judge invariants need no token ids: SQLite drops them before Python
# parses the JSON (prompt ids, checkpoint ids: most of a journal's bytes)
_LEAN_DROP = {"RequestQueued": "'$.tokens', NULL, '$.block_hashes', json('[]')",
              "EndpointPublished": "'$.endpoint.checkpoint.tokens', NULL",
              "CheckpointCaptured": "'$.checkpoint.tokens', NULL"}
# for the tools' row readers, a payload that is not JSON goes to Python as it is, which
# names the seq it is at; the passes below parse it once, unguarded, and on SQLite's
# "malformed JSON" look for the payload that stopped them (`_unreadable`)
LEAN_DATA = "CASE kind " + " ".join(
    f"WHEN '{k}' THEN CASE WHEN json_valid(data) THEN json_replace(data, {drop}) ELSE data END"
    for k, drop in _LEAN_DROP.items()) + " ELSE data END"
_LEAN = "CASE kind " + " ".join(
    f"WHEN '{k}' THEN json_replace(data, {drop})" for k, drop in _LEAN_DROP.items()
) + " ELSE data END"
PARALLEL_MIN = 20_000   # events: below this a second process costs more than it saves
_COLUMNS = "seq, time, request, conversation, kind, data"
PROGRESS_MIN = 100_000  # show a progress bar above this many events
_MASK = 4095            # every 4096 seqs: a progress update, a look at the other pass


def _quoted(kinds) -> str:
    return ", ".join(f"'{k}'" for k in sorted(kinds))


def _ENVELOPE_OF(kinds) -> str:  # noqa: N802 - builds SQL, like the constants it feeds
    """time, request, conversation: the time and conversation only of the events of `kinds`
    (the ones decoded), NULL for the others, which need not become Python objects."""
    decoded = f"kind IN ({_quoted(kinds)})"
    return f"CASE WHEN {decoded} THEN time END, request, CASE WHEN {decoded} THEN conversation END"


class UnreadableEvent(JournalError):
    """The event at `seq` cannot be read."""

    def __init__(self, message: str, seq: int) -> None:
        super().__init__(message)
        self.seq = seq


def _unreadable(src, e: sqlite3.Error, after: int) -> JournalError:
    """SQLite stopped a pass past seq `after`: at a payload that is not JSON, named, or
    for another reason, said."""
    try:
        bad = src.conn.execute("SELECT seq, kind FROM events WHERE seq > ? AND NOT "
                               "json_valid(data) ORDER BY seq LIMIT 1", (after,)).fetchone()
    except sqlite3.Error:
        bad = None
    if bad is None:
        return JournalError(f"journal {src.path}: reading events: {e}")
    return UnreadableEvent(f"journal {src.path}: undecodable {bad[1]!r} event at seq {bad[0]}: "
                           "payload is not JSON", bad[0])


@contextlib.contextmanager
def _reading(src, select: str, where: str = "", progress: bool = False):
    """A cursor over `select` of every event in seq order (iterated row by row: cheaper than
    batches) and a progress bar the reader updates every TICK rows."""
    total = src.count if progress else 0
    bar = tqdm(total=total, disable=total <= PROGRESS_MIN, file=sys.stderr, unit="ev",
               leave=False)
    try:
        yield src.conn.execute(f"SELECT {select} FROM events {where} ORDER BY seq"), bar
    finally:
        bar.close()


@contextlib.contextmanager
def _stopped(src, where):
    """SQLite's errors in a pass as JournalErrors; `where()`: the last seq it read."""
    try:
        yield
    except sqlite3.Error as e:
        raise _unreadable(src, e, where()) from e


def _decode(src, row: tuple) -> ev.Event:
    try:
        return ev.from_row(*row)
    except Exception as e:  # an unknown kind or a bad payload is the journal's fault
        raise JournalError(f"journal {src.path}: undecodable {row[4]!r} event at seq "
                           f"{row[0]}: {e}") from e


def _unknown(src, seq: int, kind: str) -> JournalError:
    return JournalError(f"journal {src.path}: undecodable {kind!r} event at seq {seq}: "
                        f"unknown event kind {kind!r}")


# --- replay ----------------------------------------------------------------------------------

_SUMMARISED = frozenset({"RequestCancelled", "RequestFailed", "PublicationRefused"})
# the others' payloads are checked to be JSON, by SQLite (1 or 0 in place of the payload)
_REPLAY_SELECT = (f"seq, {_ENVELOPE_OF({*FOLD_KINDS, *_SUMMARISED})}, kind, CASE WHEN kind IN "
                  f"({_quoted({*FOLD_KINDS, *_SUMMARISED})}) THEN {_LEAN} "
                  f"ELSE json_valid(data) END")


def replay_summary(src) -> dict:
    """One pass: the fold, and counts of what happened. InvariantViolation where the fold
    cannot go on (a gap in seq among them)."""
    outcomes, plans, published, refused, evicted, lost = (Counter() for _ in range(6))
    queued = 0
    store = ContinuationStore()
    known = ev.EVENT_TYPES
    seq = last = ticked = 0
    with _reading(src, _REPLAY_SELECT, progress=True) as (rows, bar), _stopped(src, lambda: seq):
        for row in rows:
            seq, kind, data = row[0], row[4], row[5]
            if not seq & _MASK:
                bar.update(seq - ticked)
                ticked = seq
            if seq != last + 1 and last:
                raise InvariantViolation(4, seq, f"seq gap after {last}", row[2])
            last = seq
            if type(data) is int:  # a kind the fold and the summary know by its name
                if kind not in known:
                    raise _unknown(src, seq, kind)
                if not data:
                    raise JournalError(f"journal {src.path}: undecodable {kind!r} event at "
                                       f"seq {seq}: payload is not JSON")
                if kind == "RequestQueued":
                    queued += 1
                elif kind == "RequestFinished":
                    outcomes["finished"] += 1
                continue
            e = _decode(src, row)
            store.apply(e)
            if kind == "StoreSnapshotted" and not queued and not outcomes:
                queued += len(e.requests)  # a rotated file: requests carried over, still open
            elif kind == "RequestCancelled":
                outcomes[f"cancelled({e.at_state})"] += 1
            elif kind == "RequestFailed":
                outcomes[f"failed({e.failure})"] += 1
            elif kind == "RequestStarted":
                plans[e.plan] += 1
            elif kind == "EndpointPublished":
                published[e.endpoint.kind] += 1
            elif kind == "PublicationRefused":
                refused[e.reason] += 1
            elif kind in ("EndpointEvicted", "EndpointLost"):
                (evicted if kind == "EndpointEvicted" else lost)[e.reason] += 1
    if last > store.applied_seq:
        store.advance(last)  # the events after the last one it folded
    outcomes["open"] = queued - sum(outcomes.values())
    held = Counter(s.facts.kind for s in store.endpoints.values())
    return {"events": src.count, "requests": queued, "outcomes": dict(outcomes),
            "plans": dict(plans), "published": dict(published), "refused": dict(refused),
            "evicted": dict(evicted), "lost": dict(lost),
            "store": {"endpoints": len(store.endpoints), "by_kind": dict(held),
                      "max_endpoints": store.max_endpoints, "applied_seq": store.applied_seq}}


# --- check -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckResult:
    """What `check` verified: `events` events up to `last_seq` (all of them when there was
    no problem), `requests` requests."""

    events: int
    requests: int
    last_seq: int


@dataclass(frozen=True, order=True)
class _Problem:
    seq: int
    stage: int           # at one seq: reading the event (0), the gap (1), the request's
    #                      checks (2), the store's (3): the order one checker meets them
    invariant: int       # 0: an unreadable event (JournalError)
    message: str
    request: str | None = None

    def error(self) -> InvariantViolation | JournalError:
        if self.invariant:
            return InvariantViolation(self.invariant, self.seq, self.message, self.request)
        return JournalError(self.message)

    @classmethod
    def of(cls, stage: int, e: InvariantViolation | JournalError, seq: int) -> _Problem:
        if isinstance(e, InvariantViolation):
            return cls(e.seq, stage, e.invariant, e.detail, e.request)
        return cls(getattr(e, "seq", seq), 0, 0, str(e))


# the store's kinds decoded (a request's queueing: its tenant alone), the others NULL
_STORE_SELECT = (f"seq, {_ENVELOPE_OF(STORE_KINDS)}, kind, CASE WHEN kind = 'RequestQueued' "
                 "THEN json_extract(data, '$.tenant') "
                 f"WHEN kind IN ({_quoted(STORE_KINDS - {'RequestQueued'})}) THEN {_LEAN} "
                 "END")
# every payload but a publication's (StoreChecks decodes those), by request
_REQUEST_SELECT = ("seq, request, kind, CASE WHEN kind = 'EndpointPublished' THEN NULL ELSE "
                   f"{_LEAN} END, CASE WHEN kind = 'RequestQueued' THEN conversation END")
_REQUEST_WHERE = "WHERE request IS NOT NULL OR kind = 'StoreSnapshotted'"


def _store_pass(src, stop, progress: bool) -> tuple[_Problem | None, StoreChecks]:
    """StoreChecks over every event; `stop()`: a seq past which nothing matters any more."""
    checks = StoreChecks()
    known, view = ev.EVENT_TYPES, PayloadView.of
    stage = seq = ticked = 0
    try:
        with _reading(src, _STORE_SELECT, progress=progress) as (rows, bar), \
                _stopped(src, lambda: seq):
            for row in rows:
                seq, request, kind, data = row[0], row[2], row[4], row[5]
                if not seq & _MASK:
                    bar.update(seq - ticked)
                    ticked = seq
                    if seq > stop():
                        break
                if data is None:  # a kind read by its name
                    if kind not in known:
                        raise _unknown(src, seq, kind)
                    stage = 1
                    checks.skip(seq, kind, request)
                    continue
                if kind == "RequestQueued":  # (a payload that is not JSON: RequestChecks')
                    e = view({"seq": seq, "request": request, "conversation": row[3],
                              "tenant": data})
                else:
                    e = _decode(src, row)
                    if kind == "StoreSnapshotted" and checks.last_seq == 0:
                        checks.resume(e)
                stage = 1
                checks.enter(seq, request)
                stage = 3
                if kind == "RequestQueued":
                    checks.queued(e)
                else:
                    checks.feed(e)
    except (InvariantViolation, JournalError) as v:
        return _Problem.of(stage, v, seq), checks
    return None, checks


def _request_pass(src, stop) -> tuple[_Problem | None, int]:
    """RequestChecks over every request's events; (first problem, requests seen)."""
    checks = RequestChecks()
    scan, new, View = ev._SCAN, object.__new__, PayloadView
    seq = 0
    try:
        with _reading(src, _REQUEST_SELECT, _REQUEST_WHERE) as (rows, _), \
                _stopped(src, lambda: seq):
            for seq, request, kind, data, conversation in rows:
                if not seq & _MASK and seq > stop():
                    break
                if kind == "StoreSnapshotted":
                    if not checks.requests:  # a rotated journal: carry on from its snapshot
                        row = src.conn.execute(f"SELECT {_COLUMNS} FROM events WHERE seq = ?",
                                               (seq,)).fetchone()
                        checks.resume(_decode(src, row))
                    continue
                if data is None:
                    p = {}
                else:
                    try:
                        p, end = scan(data, 0)
                    except (StopIteration, ValueError):
                        p, end = None, 0
                    if end != len(data) or type(p) is not dict:
                        raise JournalError(f"journal {src.path}: undecodable {kind!r} event "
                                           f"at seq {seq}: payload is not one JSON object")
                p["seq"], p["request"], p["conversation"] = seq, request, conversation
                view = new(View)
                view.__dict__ = p
                try:
                    checks.feed(view, kind)
                except (TypeError, AttributeError) as e:
                    why = f"payload lacks {e.name!r}" if isinstance(e, AttributeError) else e
                    raise JournalError(f"journal {src.path}: undecodable {kind!r} event at "
                                       f"seq {seq}: {why}") from e
    except (InvariantViolation, JournalError) as v:
        return _Problem.of(2, v, seq), len(checks.requests)
    return None, len(checks.requests)


def _request_child(path: str, limit, out) -> None:
    """The request pass in a second process, on its own read-only connection."""
    from .journal import Source  # the parent's connection is not shared across the fork
    try:
        result = _request_pass(Source(path), lambda: limit.value)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which re-raises
        result = (_Problem(0, 0, 0, f"journal {path}: request checks: {e}"), 0)
    out.send(result)
    out.close()


def check(src, parallel: bool | None = None
          ) -> tuple[CheckResult, InvariantViolation | JournalError | None]:
    """Every journal-checkable invariant; the first problem (a violation, or an event that
    cannot be read: what was verified before it stands) or None. `parallel`: the request
    checks in a second process (default: for journals of PARALLEL_MIN events or more)."""
    never = 1 << 62
    if parallel is None:
        parallel = src.count >= PARALLEL_MIN
    if parallel and "fork" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("fork")
        limit = ctx.Value("q", never, lock=False)
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_request_child, args=(src.path, limit, send), daemon=True)
        child.start()
        send.close()
        try:
            # the store pass stops early once the request pass has a problem before it
            polled = {"seq": never}

            def stop() -> int:
                if "result" not in polled and receive.poll():
                    polled["result"] = receive.recv()
                    first = polled["result"][0]
                    polled["seq"] = first.seq if first is not None else never
                return polled["seq"]
            store_problem, checks = _store_pass(src, stop, progress=True)
            if store_problem is not None:
                limit.value = store_problem.seq  # the request pass need not go past it
            if "result" not in polled:
                polled["result"] = receive.recv()
            request_problem, requests = polled["result"]
        except EOFError:
            raise JournalError(f"journal {src.path}: the request checks' process died "
                               f"(exit {child.exitcode})") from None
        finally:
            child.join(timeout=10)
    else:
        request_problem, requests = _request_pass(src, lambda: never)
        store_problem, checks = _store_pass(
            src, lambda: request_problem.seq if request_problem else never, progress=True)
    problems = [p for p in (store_problem, request_problem) if p is not None]
    if not problems:
        return CheckResult(checks.events, requests, checks.last_seq), None
    first = min(problems)
    if first.invariant == 0 and first.seq == 0:  # the other process failed outright
        raise JournalError(first.message)
    before = src.conn.execute("SELECT COUNT(*), MAX(seq) FROM events WHERE seq < ?",
                              (first.seq,)).fetchone()
    return CheckResult(before[0], requests, before[1] or 0), first.error()
