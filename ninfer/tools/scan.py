"""The two long passes over a journal, `replay` and `check`, read as cheaply as they can.

A journal is mostly small events whose payload the fold never reads (commits, prefill
progress, state changes). Each pass asks SQLite for the payload of only the kinds it reads
(the rest come back as NULL, known by seq, kind and request), with token ids dropped in
SQLite before Python parses the JSON ("lean"):

- `replay_summary`: the store's fold decodes its kinds (FOLD_KINDS) and the summary the few
  whose fields it counts, rows of those kinds only; the counts of the others, unknown kinds,
  payloads that are not JSON and gaps come from one SQLite scan on a thread beside it.
- `check`: `StoreChecks` over the store's kinds and those that free a lane, in this process,
  and `RequestChecks` over every event (where gaps and unknown kinds are found too), in a
  second process when the journal is large, so the two cores share the work. The request
  pass reads the most common kinds as the one or two values their checks take, which SQLite
  extracts; other payloads are parsed as `PayloadView`s and must be one JSON object. The
  first problem is the one at the smaller seq.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import sqlite3
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tqdm import tqdm
from tqdm._monitor import TMonitor

from ..lifecycle import events as ev
from ..lifecycle.checks import (
    LEAVING_KINDS,
    STORE_KINDS,
    PayloadView,
    RequestChecks,
    StoreChecks,
)
from ..lifecycle.journal import JournalError
from ..lifecycle.reader import COLUMNS, LEAN_DROP, NOT_JSON, JournalReader, UnreadableEvent
from ..lifecycle.store import FOLD_KINDS, ContinuationStore, InvariantViolation

# the consumers that judge invariants need no token ids: SQLite drops them before Python
# parses the JSON. Unlike the reader's lean payload (LEAN_DATA) this one is unguarded: the
# passes parse each payload once, and on SQLite's "malformed JSON" ask the reader for the
# payload that stopped them (`JournalReader.failure`)
_LEAN = "CASE kind " + " ".join(
    f"WHEN '{k}' THEN json_replace(data, {drop})" for k, drop in LEAN_DROP.items()
) + " ELSE data END"
PARALLEL_MIN = 20_000   # events: below this a second process costs more than it saves
PROGRESS_MIN = 100_000  # show a progress bar above this many events
_MASK = 4095            # every 4096 seqs: a progress update, a look at the other pass


def _quoted(kinds) -> str:
    return ", ".join(f"'{k}'" for k in sorted(kinds))


def _ENVELOPE_OF(kinds) -> str:  # noqa: N802 - builds SQL, like the constants it feeds
    """time, request, conversation: the time and conversation only of the events of `kinds`
    (the ones decoded), NULL for the others, which need not become Python objects."""
    decoded = f"kind IN ({_quoted(kinds)})"
    return f"CASE WHEN {decoded} THEN time END, request, CASE WHEN {decoded} THEN conversation END"


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


_NO_BAR = _NoBar()
tqdm.monitor_interval = 0  # see `_reading`


def _forkable() -> bool:
    """Whether this process may fork: no thread but this one runs (a fork copies the locks
    other threads hold, never their release), tqdm's monitor aside, which holds none long."""
    return all(t is threading.main_thread() or isinstance(t, TMonitor)
               for t in threading.enumerate())


@contextlib.contextmanager
def _reading(src: JournalReader, select: str, where: str = "", total: int = 0):
    """A cursor over `select` of every event in seq order (iterated row by row: cheaper than
    batches) and a progress bar of `total` events the reader updates every TICK rows."""
    # no bar at all when hidden (a forked pass must not touch tqdm's lock), and none with a
    # monitor thread (a thread alive would keep `check` from forking)
    bar = tqdm(total=total, file=sys.stderr, unit="ev", leave=False, mininterval=0.5) \
        if total > PROGRESS_MIN else _NO_BAR
    try:
        yield src.query(f"SELECT {select} FROM events {where} ORDER BY seq"), bar
    finally:
        bar.close()


