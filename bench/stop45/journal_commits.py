"""The journal's commits timed inside a served process: `ninfer bench turn` at 16K (two
conversations), with `Journal.append` replaced by a copy that times its parts (encoding the
rows, BEGIN, the inserts, COMMIT); the last commits of 4 events or more are printed.
`EVERY=S`: the WAL copier looks every S seconds and copies whatever waits (the behaviour
before stop 45's threshold); `NO_WALMERGE=1`: it never copies.

    .venv/bin/python bench/stop45/journal_commits.py
"""
from __future__ import annotations

import os
import time

from ninfer.bench import turn
from ninfer.lifecycle import journal as J
from ninfer.lifecycle import walmerge
from ninfer.lifecycle.events import to_row

timed: list[tuple] = []


def append(self, events):
    t0 = time.perf_counter()
    rows = [to_row(ev, self._refs.packer(ev)) for ev in events]
    t1 = time.perf_counter()
    self._conn.execute("BEGIN")
    t2 = time.perf_counter()
    self._conn.executemany(J._INSERT, rows)
    t3 = time.perf_counter()
    self._conn.execute("COMMIT")
    t4 = time.perf_counter()
    self._last_seq = events[-1].seq
    if self._wal is not None:
        self._wal.wrote(sum(len(r[5]) for r in rows))
    timed.append((len(events), sum(len(r[5]) for r in rows), t1 - t0, t2 - t1, t3 - t2,
                  t4 - t3))


def main() -> None:
    J.Journal.append = append
    if os.environ.get("EVERY"):
        walmerge.WalMerge.__init__.__defaults__ = (float(os.environ["EVERY"]), 0)
    if os.environ.get("NO_WALMERGE"):
        walmerge.WalMerge._run = lambda self: None
    turn.main(sizes=(16384,), repeat=2)
    for n, size, encode, begin, insert, commit in [r for r in timed if r[0] >= 4][-12:]:
        print(f"events {n} bytes {size} encode {1e3 * encode:.3f} begin {1e3 * begin:.3f} "
              f"insert {1e3 * insert:.3f} commit {1e3 * commit:.3f} ms")


if __name__ == "__main__":
    main()
