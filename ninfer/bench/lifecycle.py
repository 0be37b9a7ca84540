"""`ninfer bench lifecycle`: what the lifecycle core costs, each figure on a fresh file
journal in a temp dir (WAL, synchronous=NORMAL). A benchmark, not a test: targets are
printed beside the figures, a miss does not change the exit status (0).

The event mix is one request's life, 9 events: RequestQueued (64 token ids + block
hashes), RequestStarted, PrefillAdvanced, 4 TokensCommitted, EndpointPublished (a
CheckpointFacts with its 68 token ids), RequestFinished; 64 sessions take turns, so each
publication supersedes its session's previous endpoint and the store stays small.
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from ..lifecycle import events as ev
from ..lifecycle import salvage
from ..lifecycle.eventlog import EventLog
from ..lifecycle.facts import CheckpointFacts, EndpointFacts, Mode
from ..lifecycle.hashing import block_hashes, prefix_hash
from ..lifecycle.journal import Journal
from ..lifecycle.machine import admit, fire
from ..lifecycle.planner import Plan
from ..lifecycle.request import Request
from ..lifecycle.salvage import Candidate
from ..lifecycle.store import ContinuationStore
from .report import report

MODE = Mode("none", "sim", "int")
PROMPT = tuple(range(1000, 1064))
OUTPUTS = (7, 8, 9, 10)
SEQ = PROMPT + OUTPUTS
SEQ_HASHES = block_hashes(SEQ)
SEQ_PREFIX = prefix_hash(SEQ, len(SEQ), SEQ_HASHES)
PARAMS = {"max_tokens": 4, "stop_tokens": [], "temperature": 0.0}
SESSIONS = 64
STEP_EVENTS = 64       # events per transaction in figure 1: one engine step's group commit
STEP_REQUESTS = 8      # requests per flush in figure 4
BUILD_BATCH = 10_000   # events per transaction while building the replayed journal
TARGETS = {"journal_events_per_s": (">=", 100_000), "replay_events_per_s": (">=", 200_000),
           "request_us": ("<=", 200)}
_INSERT = "INSERT INTO events VALUES (?,?,?,?,?,?)"


def _checkpoint(cp_id: str) -> CheckpointFacts:
    n = len(SEQ)
    return CheckpointFacts(id=cp_id, position=n, block_hashes=SEQ_HASHES, prefix_hash=SEQ_PREFIX,
                           attn_kv=n, recurrent_at=n, mtp_kv=0, hidden_at=None, fenced=True,
                           model=MODE.model, dtypes=MODE.dtypes, tokens=SEQ)


def _request_events(i: int, seq: int, now: float) -> list[ev.Event]:
    """Request `i`'s 9 events, stamped from `seq` on (request -1: ServerStarted alone)."""
    if i < 0:
        return [ev.ServerStarted(seq=seq, time=now, mode=MODE, max_concurrency=8,
                                 max_endpoints=SESSIONS)]
    rid, session, n = f"r{i}", f"s{i % SESSIONS}", len(PROMPT)
    seqs = iter(range(seq, seq + 9))
    env = dict(request=rid, conversation=session, time=now)
    out = [ev.RequestQueued(seq=next(seqs), tenant="t", prompt_len=n,
                            block_hashes=SEQ_HASHES[:4], tokens=PROMPT, params=PARAMS, **env),
           ev.RequestStarted(seq=next(seqs), plan="Root", endpoint=None, reuse_base=0, target=n,
                             **env),
           ev.PrefillAdvanced(seq=next(seqs), cursor=n, **env)]
    out += [ev.TokensCommitted(seq=next(seqs), tokens=(t,), frontier=n + k + 1, **env)
            for k, t in enumerate(OUTPUTS)]
    endpoint = EndpointFacts(id=f"ep:{rid}", kind="private", tenant="t", session=session,
                             checkpoint=_checkpoint(rid))
    out += [ev.EndpointPublished(seq=next(seqs), endpoint=endpoint, **env),
            ev.RequestFinished(seq=next(seqs), prompt_tokens=n, completion_tokens=len(OUTPUTS),
                               cached_tokens=0, **env)]
    return out