@contextlib.contextmanager
def _collector_off():
    """Python's cycle collector paused for a pass: a pass builds millions of short-lived
    objects and no cycles, and each collection would walk the whole heap (in a forked
    child, copying every page it touches)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _stopped(src: JournalReader, where: Callable[[], int]) -> Iterator[None]:
    """SQLite's errors in a pass as JournalErrors; `where()`: the last seq it read."""
    try:
        yield
    except sqlite3.Error as e:
        raise src.failure(e, where()) from e


# --- replay ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Overview:
    """What SQLite alone tells of a journal, in one scan: how many events, events per kind,
    the first event of an unknown kind, the first payload that is not JSON among the kinds a
    pass does not decode itself, the first gap in seq (the seq after it, and the seq before
    it)."""

    events: int
    counts: dict[str, int]
    first_seq: int
    unknown: tuple[int, str] | None
    not_json: tuple[int, str] | None
    gap: tuple[int, int] | None

    def problems(self, path: str) -> list[tuple[int, int, Exception]]:
        """(seq, order at that seq, the error) of each: the gap before reading the event."""
        out: list[tuple[int, int, Exception]] = []
        if self.gap is not None:
            out.append((self.gap[0], 0, InvariantViolation(
                4, self.gap[0], f"seq gap after {self.gap[1]}")))
        if self.unknown is not None:
            out.append((self.unknown[0], 1, UnreadableEvent.unknown_kind(path, *self.unknown)))
        if self.not_json is not None:
            out.append((self.not_json[0], 1, UnreadableEvent(path, *self.not_json, NOT_JSON)))
        return out


def overview(src: JournalReader, decoded, counted=()) -> Overview:
    """The Overview, in one scan without sorting, on a connection of its own. `decoded`: the
    kinds whose payloads the caller parses itself; `counted`: the kinds to count. Run on a
    thread of its own (SQLite works without Python's lock while it scans) beside a pass."""
    with src.reopen() as own:
        counts = "".join(f", sum(kind = '{k}')" for k in counted)
        row = own.query(
            "SELECT count(*), min(seq), max(seq), min(CASE WHEN kind NOT IN "
            f"({_quoted(ev.EVENT_TYPES)}) THEN seq END), min(CASE WHEN kind NOT IN "
            f"({_quoted(decoded)}) AND NOT json_valid(data) THEN seq END){counts} "
            "FROM events").fetchone()
        n, lo, hi, unknown, not_json = row[:5]

        def named(seq: int | None) -> tuple[int, str] | None:
            return None if seq is None else (seq, own.query(
                "SELECT kind FROM events WHERE seq = ?", (seq,)).fetchone()[0])
        gap = None
        if n and hi - lo + 1 != n:
            missing = own.query(
                "SELECT e.seq + 1 FROM events e WHERE e.seq < ? AND NOT EXISTS (SELECT 1 "
                "FROM events f WHERE f.seq = e.seq + 1) ORDER BY e.seq LIMIT 1",
                (hi,)).fetchone()[0]
            after = own.query("SELECT min(seq) FROM events WHERE seq > ?",
                              (missing,)).fetchone()[0]
            gap = (after, missing - 1)
        return Overview(n, dict(zip(counted, (c or 0 for c in row[5:]), strict=True)),
                        lo or 0, named(unknown), named(not_json), gap)


