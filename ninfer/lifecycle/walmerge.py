"""The journal's WAL copied into its database from a thread of its own (SQLite's checkpoint,
PASSIVE), so that the writer never does it.

With SQLite's automatic checkpoint, whichever commit took the WAL past 1,000 pages copied
it in that commit, on the engine thread: at 32K tokens of context a next turn writes ~1 MB
of rows, and every few turns one commit took 16-22 ms instead of 2-4 (bench/NOTES.md, stop
42), a stall on every stream's next token. The writer's connection turns the automatic
checkpoint off (`wal_autocheckpoint=0`) and this thread's connection copies what is
committed every `every` seconds; a passive checkpoint waits for no reader and no writer.
SQLite's threads release the interpreter lock while they work.

It copies only once `min_bytes` of rows were committed since its last copy (the writer
counts them, `wrote`). The first commit after a copy that emptied the WAL starts the WAL
over, and paid for it: 0.4-0.6 ms on this CPU where a commit takes 0.05. Copied every 0.2
s, that was every next turn's first-token commit (a turn comes after a pause; stop 45's
probe of `ninfer bench turn` at 16K, its commits timed in the served process: 0.45-0.72 ms
with a copy every 0.2 s, 0.04-0.06 ms without copies).
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("ninfer.journal")

EVERY = 0.2   # seconds between looks at what was committed
MIN_BYTES = 4 << 20   # rows committed since the last copy that make the next one worth it


class WalMerge:
    """Copies the committed WAL of the journal at `path` into it every `every` seconds until
    `close`; closed before the writer's connection, so that the writer's close is the last
    and SQLite merges and removes the WAL then."""

    def __init__(self, path: str, every: float = EVERY, min_bytes: int = MIN_BYTES) -> None:
        self.every, self.min_bytes = every, min_bytes
        self.copies = 0   # passive checkpoints run (tests)
        # bytes of rows committed since the last copy: the writer adds, this thread clears
        # (an add lost between the two only delays a copy)
        self.pending = 0
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ninfer-journal-wal",
                                        daemon=True)
        self._thread.start()

    def wrote(self, nbytes: int) -> None:
        """The writer committed `nbytes` of rows."""
        self.pending += nbytes

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if self.pending < self.min_bytes:
                continue
            self.pending = 0
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                self.copies += 1
            except sqlite3.Error as exc:   # the writer's commits go on; the next try may do
                log.debug("journal WAL copy failed: %s", exc)

    def close(self) -> None:
        """Stop the thread and close its connection (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._conn.close()