def event_mix(n: int) -> list[ev.Event]:
    """ServerStarted, then requests' events: `n` events, seqs 1..n."""
    out, now, i = [], time.time(), -1
    while len(out) < n:
        out += _request_events(i, len(out) + 1, now)
        i += 1
    return out[:n]


def bench_journal(mix: list[ev.Event], tmp: Path) -> dict[str, float]:
    """Figure 1: `Journal.append` of STEP_EVENTS events per transaction (serialising each),
    against raw `executemany` of the same rows, pre-serialised, into the same schema."""
    batches = [mix[i:i + STEP_EVENTS] for i in range(0, len(mix), STEP_EVENTS)]
    with Journal.open(tmp / "journal.db") as journal:
        t0 = time.perf_counter()
        for batch in batches:
            journal.append(batch)
        journal_rate = len(mix) / (time.perf_counter() - t0)
    Journal.open(tmp / "raw.db").close()  # the same schema, indexes and triggers
    conn = sqlite3.connect(tmp / "raw.db", isolation_level=None)
    conn.executescript("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;")
    rows = [[ev.to_row(e) for e in batch] for batch in batches]
    t0 = time.perf_counter()
    for batch in rows:
        conn.execute("BEGIN")
        conn.executemany(_INSERT, batch)
        conn.execute("COMMIT")
    raw_rate = len(mix) / (time.perf_counter() - t0)
    conn.close()
    return {"journal_events_per_s": journal_rate, "raw_sqlite_events_per_s": raw_rate,
            "journal_raw_ratio": journal_rate / raw_rate}


def bench_fold(mix: list[ev.Event]) -> dict[str, float]:
    """Figure 2: `ContinuationStore.apply` over the mix, in memory, into a fresh store."""
    store = ContinuationStore()
    t0 = time.perf_counter()
    for e in mix:
        store.apply(e)
    return {"fold_events_per_s": len(mix) / (time.perf_counter() - t0)}


def build_journal(path: Path, events: int) -> int:
    """A journal of `events` events of the mix at `path` (BUILD_BATCH per transaction), with
    a progress bar; returns how many it holds."""
    now, i = time.time(), -1
    with Journal.open(path) as journal, tqdm(total=events, unit="ev", unit_scale=True,
                                             desc="building journal", file=sys.stderr,
                                             leave=False) as bar:
        batch: list[ev.Event] = []
        while journal.last_seq < events:
            batch += _request_events(i, journal.last_seq + len(batch) + 1, now)
            i += 1
            if len(batch) >= BUILD_BATCH or journal.last_seq + len(batch) >= events:
                before = journal.last_seq
                journal.append(batch[:events - journal.last_seq])
                bar.update(journal.last_seq - before)
                batch = []
        return journal.last_seq


def bench_replay(events: int, tmp: Path) -> dict[str, float]:
    """Figure 3: build a journal of `events` events, reopen it, and time a restart's
    replay: `ContinuationStore.from_journal` (the fold reads only the kinds it folds),
    reported per journal event. Also every event decoded, as a second row."""
    path = tmp / "replay.db"
    built = build_journal(path, events)
    with Journal.open(path) as journal:
        t0 = time.perf_counter()
        store = ContinuationStore.from_journal(journal)
        rate = built / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        decoded = sum(1 for _ in journal.read())
        decode_rate = decoded / (time.perf_counter() - t0)
    assert store.endpoints and decoded == built
    return {"replay_events": built, "replay_events_per_s": rate,
            "decode_events_per_s": decode_rate}