class _Beside(threading.Thread):
    """`fn()` on a thread; `result()` its value or its exception."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


_SUMMARISED = frozenset({"RequestCancelled", "RequestFailed", "PublicationRefused"})
_REPLAYED = frozenset({*FOLD_KINDS, *_SUMMARISED})
_REPLAY_SELECT = f"seq, time, request, conversation, kind, {_LEAN}"
_REPLAY_WHERE = f"WHERE kind IN ({_quoted(_REPLAYED)})"


@_collector_off()
def replay_summary(src: JournalReader) -> dict:
    """The fold over the kinds it reads, and counts of what happened; the counts of the
    others, unknown kinds, payloads that are not JSON and gaps in seq come from SQLite,
    scanning beside it. InvariantViolation or JournalError at the first problem, where the
    fold cannot go on."""
    outcomes, plans, published, refused, evicted, lost = (Counter() for _ in range(6))
    store = ContinuationStore()
    beside = _Beside(lambda: overview(src, _REPLAYED, ("RequestQueued", "RequestFinished")))
    seq = ticked = 0
    carried = (0, 0)
    stopped: tuple[int, int, Exception] | None = None
    try:
        with _reading(src, _REPLAY_SELECT, _REPLAY_WHERE, src.count()) as (rows, bar), \
                _stopped(src, lambda: seq):
            for row in rows:
                seq, kind = row[0], row[4]
                if seq - ticked > _MASK:
                    bar.update(seq - ticked)
                    ticked = seq
                e = src.decode(row)
                if kind == "StoreSnapshotted" and store.applied_seq == 0:
                    carried = (seq, len(e.requests))
                store.apply(e)
                if kind == "RequestCancelled":
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
    except (InvariantViolation, UnreadableEvent) as v:
        stopped = (v.seq, 1, v)
    except JournalError as v:  # not at one event: SQLite stopped the pass after `seq`
        stopped = (seq, 1, v)
    seen = beside.result()
    problems = seen.problems(src.path) + ([stopped] if stopped else [])
    if problems:
        raise min(problems, key=lambda p: p[:2])[2]
    last = seen.first_seq + seen.events - 1
    if last > store.applied_seq:
        store.advance(last)  # the events after the last one it folded
    queued = seen.counts.get("RequestQueued", 0)
    if carried[0] == seen.first_seq:  # a rotated file: requests carried over, still open
        queued += carried[1]
    outcomes["finished"] += seen.counts.get("RequestFinished", 0)
    outcomes = +outcomes
    outcomes["open"] = queued - sum(outcomes.values())
    held = Counter(s.facts.kind for s in store.endpoints.values())
    return {"events": seen.events, "requests": queued, "outcomes": dict(outcomes),
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
        """The problem `e` met at `seq` (an unreadable event names its own)."""
        if isinstance(e, InvariantViolation):
            return cls(e.seq, stage, e.invariant, e.detail, e.request)
        return cls(e.seq if isinstance(e, UnreadableEvent) else seq, 0, 0, str(e))


# the store's kinds decoded (a request's queueing: its tenant alone), the others NULL
_STORE_SELECT = (f"seq, {_ENVELOPE_OF(STORE_KINDS)}, kind, CASE WHEN kind = 'RequestQueued' "
                 "THEN json_extract(data, '$.tenant') "
                 f"WHEN kind IN ({_quoted(STORE_KINDS - {'RequestQueued'})}) THEN {_LEAN} "
                 "END")
# The request pass reads every event; its most common kinds come as the one or two values
# their checks read, extracted by SQLite (x, y; payload NULL), and an x or y of NULL (a field
# missing, a payload that is not an object) sends the event the long way, as a parsed
# payload; a publication's payload is StoreChecks' alone (NULL here)
_COMMIT_COUNT = ("CASE json_type(data, '$.tokens') WHEN 'array' THEN json_array_length(data, "
                 "'$.tokens') WHEN 'null' THEN coalesce(json_extract(data, '$.count'), 0) END")
_EXTRACTED = {  # kind: (x, y)
    "TokensCommitted": ("json_extract(data, '$.frontier')", _COMMIT_COUNT),
    "RequestQueued": ("json_extract(data, '$.prompt_len')", "json_extract(data, '$.tenant')"),
    "RequestStarted": ("json_extract(data, '$.reuse_base')", "1"),
    "PrefillAdvanced": ("json_extract(data, '$.cursor')", "1"),
    "RequestFinished": ("json_extract(data, '$.cached_tokens')", "1"),
}
_REQUEST_SELECT = (
    f"seq, request, kind, CASE WHEN kind IN ({_quoted({*_EXTRACTED, 'EndpointPublished'})}) "
    f"THEN NULL ELSE {_LEAN} END, CASE WHEN kind = 'RequestQueued' THEN conversation END, "
    + ", ".join("CASE kind " + " ".join(f"WHEN '{k}' THEN {xy[i]}" for k, xy in
                                        _EXTRACTED.items()) + " END" for i in (0, 1)))
# the store pass reads its kinds and those that free a lane; gaps and unknown kinds are the
# request pass's to find
_STORE_WHERE = f"WHERE kind IN ({_quoted(STORE_KINDS | LEAVING_KINDS)})"


def _first(src: JournalReader) -> tuple[int, str]:
    """The seq and kind of the journal's first event ((0, "") in an empty one)."""
    with src.errors("reading events"):
        row = src.query("SELECT seq, kind FROM events ORDER BY seq LIMIT 1").fetchone()
    return row or (0, "")


