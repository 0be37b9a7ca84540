"""The deterministic simulation: the whole serving loop under seeded faults.

One `random.Random(seed)` drives everything: the scenario (options, pools, fault rates),
the clients, the faults. The simulator plays the engine thread's loop (step when there is
work; when idle, wait on the virtual clock for the next client) and the HTTP clients. Every
invariant is checked after every step (`Harness.check`: conservation, the replayed store
against the live one, outputs against a Root run, the spec predicate on stored endpoints;
`JournalChecker` sees every event as it is emitted). A drain at the end runs everything to
its end and empties the store: the pools must come back full. The same seed and steps give
the same journal rows, byte for byte; `Summary.journal_sha256` is their hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..lifecycle.checks import JournalChecker
from ..lifecycle.eventlog import EventLog
from ..lifecycle.journal import Journal
from ..lifecycle.reader import JournalReader
from ..tools.scan import check
from .clients import Clients
from .clock import VirtualClock
from .faults import Strike, boot_without_commit, reopen_after_crash, step_without_commit
from .harness import Harness
from .scenario import STEP_SECONDS, Scenario, restart_options

DRAIN_STEPS = 5_000   # more than this to run everything to its end is a livelock


@dataclass(frozen=True)
class Summary:
    seed: int
    steps: int
    drain_steps: int
    scenario: str
    requests: dict[str, int]      # by outcome, from the journal
    faults: dict[str, int]        # injected, by kind
    observed: dict[str, int]      # what the faults caused, from the journal
    events: int
    journal_sha256: str
    virtual_seconds: float
    wall_seconds: float = field(compare=False)

    def format(self) -> str:
        def counts(d: dict) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"
        rate = (self.steps + self.drain_steps) / max(self.wall_seconds, 1e-9)
        return "\n".join([
            f"seed {self.seed}: {self.steps} steps + {self.drain_steps} to drain, "
            f"{self.virtual_seconds:.1f} virtual s in {self.wall_seconds:.2f} s "
            f"({rate:.0f} steps/s)",
            f"engine: {self.scenario}",
            f"requests: {sum(self.requests.values())}: {counts(self.requests)}",
            f"faults: {counts(self.faults)}",
            f"observed: {counts(self.observed)}",
            f"events: {self.events}",
            f"journal sha256: {self.journal_sha256}"])


class SimulationFailed(Exception):
    """An invariant broke (or the engine raised): `cause`, at `step`, journal at `journal`."""

    def __init__(self, seed: int, steps: int, step: int, journal: Path,
                 cause: BaseException) -> None:
        self.seed, self.steps, self.step, self.journal, self.cause = (
            seed, steps, step, journal, cause)
        super().__init__(f"seed {seed}, step {step} of {steps}: "
                         f"{type(cause).__name__}: {cause}")


class Simulation:
    def __init__(self, seed: int, steps: int, workdir: Path, *, oracle: bool = True,
                 failures: Path | None = None) -> None:
        """`workdir` holds the journal (`sim-<seed>.db`); a failure copies it into
        `failures` (when given). `oracle` False leaves out the spec-predicate check on
        stored endpoints (only behaviour can then reveal a bug)."""
        self.seed, self.steps, self.failures = seed, steps, failures
        self.rng = random.Random(seed)
        self.scenario = s = Scenario.draw(self.rng)
        self.clock = VirtualClock()
        self.path = Path(workdir) / f"sim-{seed}.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        self.journal = _small_wal(Journal.open(self.path))
        self.faults: Counter = Counter()
        self.unjournaled: Counter = Counter()
        self.step = 0
        self.drained = 0
        self.h = Harness(s.config, num_blocks=s.num_blocks, block_size=s.block_size,
                         num_slots=s.num_slots, seed=seed, journal=self.journal,
                         oracle=oracle, clock=self.clock)
        self.clients = Clients(self.rng, self.clock, self.h, s, self.faults)
        self.clients.attach(self.h.engine)

    def run(self) -> Summary:
        """Run the steps, drain, check; SimulationFailed (journal saved) on any failure."""
        started = time.perf_counter()
        try:
            while self.step < self.steps:
                self._tick()
            self._drain()
            self._check_journal_file()
        except Exception as exc:
            self._save_pending()
            saved = self.path if self.failures is None else \
                self.save_journal(Path(self.failures) / self.path.name, exc)
            raise SimulationFailed(self.seed, self.steps, self.step, saved, exc) from exc
        return self._summary(time.perf_counter() - started)

    def close(self) -> None:
        self.journal.close()

    # --- the loop ---------------------------------------------------------------------

    def _tick(self) -> None:
        self.clients.act()
        engine = self.h.engine
        if engine.idle():  # the engine thread waits for work; so does virtual time
            self.clock.jump_to(self.clients.next_wake())
            return
        strike = Strike.draw(self.rng, self.scenario.rates)
        if strike.evict and engine.store.endpoints:  # an operator, between two steps
            self.faults["evict"] += 1
            engine.evict(self.rng.choice(sorted(engine.store.endpoints)))
        if strike.restart:
            self.faults["restart"] += 1
            self.journal.close()
            self._boot(_small_wal(Journal.open(self.path)), strike.keep_tensors,
                       restart_options(self.rng, self.h.config))
        self.step += 1
        if strike.crash:
            self.faults["crash_keep_tensors" if strike.keep_tensors else "crash_lose_tensors"] += 1
            lost = step_without_commit(self.h.engine)
            # streamed to their clients (the server streams as events are emitted), then
            # lost with the commit: recovery fails them as interrupted
            self.unjournaled["finished_but_never_journaled"] += sum(
                e.kind == "RequestFinished" for e in lost)
            journal = _small_wal(reopen_after_crash(self.journal))
            if strike.crash_again:
                self.faults["crash_in_recovery"] += 1
                self.h.checker = JournalChecker().feed_all(journal.read())
                boot_without_commit(lambda: self.h.restart(
                    keep_tensors=strike.keep_tensors, journal=journal))
                journal = _small_wal(reopen_after_crash(journal))
            self.h.checker = JournalChecker().feed_all(journal.read())  # committed only
            self._boot(journal, strike.keep_tensors, {})
        else:
            self.h.engine.step()
        if strike.slow:
            self.faults["slow_step"] += 1
        self.clock.advance(strike.slow or STEP_SECONDS)
        self.h.check()

    def _boot(self, journal: Journal, keep_tensors: bool, options: dict) -> None:
        """A new server process on the same journal file (recovery runs as it boots)."""
        self.journal = journal
        self.h.restart(keep_tensors=keep_tensors, journal=journal, **options)
        self.clients.interrupted()
        self.clients.attach(self.h.engine)

    def _drain(self) -> None:
        """Everything submitted ends (no livelock), then an empty store gives full pools."""
        self.clients.stop()
        while not (self.h.engine.idle() and self.clients.settled()):
            if self.drained >= DRAIN_STEPS:
                raise AssertionError(f"livelock: work left after {DRAIN_STEPS} drain steps")
            self.clients.act()
            if self.h.engine.idle():
                self.clock.jump_to(self.clients.next_wake() or self.clock())
                continue
            self.h.engine.step()
            self.drained += 1
            self.clock.advance(STEP_SECONDS)
            self.h.check()
        open_requests = [rid for rid, r in self.h.checker.requests.items() if not r.ended_at]
        assert not open_requests, f"requests never ended: {open_requests[:8]}"
        engine = self.h.engine
        for endpoint in list(engine.store.endpoints):
            engine.evict(endpoint)
        self.h.check()
        assert engine.blocks.free == engine.blocks.num_blocks, "KV blocks leaked"
        assert engine.slots.free == engine.slots.num_slots, "state slots leaked"

    def _check_journal_file(self) -> None:
        """The file alone, as `ninfer journal check` reads it, holds every J invariant."""
        with JournalReader.open(self.path) as source:
            _, violation = check(source)
        if violation is not None:
            raise violation

    # --- results ------------------------------------------------------------------------

    def _save_pending(self) -> None:
        """Journal the events of the step a failure cut short (the violating one among
        them), so that the file shows what the checks saw."""
        try:
            EventLog.flush(self.h.engine.log)  # the class's: a crash replaced the instance's
        except Exception:  # the journal may be what failed: keep what it has
            pass

    def save_journal(self, dest: Path, cause: BaseException) -> Path:
        """A standalone copy of the journal (no WAL beside it) at `dest`, its meta naming
        the run that wrote it (`simulation`: seed, steps, the step and the failure)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.unlink(missing_ok=True)
        source = sqlite3.connect(self.path)
        target = sqlite3.connect(dest)
        try:
            source.backup(target)
        finally:
            target.close()
            source.close()
        annotate(dest, seed=self.seed, steps=self.steps, step=self.step,
                 failure=f"{type(cause).__name__}: {cause}")
        return dest

    def _summary(self, wall: float) -> Summary:
        digest = hashlib.sha256()
        outcomes: Counter = Counter()
        observed: Counter = Counter()
        for row in self.journal.reader.rows():
            digest.update(json.dumps(row, separators=(",", ":")).encode() + b"\n")
            kind, data = row[4], row[5]
            if kind == "RequestFinished":
                outcomes["finished"] += 1
            elif kind == "RequestCancelled":
                outcomes[f"cancelled({json.loads(data)['at_state']})"] += 1
            elif kind == "RequestFailed":
                outcomes[f"failed({json.loads(data)['failure']})"] += 1
            elif kind in ("EndpointEvicted", "EndpointLost"):
                observed[f"{kind[8:].lower()}({_gist(json.loads(data)['reason'])})"] += 1
            elif kind == "StopReached":
                observed[f"stopped({json.loads(data)['reason']})"] += 1
            elif kind in ("RequestPreempted", "PublicationRefused", "PlanFallback"):
                observed[kind] += 1
        return Summary(self.seed, self.steps, self.drained, self.scenario.describe(),
                       dict(outcomes), dict(self.faults), dict(observed + self.unjournaled),
                       self.journal.last_seq,
                       digest.hexdigest(), round(self.clock(), 6), wall)