def bench_requests(requests: int, tmp: Path) -> dict[str, float]:
    """Figure 4: µs per request, admit → start → prefilled → 4 TokensCommitted → stop →
    finish (publishing its frontier) by the shared machine, 11 events, through an EventLog
    (stamp, fold, queue) on a file journal flushed every STEP_REQUESTS requests (a step)."""
    root = Plan("Root", None, 0)
    with Journal.open(tmp / "requests.db") as journal:
        log = EventLog(ContinuationStore(), journal)
        log.emit(ev.ServerStarted, mode=MODE, max_concurrency=8, max_endpoints=SESSIONS)
        log.flush()
        t0 = time.perf_counter()  # from here: Request, machine, emit (+ fold), flush
        for i in range(requests):
            r = Request(id=f"r{i}", prompt=PROMPT, session=f"s{i % SESSIONS}", tenant="t",
                        log=log, mode=MODE)
            admit(r)
            r.plan = root
            fire(r, "start")
            r.cursor = len(PROMPT)
            r.emit(ev.PrefillAdvanced, cursor=r.cursor)
            fire(r, "prefilled", first_token=OUTPUTS[0])
            for t in OUTPUTS:
                r.outputs.append(t)
                r.cursor += 1
                r.emit(ev.TokensCommitted, tokens=(t,), frontier=r.cursor)
            r.stop_reason = "max_tokens"
            fire(r, "stop")
            decision = salvage.decide([Candidate("frontier", _checkpoint(r.id))], MODE,
                                      r.tenant, r.session)
            fire(r, "finish", salvage=decision)
            if i % STEP_REQUESTS == STEP_REQUESTS - 1:
                log.flush()
        log.flush()
        seconds = time.perf_counter() - t0
    return {"request_us": seconds / max(requests, 1) * 1e6}


def bench_engine(requests: int, tmp: Path) -> dict[str, float]:
    """Optional row: requests/s through a full SimModel engine (planning, pools, the
    SimModel's integer "forward"), 8 lanes, 4 output tokens each, on a file journal."""
    from ..engine.engine import EngineConfig, Submit, make_sim_engine, run_until_idle
    from ..lifecycle.request import SamplingParams
    with Journal.open(tmp / "engine.db") as journal:
        engine = make_sim_engine(EngineConfig(max_concurrency=8, prefill_chunk=64,
                                              max_endpoints=SESSIONS),
                                 num_blocks=2048, num_slots=SESSIONS + 16, journal=journal)
        params = SamplingParams(max_tokens=len(OUTPUTS))
        t0 = time.perf_counter()
        for i in range(requests):
            prompt = tuple((i + k) % engine.model.vocab_size for k in range(len(PROMPT)))
            engine.submit(Submit(f"r{i}", prompt, f"s{i % SESSIONS}", "t", params))
        run_until_idle(engine)
        return {"engine_requests_per_s": requests / (time.perf_counter() - t0)}


ROWS = [  # (result key, label, unit, format)
    ("journal_events_per_s", f"journal: Journal.append, {STEP_EVENTS}/tx", "events/s", ",.0f"),
    ("raw_sqlite_events_per_s", "  raw sqlite executemany, same rows", "events/s", ",.0f"),
    ("journal_raw_ratio", "  journal / raw", "", ".2f"),
    ("fold_events_per_s", "fold: ContinuationStore.apply", "events/s", ",.0f"),
    ("replay_events_per_s", "replay: store from the journal", "events/s", ",.0f"),
    ("decode_events_per_s", "  every event read and decoded", "events/s", ",.0f"),
    ("request_us", "lifecycle + journal per request", "µs", ",.1f"),
    ("engine_requests_per_s", "  full SimModel engine", "requests/s", ",.0f"),
]


def main(events: int = 1_000_000, requests: int = 20_000, json_path: str | None = None) -> int:
    """Run every figure, print the table and one line of JSON (also to `json_path`)."""
    if events < 1 or requests < 1:
        print("bench lifecycle: --events and --requests must be at least 1", file=sys.stderr)
        return 2
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="ninfer-bench-") as tmp:
        mix = event_mix(min(events, 200_000))
        results |= bench_journal(mix, Path(tmp))
        results |= bench_fold(mix)
        del mix
        results |= bench_replay(events, Path(tmp))
        results |= bench_requests(requests, Path(tmp))
        results |= bench_engine(min(requests, 2_000), Path(tmp))
    report("lifecycle", results, ROWS, TARGETS, json_path,
           note=f"(replayed journal: {results['replay_events']:,} events)")
    return 0
