"""The journal's WAL copied into its database from a thread of its own (SQLite's checkpoint,
PASSIVE), so that the writer never does it.

With SQLite's automatic checkpoint, whichever commit took the WAL past 1,000 pages copied
it in that commit, on the engine thread: at 32K tokens of context a next turn writes ~1 MB
of rows, and every few turns one commit took 16-22 ms instead of 2-4 (bench/NOTES.md, stop
42), a stall on every stream's next token. The writer's connection turns the automatic
checkpoint off (`wal_autocheckpoint=0`) and this thread's connection copies what is
committed every `every` seconds; a passive checkpoint waits for no reader and no writer.
SQLite's threads release the interpreter lock while they work.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger("ninfer.journal")

EVERY = 0.2   # seconds between copies


class WalMerge:
    """Copies the committed WAL of the journal at `path` into it every `every` seconds until
    `close`; closed before the writer's connection, so that the writer's close is the last
    and SQLite merges and removes the WAL then."""

    def __init__(self, path: str, every: float = EVERY) -> None:
        self.every = every
        self.copies = 0   # passive checkpoints run (tests)
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ninfer-journal-wal",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
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
