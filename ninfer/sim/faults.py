"""The faults the simulator injects at step boundaries, and the mechanics of a crash.

Disconnects live with the clients (clients.py) and pool exhaustion with the scenario's
small pools and long prompts; this module chooses, before each step, whether an operator
evicts, whether the step is slow, whether the server crashes during it (and again while
recovering) or restarts before it, and carries out the crash: the step runs, its one
journal transaction never commits, and the journal file is opened again as a killed
process leaves it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from ..engine.engine import Engine
from ..lifecycle.eventlog import EventLog
from ..lifecycle.events import Event
from ..lifecycle.journal import Journal
from .scenario import FaultRates


class Crash(Exception):
    """The server died while committing a step."""


@dataclass(frozen=True)
class Strike:
    """What happens around one engine step."""

    evict: bool = False
    slow: float = 0.0        # virtual seconds the step takes, when it is slow
    crash: bool = False
    crash_again: bool = False  # the crash recurs during recovery, before its commit
    restart: bool = False
    keep_tensors: bool = True

    @classmethod
    def draw(cls, rng: random.Random, rates: FaultRates) -> Strike:
        # one draw per fault, always in the same order: the rng stream does not depend on
        # which faults strike
        evict, slow, crash, again, restart, keep, seconds = (rng.random() for _ in range(7))
        return cls(evict=evict < rates.evict,
                   slow=0.5 + 5.5 * seconds if slow < rates.slow else 0.0,
                   crash=crash < rates.crash, crash_again=again < 0.3,
                   restart=restart < rates.restart, keep_tensors=keep < 0.6)


def step_without_commit(engine: Engine) -> list[Event]:
    """Run one step whose journal transaction never happens: the crash lands between the
    previous step's commit and this one's. Returns the step's events, which were folded
    and streamed to listeners but never journaled; the engine is dead afterwards."""
    def lost():
        raise Crash("killed before the step's journal commit")
    engine.log.flush = lost
    try:
        engine.step()
    except Crash:
        return engine.log.pending
    raise AssertionError("the step committed without flushing its events")


def boot_without_commit(boot: Callable[[], None]) -> None:
    """Run `boot` (a restart: recovery folds the journal, appends its events, commits) with
    every commit lost: the server dies again while recovering."""
    def lost(_log):
        raise Crash("killed before recovery's journal commit")
    with mock.patch.object(EventLog, "flush", lost):
        try:
            boot()
        except Crash:
            return
    raise AssertionError("recovery committed without flushing its events")


def reopen_after_crash(journal: Journal) -> Journal:
    """The journal's files as a killed process leaves them (the database and its WAL, which
    hold the committed transactions), opened again: SQLite recovers from the WAL as it
    would after a real kill, not from a connection that closed cleanly."""
    path = Path(journal.path)
    files = [Path(f"{path}{suffix}") for suffix in ("", "-wal")]
    left = {f: f.read_bytes() for f in files if f.exists()}
    journal.close()  # a clean close checkpoints and removes the WAL: put back what a kill leaves
    for f in (*files, Path(f"{path}-shm")):
        f.unlink(missing_ok=True)
    for f, data in left.items():
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
    return Journal.open(path)