def _store_pass(src: JournalReader, stop, total: int) -> tuple[_Problem | None, StoreChecks]:
    """StoreChecks over the store's kinds and those that free a lane (gaps are the request
    pass's to find); `stop()`: a seq past which nothing matters any more; `total`: events,
    for the progress bar."""
    checks = StoreChecks(contiguous=False)
    first = _first(src)[0]
    view = PayloadView.of
    stage = seq = ticked = 0
    try:
        with _reading(src, _STORE_SELECT, _STORE_WHERE, total) as (rows, bar), \
                _stopped(src, lambda: seq):
            for row in rows:
                seq, request, kind, data = row[0], row[2], row[4], row[5]
                if seq - ticked > _MASK:
                    bar.update(seq - ticked)
                    ticked = seq
                    if seq > stop():
                        break
                if data is None:  # a kind read by its name
                    stage = 1
                    checks.skip(seq, kind, request)
                    continue
                if kind == "RequestQueued":  # (a payload that is not JSON: RequestChecks')
                    e = view({"seq": seq, "request": request, "conversation": row[3],
                              "tenant": data})
                else:
                    e = src.decode(row)
                    if kind == "StoreSnapshotted" and seq == first:
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


def _request_pass(src: JournalReader, stop) -> tuple[_Problem | None, int]:
    """RequestChecks over every request's events, and over every event the things only a
    whole scan finds: a gap in seq (invariant 4) and a kind no one knows. (The first
    problem, requests seen.)"""
    checks = RequestChecks()
    scan, new, View, known = ev._SCAN, object.__new__, PayloadView, ev.EVENT_TYPES
    open_, commit, started = checks.open, checks.commit, checks.started
    advanced, finished = checks.advanced, checks.finished
    seq = last = 0
    try:
        with _reading(src, _REQUEST_SELECT) as (rows, _), _stopped(src, lambda: seq):
            for seq, request, kind, data, conversation, x, y in rows:
                if kind not in known:
                    raise UnreadableEvent.unknown_kind(src.path, seq, kind)
                if seq != last + 1 and (last or kind != "StoreSnapshotted"):
                    # (only a rotated file, opening with its snapshot, starts later)
                    return _Problem(seq, 1, 4, f"seq gap or repeat after {last}"), \
                        len(checks.requests)
                if not last and kind == "StoreSnapshotted":  # carry on from what it says
                    row = src.query(f"SELECT {COLUMNS} FROM events WHERE seq = ?",
                                    (seq,)).fetchone()
                    checks.resume(src.decode(row))
                last = seq
                if not seq & _MASK and seq > stop():
                    break
                if request is None:
                    continue
                if y is not None and x is not None:  # the values SQLite extracted
                    try:
                        if kind == "TokensCommitted":
                            commit(open_(kind, seq, request), seq, request, x, y)
                        elif kind == "RequestQueued":
                            checks.queued(seq, request, y, conversation, x)
                        elif kind == "PrefillAdvanced":
                            advanced(open_(kind, seq, request), seq, request, x)
                        elif kind == "RequestStarted":
                            started(open_(kind, seq, request), seq, request, x)
                        else:
                            finished(open_(kind, seq, request), seq, request, x)
                    except TypeError as e:
                        raise UnreadableEvent(src.path, seq, kind, e) from e
                    continue
                if kind in _EXTRACTED:  # the long way: its payload (the whole of it)
                    data = src.query("SELECT data FROM events WHERE seq = ?",
                                     (seq,)).fetchone()[0]
                if data is None:
                    p = {}
                else:
                    try:
                        p, end = scan(data, 0)
                    except (StopIteration, ValueError):
                        p, end = None, 0
                    if end != len(data) or type(p) is not dict:
                        raise UnreadableEvent(src.path, seq, kind,
                                              "payload is not one JSON object")
                p["seq"], p["request"], p["conversation"] = seq, request, conversation
                view = new(View)
                view.__dict__ = p
                try:
                    checks.feed(view, kind)
                except (TypeError, AttributeError) as e:
                    why = f"payload lacks {e.name!r}" if isinstance(e, AttributeError) else e
                    raise UnreadableEvent(src.path, seq, kind, why) from e
    except (InvariantViolation, JournalError) as v:
        return _Problem.of(2, v, seq), len(checks.requests)
    return None, len(checks.requests)