def _small_wal(journal: Journal) -> Journal:
    """Checkpoint the WAL every 64 pages, not SQLite's 1000: each reopen after a crash scans
    the WAL (`scan_wal`, ~30 ms a MB in Python), and there are many. The rows are the same."""
    journal.db.execute("PRAGMA wal_autocheckpoint=64")
    return journal


def annotate(journal: Path, **fields) -> dict:
    """Add `fields` to a saved journal's `simulation` meta (the run that wrote it, what
    `journal check` says of it): a failure's file is a regression fixture as it stands."""
    with contextlib.closing(sqlite3.connect(journal)) as conn, conn:
        row = conn.execute("SELECT value FROM meta WHERE key = 'simulation'").fetchone()
        run = {**(json.loads(row[0]) if row else {}), **fields}
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('simulation', ?)", (json.dumps(run),))
    return run


def _gist(reason: str) -> str:
    """A reason without its figures ("MTP KV covers [0,3), needs [0,9)" -> "MTP KV covers")."""
    return re.split(r"[\[\d:(]", reason)[0].strip(" ,")


def run_simulation(seed: int, steps: int, workdir: Path, *, oracle: bool = True,
                   failures: Path | None = None) -> Summary:
    """One seeded run in `workdir`; raises SimulationFailed, its journal copied into
    `failures` (or left in `workdir`)."""
    sim = Simulation(seed, steps, workdir, oracle=oracle, failures=failures)
    try:
        return sim.run()
    finally:
        sim.close()
