"""The journal: an append-only SQLite log of events, one row each (DESIGN.md "Journal and store").

Events arrive stamped with consecutive seqs (the engine assigns them); each `append` is one
transaction; the database itself refuses updates and deletes of `events`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import sqlite_utils

from .events import Event, UnknownEventKind, from_row, to_row

SCHEMA_VERSION = 1
APPLICATION = "ninfer"
RESERVED_META = frozenset({"schema_version", "application"})
ROTATION_META = frozenset({"previous", "first_seq"})  # a rotated file's own, not carried on
_SYNCHRONOUS = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})
_INSERT = "INSERT INTO events VALUES (?,?,?,?,?,?)"
_SELECT = ("SELECT seq, time, request, conversation, kind, data FROM events "
           "WHERE seq >= ? ORDER BY seq")
_SQLITE_MAGIC = b"SQLite format 3\x00"
_WAL_MAGIC = (0x377F0682, 0x377F0683)
_PAGE_SIZES = frozenset(1 << n for n in range(9, 17))

log = logging.getLogger("ninfer.journal")


class JournalError(Exception):
    """A journal that cannot be opened, read or appended to; the message names the file."""


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


# version -> migration from version-1; each runs in one transaction with its version stamp
MIGRATIONS: dict[int, Callable[[sqlite_utils.Database], None]] = {1: _v1}


def _wal_checksum(data: bytes, order: str, s0: int, s1: int) -> tuple[int, int]:
    words = iter(struct.unpack(f"{order}{len(data) // 4}I", data))
    for a, b in zip(words, words, strict=True):
        s0 = (s0 + a + s1) & 0xFFFFFFFF
        s1 = (s1 + b + s0) & 0xFFFFFFFF
    return s0, s1


def scan_wal(wal: Path) -> tuple[int, int, int]:
    """(torn bytes, torn frames, valid commit frames) of a WAL file (SQLite's WAL format).

    Torn: the bytes of the current generation (frames whose salts match the header) after its
    last valid commit frame, i.e. a transaction cut mid-write, which SQLite's recovery drops.
    Frames left from an earlier generation (other salts) are not torn; a WAL whose header is
    unreadable is torn in full, as SQLite ignores all of it."""
    with open(wal, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(32)
        if len(head) < 32:
            return len(head), 0, 0
        magic, _, page_size, _, salt1, salt2, c1, c2 = struct.unpack(">8I", head)
        frame_size = 24 + page_size
        order = ">" if magic == 0x377F0683 else "<"
        if (magic not in _WAL_MAGIC or page_size not in _PAGE_SIZES
                or _wal_checksum(head[:24], order, 0, 0) != (c1, c2)):
            return size, 0, 0
        sums, valid, commits = (c1, c2), True, 0
        end = committed_end = 32
        while frame := f.read(frame_size):
            if len(frame) >= 16 and struct.unpack_from(">II", frame, 8) != (salt1, salt2):
                break  # an earlier generation's frame: the current one ends here
            end += len(frame)
            if len(frame) < frame_size:
                break
            _, commit_size, _, _, f1, f2 = struct.unpack_from(">6I", frame)
            if valid:  # checksums chain, so nothing after a bad frame is valid
                sums = _wal_checksum(frame[:8] + frame[24:], order, *sums)
                valid = sums == (f1, f2)
            if valid and commit_size:
                committed_end, commits = end, commits + 1
        torn = end - committed_end
        return torn, -(-torn // frame_size), commits


def _check_header(path: Path, wal_commits: int) -> None:
    """Refuse a non-SQLite file, or one shorter than its header says (a truncated copy)."""
    with open(path, "rb") as f:
        head, size = f.read(100), os.fstat(f.fileno()).st_size
    if size == 0:
        return
    if len(head) < 100 or not head.startswith(_SQLITE_MAGIC):
        raise JournalError(f"journal {path}: file is not a database")
    page_size = struct.unpack_from(">H", head, 16)[0]
    page_size = 65536 if page_size == 1 else page_size  # the format's encoding of 64 KiB
    counter, pages = struct.unpack_from(">II", head, 24)
    header_valid = pages and counter == struct.unpack_from(">I", head, 92)[0]
    # with committed WAL frames the file may legitimately lag (a checkpoint cut short)
    if header_valid and not wal_commits and pages * page_size > size:
        raise JournalError(f"journal {path}: damaged database: truncated, its header says "
                           f"{pages} pages of {page_size} bytes but the file has {size} bytes")


class Journal:
    """An open journal. Not thread-safe: one thread (the engine's) uses it at a time."""

    _template: sqlite3.Connection | None = None

    def __init__(self, conn: sqlite3.Connection, path: str, torn_tail_bytes: int = 0, *,
                 synchronous: str = "NORMAL", max_bytes: int | None = None) -> None:
        self.path = path
        self.torn_tail_bytes = torn_tail_bytes
        self.synchronous, self.max_bytes = synchronous, max_bytes
        self._conn = conn
        self._db = sqlite_utils.Database(conn)
        with self._errors("reading last seq"):
            last = conn.execute("SELECT MAX(seq) FROM events").fetchone()[0]
            if last is None:  # empty; a rotated file continues its predecessor's seqs
                row = conn.execute("SELECT value FROM meta WHERE key = 'first_seq'").fetchone()
                last = int(json.loads(row[0])) - 1 if row else 0
        self._last_seq = last

    @classmethod
    def open(cls, path: str | Path, *, identity: dict[str, Any] | None = None,
             synchronous: str = "NORMAL", max_bytes: int | None = None) -> Journal:
        """Open or create the journal at `path` (WAL mode; created with file mode 0600).

        `identity` items (model identity, server options) are stored in `meta`. `max_bytes`:
        the size past which the owner should `rotate` (see `full`). A torn WAL tail
        is logged and the journal opens up to its last complete transaction. A non-database,
        damaged, foreign or newer journal is a JournalError naming the file and the reason."""
        path, sync = Path(path), synchronous.upper()
        if sync not in _SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {sorted(_SYNCHRONOUS)}: {synchronous!r}")
        if RESERVED_META & (identity or {}).keys():
            raise ValueError(f"identity may not set {sorted(RESERVED_META & identity.keys())}")
        wal = Path(f"{path}-wal")
        try:
            # before SQLite touches the WAL: its recovery and checkpoint erase the evidence
            torn, torn_frames, commits = scan_wal(wal) if wal.exists() else (0, 0, 0)
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            _check_header(path, commits)
        except OSError as e:
            raise JournalError(f"journal {path}: {e.strerror or e}") from e
        with _sqlite_errors(path, "opening"):
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            with _sqlite_errors(path, "opening"):
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if mode.lower() != "wal":
                    raise JournalError(f"journal {path}: cannot use WAL mode (got {mode!r})")
                conn.execute(f"PRAGMA synchronous={sync}")
                _prepare(sqlite_utils.Database(conn), path, identity)
            journal = cls(conn, str(path), torn, synchronous=sync, max_bytes=max_bytes)
        except BaseException:
            conn.close()
            raise
        if torn:
            log.warning("journal %s: discarded %d bytes (%d frames) of an incomplete transaction "
                        "at the WAL tail; the journal opens up to its last complete transaction",
                        path, torn, torn_frames)
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
        """The database, for read-only queries (journal check, show); never write through it."""
        return self._db

    @property
    def meta(self) -> dict[str, Any]:
        """The meta table, values decoded from JSON."""
        with self._errors("reading meta"):
            rows = list(self._db["meta"].rows)
        try:
            return {row["key"]: json.loads(row["value"]) for row in rows}
        except (TypeError, ValueError) as e:
            raise JournalError(f"journal {self.path}: damaged meta table: {e}") from e

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
        rows = [to_row(ev) for ev in events]
        conn = self._conn
        with self._errors(f"appending seqs {first}..{events[-1].seq}"):
            conn.execute("BEGIN")
            try:
                conn.executemany(_INSERT, rows)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        self._last_seq = events[-1].seq

    def read(self, start_seq: int = 1, kinds: Sequence[str] | None = None) -> Iterator[Event]:
        """The events with seq >= start_seq in seq order, streamed from a cursor; only those
        of `kinds` when given (the store's fold reads only the kinds it folds)."""
        sql, params = _SELECT, [start_seq]
        if kinds is not None:
            sql = sql.replace(" ORDER BY", f" AND kind IN ({','.join('?' * len(kinds))}) ORDER BY")
            params.extend(kinds)
        with self._errors("reading events"):
            cursor = self._conn.execute(sql, params)
            while rows := cursor.fetchmany(1024):
                for row in rows:
                    try:
                        ev = from_row(*row)
                    except UnknownEventKind:
                        raise JournalError(f"journal {self.path}: unknown event kind {row[4]!r} "
                                           f"at seq {row[0]}") from None
                    except Exception as e:  # any bad payload is the journal's fault
                        raise JournalError(f"journal {self.path}: undecodable {row[4]!r} event "
                                           f"at seq {row[0]}: {e}") from e
                    yield ev

    def envelopes(self, kinds: Sequence[str]) -> Iterator[tuple[int, str | None, str | None, str]]:
        """(seq, request, conversation, kind) of the events of `kinds` in seq order, their
        payloads left unread: who came and went, for recovery."""
        sql = (f"SELECT seq, request, conversation, kind FROM events WHERE kind IN "
               f"({','.join('?' * len(kinds))}) ORDER BY seq")
        with self._errors("reading events"):
            yield from self._conn.execute(sql, list(kinds))

    @property
    def first_seq(self) -> int:
        """The seq of the file's first event (a rotated file's continues its predecessor)."""
        with self._errors("reading first seq"):
            first = self._conn.execute("SELECT MIN(seq) FROM events").fetchone()[0]
        return first if first is not None else self._last_seq + 1

    def size(self) -> int:
        """Bytes of the database, the WAL's committed pages included."""
        with self._errors("reading its size"):
            pages = self._conn.execute("PRAGMA page_count").fetchone()[0]
            return pages * self._conn.execute("PRAGMA page_size").fetchone()[0]

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
        self.close()
        try:
            os.replace(path, rotated)
            for suffix in ("-wal", "-shm"):  # left by a reader that kept the file open
                if Path(f"{path}{suffix}").exists():
                    os.replace(f"{path}{suffix}", f"{rotated}{suffix}")
        except OSError as e:
            raise JournalError(f"journal {path}: rotating to {rotated}: {e}") from e
        log.info("journal %s: rotated seqs %d..%d to %s", path, first, last, rotated.name)
        return Journal.open(path, identity=meta | {"previous": rotated.name, "first_seq": last + 1},
                            synchronous=self.synchronous, max_bytes=self.max_bytes)

    def count(self) -> int:
        """The number of events in the journal."""
        with self._errors("counting events"):
            return self._conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]

    def close(self) -> None:
        """Close the connection (idempotent); SQLite checkpoints the WAL on the last close."""
        self._conn.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _errors(self, doing: str) -> contextlib.AbstractContextManager[None]:
        return _sqlite_errors(self.path, doing)


def chain(path: str | Path) -> list[Path]:
    """The journal at `path` and the files it was rotated from, oldest first (following
    each file's `previous` meta back until a file has none or is missing)."""
    files = [Path(path)]
    while True:
        try:
            conn = sqlite3.connect(files[0].resolve().as_uri() + "?mode=ro", uri=True)
            try:
                row = conn.execute("SELECT value FROM meta WHERE key = 'previous'").fetchone()
            finally:
                conn.close()
        except sqlite3.Error as e:
            raise JournalError(f"journal {files[0]}: reading meta: {e}") from e
        before = files[0].with_name(json.loads(row[0])) if row else None
        if before is None or not before.exists() or before in files:
            return files
        files.insert(0, before)


@contextlib.contextmanager
def _sqlite_errors(where: str | Path, doing: str) -> Iterator[None]:
    try:
        yield
    except sqlite3.Error as e:
        damaged = "damaged database: " if "malformed" in str(e) else ""
        raise JournalError(f"journal {where}: {doing}: {damaged}{e}") from e


def _prepare(db: sqlite_utils.Database, where: str | Path, identity: dict[str, Any] | None) -> None:
    """Check the schema is ours and not newer, apply pending migrations, store `identity`."""
    tables = set(db.table_names())
    found = 0
    if tables:
        try:
            rows = dict(db.execute("SELECT key, value FROM meta "
                                   "WHERE key IN ('application', 'schema_version')").fetchall())
        except sqlite3.OperationalError:
            rows = {}
        if rows.get("application") != json.dumps(APPLICATION) or "events" not in tables:
            raise JournalError(f"journal {where}: foreign schema (tables {sorted(tables)}, "
                               f"no ninfer events and meta)")
        try:
            found = int(json.loads(rows["schema_version"]))
        except (KeyError, TypeError, ValueError):
            raise JournalError(f"journal {where}: damaged meta: schema_version is "
                               f"{rows.get('schema_version')!r}") from None
        if found > SCHEMA_VERSION:
            raise JournalError(f"journal {where}: written by a newer ninfer: schema version "
                               f"{found}, this build reads up to {SCHEMA_VERSION}")
    for version in range(found + 1, SCHEMA_VERSION + 1):
        with db.atomic():
            MIGRATIONS[version](db)
            db["meta"].upsert({"key": "schema_version", "value": json.dumps(version)}, pk="key")
    if identity:
        with db.atomic():
            db["meta"].upsert_all([{"key": k, "value": json.dumps(v)} for k, v in identity.items()],
                                  pk="key")
