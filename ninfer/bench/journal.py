"""`ninfer bench journal`: what the journal tools and a restart cost on a large journal.

One journal of N events (the lifecycle benchmark's mix: 64-token prompts, 4 decode commits,
a published checkpoint per request) is built once; then, each timed on its own:

- raw read: every row fetched by sqlite3, nothing decoded (the baseline of this run);
- `journal replay`: the store folded and the summary counted (`replay_summary`);
- `journal check`: every journal-checkable invariant (`check`);
- recovery at start-up: `Engine.recover` of a SimModel engine on a copy of the file (the
  fold, open requests closed, endpoints lost, `ServerStarted` appended).

Rates are journal events per second, each the best of `repeat` runs (as timeit does: on a
shared machine the slower runs time the neighbours); the ratios to the raw read are printed
beside them.
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from ..engine.engine import Engine, EngineConfig
from ..lifecycle.journal import Journal
from ..lifecycle.reader import JournalReader
from ..model.pools import BlockPool, SlotPool
from ..model.sim_model import SimModel
from ..tools.scan import check, replay_summary
from .lifecycle import SESSIONS, build_journal
from .report import report

TARGETS = {"replay_events_per_s": (">=", 200_000), "check_events_per_s": (">=", 200_000)}
ROWS = [
    ("raw_read_events_per_s", "raw read: sqlite3 fetches every row", "events/s", ",.0f"),
    ("replay_events_per_s", "journal replay: fold + summary", "events/s", ",.0f"),
    ("replay_raw_ratio", "  replay / raw read", "", ".2f"),
    ("check_events_per_s", "journal check: every J invariant", "events/s", ",.0f"),
    ("check_raw_ratio", "  check / raw read", "", ".2f"),
    ("recovery_s", "recovery at start-up (Engine.recover)", "s", ",.2f"),
    ("recovery_events_per_s", "  per journal event", "events/s", ",.0f"),
]


def _timed(fn, repeat: int = 1) -> tuple[object, float]:
    """`fn()`'s value and its shortest time of `repeat` runs."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def raw_read(path: Path) -> int:
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro&immutable=1", uri=True)
    try:
        cur = conn.execute("SELECT seq, time, request, conversation, kind, data FROM events "
                           "ORDER BY seq")
        n = 0
        while batch := cur.fetchmany(4096):
            n += len(batch)
        return n
    finally:
        conn.close()


def replay(path: Path) -> dict:
    """`ninfer journal replay` on `path`, without printing."""
    with JournalReader.open(path) as src:
        return replay_summary(src)


def check_all(path: Path):
    """`ninfer journal check` on `path`, without printing: (what it verified, a problem)."""
    with JournalReader.open(path) as src:
        return check(src)


def recover(path: Path) -> int:
    """A restart on `path`: what `ninfer serve` does before it serves."""
    with Journal.open(path) as journal:
        model = SimModel(num_blocks=256, block_size=16, num_slots=SESSIONS + 8)
        engine = Engine(model, EngineConfig(max_endpoints=SESSIONS), blocks=BlockPool(256, 16),
                        slots=SlotPool(SESSIONS + 8), journal=journal)
        engine.recover()
        return journal.last_seq


def main(events: int = 1_000_000, json_path: str | None = None, repeat: int = 3) -> int:
    if events < 1 or repeat < 1:
        print("bench journal: --events and --repeat must be at least 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ninfer-bench-") as tmp:
        path = Path(tmp) / "journal.db"
        built = build_journal(path, events)
        n, raw_s = _timed(lambda: raw_read(path), repeat)
        assert n == built
        summary, replay_s = _timed(lambda: replay(path), repeat)
        assert summary["events"] == built and summary["store"]["endpoints"]
        (checker, violation), check_s = _timed(lambda: check_all(path), repeat)
        assert violation is None and checker.events == built, violation
        copy = Path(tmp) / "restart.db"
        shutil.copy(path, copy)
        last, recovery_s = _timed(lambda: recover(copy))
        assert last > built  # recovery appended its events
    raw = built / raw_s
    results = {"events": built, "raw_read_events_per_s": raw,
               "replay_events_per_s": built / replay_s,
               "replay_raw_ratio": built / replay_s / raw,
               "check_events_per_s": built / check_s, "check_raw_ratio": built / check_s / raw,
               "recovery_s": recovery_s, "recovery_events_per_s": built / recovery_s,
               "repeat": repeat}
    report("journal", results, ROWS, TARGETS, json_path,
           note=f"(journal: {built:,} events, the lifecycle benchmark's mix; rates: the "
                f"best of {repeat} runs, recovery: one)")
    return 0
