"""The journal: an append-only SQLite log of events, one row each (specs/events.md).

Events arrive stamped with consecutive seqs (the engine assigns them); each `append` is one
transaction; the database itself refuses updates and deletes of `events`. The checks on
opening are `journalfile`'s, and the journal reads what it wrote through a `JournalReader`,
as every other reader does."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import sqlite_utils

from . import journalfile
from .events import Event, to_row
from .journalfile import (
    APPLICATION,
    JournalError,
    check_schema,
    inspect_file,
    scan_wal,  # noqa: F401 - the WAL's torn tail, where the journal's readers look for it
    sqlite_errors,
    warn_torn,
)
from .listrefs import Referrer
from .reader import Envelope, JournalReader
from .walmerge import WalMerge

RESERVED_META = frozenset({"schema_version", "application"})
ROTATION_META = frozenset({"previous", "first_seq"})  # a rotated file's own, not carried on
_SYNCHRONOUS = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})
_INSERT = "INSERT INTO events VALUES (?,?,?,?,?,?)"

log = logging.getLogger("ninfer.journal")


def _v1(db: sqlite_utils.Database) -> None:
    db["events"].create(
        {"seq": int, "time": float, "request": str, "conversation": str, "kind": str,
         "data": str}, pk="seq")
    # no secondary index: every index costs each append (~1.7 us a row, a sixth of the
    # journal's budget); the tools find a request or conversation with one scan
    db["meta"].create({"key": str, "value": str}, pk="key")
    for op in ("UPDATE", "DELETE"):
        db.execute(f"CREATE TRIGGER events_refuse_{op.lower()} BEFORE {op} ON events "
                   "BEGIN SELECT RAISE(ABORT, 'events are append-only'); END")
    db["meta"].insert({"key": "application", "value": json.dumps(APPLICATION)})


def _v2(db: sqlite_utils.Database) -> None:
    """Rows from now on pack their long lists, token ids and block hashes (`events.pack`);
    the rows already there keep their JSON lists, which the decoders still read. Nothing to
    change: the stamp keeps a build that knows only lists from reading packed ones as
    characters."""


def _v3(db: sqlite_utils.Database) -> None:
    """Rows from now on may start a packed list with an earlier row's (`listrefs`): a
    conversation's turn carries its new tokens, not its whole context again. Nothing to
    change; the stamp keeps a build that cannot follow such a list from misreading it."""


# version -> migration from version-1, up to journalfile.SCHEMA_VERSION; each runs in one
# transaction with its version stamp
MIGRATIONS: dict[int, Callable[[sqlite_utils.Database], None]] = {1: _v1, 2: _v2, 3: _v3}


class Journal:
    """An open journal: it writes, and reads through its `reader`. Not thread-safe: one
    thread (the engine's) uses it at a time."""

    _template: sqlite3.Connection | None = None

    def __init__(self, conn: sqlite3.Connection, path: str, torn_tail_bytes: int = 0, *,
                 synchronous: str = "NORMAL", max_bytes: int | None = None,
                 lock: int | None = None) -> None:
        self.path = path
        self._lock = lock     # the writer's lock file (see `open`), held until `close`
        self.torn_tail_bytes = torn_tail_bytes
        self.synchronous, self.max_bytes = synchronous, max_bytes
        self._conn = conn
        self._db = sqlite_utils.Database(conn)
        self._reader = JournalReader(conn, path)
        self._page_size: int | None = None
        self._last_seq = self._reader.last_seq()
        self._wal: WalMerge | None = None   # a file journal's (`open`)
        self._refs = Referrer()   # rows' lists that start with an earlier row's (this file's)

    @classmethod
    def open(cls, path: str | Path, *, identity: dict[str, Any] | None = None,
             synchronous: str = "NORMAL", max_bytes: int | None = None,
             _lock: int | None = None) -> Journal:
        """Open or create the journal at `path` (WAL mode; created with file mode 0600).

        One writer at a time: it holds an exclusive lock on `<path>.lock` until it closes,
        and a second writer (another `ninfer serve` on the same journal) is a JournalError
        naming the process that holds it. Readers need no lock.

        `identity` items (model identity, server options) are stored in `meta`. `max_bytes`:
        the size past which the owner should `rotate` (see `full`). A torn WAL tail
        is logged and the journal opens up to its last complete transaction. A non-database,
        damaged, foreign or newer journal is a JournalError naming the file and the reason."""
        path, sync = Path(path), synchronous.upper()
        if sync not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {sorted(_SYNCHRONOUS)}: {synchronous!r}")
        if RESERVED_META & (identity or {}).keys():
            raise ValueError(f"identity may not set {sorted(RESERVED_META & identity.keys())}")
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        except OSError as e:
            raise JournalError(f"journal {path}: {e.strerror or e}") from e
        lock = _lock if _lock is not None else _writer_lock(path)
        try:
            tail = inspect_file(path)  # before SQLite's recovery erases a torn WAL tail
            with sqlite_errors(path, "opening"):
                conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except BaseException:
            os.close(lock)
            raise
        try:
            with sqlite_errors(path, "opening"):
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if mode.lower() != "wal":
                    raise JournalError(f"journal {path}: cannot use WAL mode (got {mode!r})")
                conn.execute(f"PRAGMA synchronous={sync}")
                conn.execute("PRAGMA wal_autocheckpoint=0")   # `WalMerge` copies the WAL
                _prepare(sqlite_utils.Database(conn), path, identity)
            journal = cls(conn, str(path), tail.torn_bytes, synchronous=sync,
                          max_bytes=max_bytes, lock=lock)
            journal._wal = WalMerge(str(path))
        except BaseException:
            conn.close()
            os.close(lock)
            raise
        warn_torn(path, tail)
        return journal

    @classmethod
    def memory(cls) -> Journal:
        """A fresh in-memory journal (tests, Hypothesis): a copy of a schema built once."""
        if cls._template is None:
            template = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
            _prepare(sqlite_utils.Database(template), ":memory:", None)
            Journal._template = template
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        cls._template.backup(conn)
        return cls(conn, ":memory:")

    @property
    def last_seq(self) -> int:
        """The seq of the last event written (0 for an empty journal)."""
        return self._last_seq

    @property
    def db(self) -> sqlite_utils.Database:
        """The database, for its settings and a test's look; never write events through it
        (read them through `reader`)."""
        return self._db

    @property
    def reader(self) -> JournalReader:
        """The reader on this journal's connection: what it has written, committed or not."""
        return self._reader

    @property
    def meta(self) -> dict[str, Any]:
        """The meta table, values decoded from JSON."""
        return self._reader.meta

    def set_meta(self, key: str, value: Any) -> None:
        """Store `value` (JSON-encodable) under `key`; the schema's own keys are refused."""
        if key in RESERVED_META:
            raise ValueError(f"meta key {key!r} is reserved for the journal's schema")
        with self._errors("writing meta"):
            self._db["meta"].upsert({"key": key, "value": json.dumps(value)}, pk="key")

    def append(self, events: Sequence[Event]) -> None:
        """Write `events` in one transaction. Their seqs must run on from `last_seq` without a
        gap or repeat, else JournalError and nothing is written."""
        if not events:
            return
        first = self._last_seq + 1
        for i, ev in enumerate(events):
            if ev.seq != first + i:
                what = "repeats or goes back" if ev.seq < first + i else "leaves a gap"
                raise JournalError(f"journal {self.path}: seq {ev.seq} {what}: "
                                   f"expected seq {first + i}")
        refs = self._refs
        rows = [to_row(ev, refs.packer(ev)) for ev in events]
        conn = self._conn
        with self._errors(f"appending seqs {first}..{events[-1].seq}"):
            conn.execute("BEGIN")
            try:
                conn.executemany(_INSERT, rows)
                conn.execute("COMMIT")
            except BaseException:
                refs.forget()
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        self._last_seq = events[-1].seq
        if self._wal is not None:
            self._wal.wrote(sum(len(r[5]) for r in rows))

    def read(self, start_seq: int = 1, kinds: Sequence[str] | None = None) -> Iterator[Event]:
        """`reader.events`: the events with seq >= start_seq in seq order, streamed; only
        those of `kinds` when given (the store's fold reads only the kinds it folds)."""
        return self._reader.events(start_seq, kinds)

    def envelopes(self, kinds: Sequence[str]) -> Iterator[Envelope]:
        """`reader.envelopes`: the envelopes of the events of `kinds` in seq order, payloads
        left unread (who came and went, for recovery)."""
        return self._reader.envelopes(kinds)

    @property
    def first_seq(self) -> int:
        """The seq of the file's first event (a rotated file's continues its predecessor)."""
        return self._reader.first_seq()

    def size(self) -> int:
        """Bytes of the database, the WAL's committed pages included."""
        with self._errors("reading its size"):
            pages = self._conn.execute("PRAGMA page_count").fetchone()[0]
            if self._page_size is None:   # fixed once the file has pages (the engine asks
                # after every step)
                self._page_size = self._conn.execute("PRAGMA page_size").fetchone()[0]
            return pages * self._page_size

    @property
    def full(self) -> bool:
        """Past `max_bytes`: time to rotate."""
        return self.max_bytes is not None and self.size() >= self.max_bytes

    def rotate(self) -> Journal:
        """Close this file, rename it `<stem>.<first>-<last><suffix>` beside the path, and
        open a fresh journal at the path with the same meta, continuing at seq last+1.
        The caller writes the `StoreSnapshotted` that opens it. Returns the new journal."""
        if self.path == ":memory:":
            raise JournalError("an in-memory journal cannot rotate")
        meta = {k: v for k, v in self.meta.items() if k not in RESERVED_META | ROTATION_META}
        first, last = self.first_seq, self._last_seq
        path = Path(self.path)
        rotated = path.with_name(f"{path.stem}.{first}-{last}{path.suffix}")
        lock, self._lock = self._lock, None   # kept across: no other writer gets in between
        self.close()
        try:
            os.replace(path, rotated)
            for suffix in ("-wal", "-shm"):  # left by a reader that kept the file open
                if Path(f"{path}{suffix}").exists():
                    os.replace(f"{path}{suffix}", f"{rotated}{suffix}")
        except OSError as e:
            if lock is not None:
                os.close(lock)
            raise JournalError(f"journal {path}: rotating to {rotated}: {e}") from e
        log.info("journal %s: rotated seqs %d..%d to %s", path, first, last, rotated.name)
        return Journal.open(path, identity=meta | {"previous": rotated.name, "first_seq": last + 1},
                            synchronous=self.synchronous, max_bytes=self.max_bytes, _lock=lock)

    def count(self) -> int:
        """The number of events in the journal."""
        return self._reader.count()

    def close(self) -> None:
        """Close the connection (idempotent) and let the writer's lock go; SQLite checkpoints
        the WAL on the last close (the WAL's copier closes first)."""
        if self._wal is not None:
            self._wal.close()
        self._conn.close()
        if self._lock is not None:
            os.close(self._lock)   # closing the descriptor releases its lock
            self._lock = None

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _errors(self, doing: str) -> contextlib.AbstractContextManager[None]:
        return sqlite_errors(self.path, doing)


def chain(path: str | Path) -> list[Path]:
    """The journal at `path` and the files it was rotated from, oldest first (following
    each file's `previous` meta back until a file has none or is missing)."""
    files = [Path(path)]
    while True:
        with JournalReader.open(files[0]) as reader:
            previous = reader.meta.get("previous")
        before = files[0].with_name(previous) if previous else None
        if before is None or not before.exists() or before in files:
            return files
        files.insert(0, before)


def _prepare(db: sqlite_utils.Database, where: str | Path, identity: dict[str, Any] | None) -> None:
    """Check the schema is ours and not newer, apply pending migrations, store `identity`."""
    found = check_schema(db.conn, where, new=True)
    for version in range(found + 1, journalfile.SCHEMA_VERSION + 1):
        with db.atomic():
            MIGRATIONS[version](db)
            db["meta"].upsert({"key": "schema_version", "value": json.dumps(version)}, pk="key")
    if identity:
        with db.atomic():
            db["meta"].upsert_all([{"key": k, "value": json.dumps(v)} for k, v in identity.items()],
                                  pk="key")


def _writer_lock(path: Path) -> int:
    """An exclusive lock on `<path>.lock` (its descriptor), with this process's pid written
    in it; a JournalError naming the holder when another writer has it."""
    lock_path = Path(f"{path}.lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise JournalError(f"journal {path}: its lock file: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise JournalError(f"journal {path}: in use by another writer (pid {holder}); give "
                           "each server its own --journal") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