def _request_child(src: JournalReader, limit, out) -> None:
    """The request checks in a process of their own, on their own connection (the parent's
    is not shared across the fork)."""
    try:
        with src.reopen() as own:
            result = _request_pass(own, lambda: limit.value)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which re-raises
        result = (_Problem(0, 0, 0, f"journal {src.path}: request checks: {e}"), 0)
    out.send(result)
    out.close()


class _RequestProcess:
    """The request checks in a second process, so that they and the store pass (here) keep
    both cores busy. `stop()`: the seq at which they found a problem, once they have (the
    store pass need not read past it)."""

    never = 1 << 62

    def __init__(self, src: JournalReader) -> None:
        ctx = multiprocessing.get_context("fork")
        self.limit = ctx.Value("q", self.never, lock=False)
        self.pipe, send = ctx.Pipe(duplex=False)
        self.child = ctx.Process(target=_request_child, args=(src, self.limit, send),
                                 daemon=True)
        self.child.start()
        send.close()
        self.result: tuple[_Problem | None, int] | None = None

    def _take(self) -> tuple[_Problem | None, int]:
        if self.result is None:
            try:
                self.result = self.pipe.recv()
            except EOFError:
                raise JournalError(f"the request checks' process died (exit "
                                   f"{self.child.exitcode})") from None
        return self.result

    def stop(self) -> int:
        if self.result is None and not self.pipe.poll():
            return self.never
        problem = self._take()[0]
        return self.never if problem is None else problem.seq

    def collect(self, store_problem: _Problem | None) -> tuple[_Problem | None, int]:
        """Their first problem and the requests they saw (after telling them where the store
        pass stopped: they need not go past it)."""
        if store_problem is not None:
            self.limit.value = store_problem.seq
        try:
            return self._take()
        finally:
            self.child.join(timeout=10)


@_collector_off()
def check(src: JournalReader, parallel: bool | None = None
          ) -> tuple[CheckResult, InvariantViolation | JournalError | None]:
    """Every journal-checkable invariant; the first problem (a violation, or an event that
    cannot be read: what was verified before it stands) or None. `parallel`: the request
    checks in a second process (default: for journals of PARALLEL_MIN events or more,
    where fork is safe)."""
    never = _RequestProcess.never
    count = src.count()
    if parallel is None:  # (a fork beside other threads could copy a lock one of them holds)
        parallel = count >= PARALLEL_MIN and _forkable()
    if parallel and "fork" in multiprocessing.get_all_start_methods():
        other = _RequestProcess(src)
        store_problem, checks = _store_pass(src, other.stop, count)
        try:
            request_problem, requests = other.collect(store_problem)
        except JournalError as e:
            raise JournalError(f"journal {src.path}: {e}") from None
    else:
        request_problem, requests = _request_pass(src, lambda: never)
        store_problem, checks = _store_pass(
            src, lambda: request_problem.seq if request_problem else never, count)
    problems = [p for p in (store_problem, request_problem) if p is not None]
    if not problems:
        return CheckResult(count, requests, _first(src)[0] + count - 1), None
    first = min(problems)
    if first.invariant == 0 and first.seq == 0:  # the other process failed outright
        raise JournalError(first.message)
    with src.errors("counting events"):
        before = src.query("SELECT COUNT(*), MAX(seq) FROM events WHERE seq < ?",
                           (first.seq,)).fetchone()
    return CheckResult(before[0], requests, before[1] or 0), first.error()
