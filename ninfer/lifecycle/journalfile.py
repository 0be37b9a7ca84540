"""What makes a file a journal, checked the same way by the writer and the reader.

Before SQLite opens the file: its WAL's torn tail is measured (`scan_wal`, SQLite's recovery
erases the evidence) and the database header is checked (`check_header`: not a database, a
truncated copy). Once it is open: the schema is ninfer's and not newer than this build
(`check_schema`). Every failure is a JournalError naming the file and what is wrong."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

SCHEMA_VERSION = 3   # 2: long lists packed in rows (`events.pack`); 3: a row's list may
#                      start with an earlier row's (`listrefs`)
APPLICATION = "ninfer"
_SQLITE_MAGIC = b"SQLite format 3\x00"
_WAL_MAGIC = (0x377F0682, 0x377F0683)
_PAGE_SIZES = frozenset(1 << n for n in range(9, 17))

log = logging.getLogger("ninfer.journal")


class JournalError(Exception):
    """A journal that cannot be opened, read or appended to; the message names the file."""


class WalTail(NamedTuple):
    """What `scan_wal` found at the end of a WAL file."""

    torn_bytes: int      # of the current generation, after its last valid commit frame
    torn_frames: int
    commits: int         # valid commit frames before them


def _wal_checksum(data: bytes, order: str, s0: int, s1: int) -> tuple[int, int]:
    words = iter(struct.unpack(f"{order}{len(data) // 4}I", data))
    for a, b in zip(words, words, strict=True):
        s0 = (s0 + a + s1) & 0xFFFFFFFF
        s1 = (s1 + b + s0) & 0xFFFFFFFF
    return s0, s1


def scan_wal(wal: Path) -> WalTail:
    """The torn tail and the commits of a WAL file (SQLite's WAL format).

    Torn: the bytes of the current generation (frames whose salts match the header) after its
    last valid commit frame, i.e. a transaction cut mid-write, which SQLite's recovery drops.
    Frames left from an earlier generation (other salts) are not torn; a WAL whose header is
    unreadable is torn in full, as SQLite ignores all of it."""
    with open(wal, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(32)
        if len(head) < 32:
            return WalTail(len(head), 0, 0)
        magic, _, page_size, _, salt1, salt2, c1, c2 = struct.unpack(">8I", head)
        frame_size = 24 + page_size
        order = ">" if magic == 0x377F0683 else "<"
        if (magic not in _WAL_MAGIC or page_size not in _PAGE_SIZES
                or _wal_checksum(head[:24], order, 0, 0) != (c1, c2)):
            return WalTail(size, 0, 0)
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
        return WalTail(torn, -(-torn // frame_size), commits)


def check_header(path: Path, wal_commits: int) -> None:
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


def inspect_file(path: Path) -> WalTail:
    """The checks before SQLite opens `path`: its WAL's torn tail (measured before SQLite's
    recovery or a checkpoint erases it) and its header. An OSError is a JournalError."""
    wal = Path(f"{path}-wal")
    try:
        tail = scan_wal(wal) if wal.exists() else WalTail(0, 0, 0)
        check_header(path, tail.commits)
    except OSError as e:
        raise JournalError(f"journal {path}: {e.strerror or e}") from e
    return tail


def warn_torn(path: str | Path, tail: WalTail) -> None:
    """Log the torn tail SQLite leaves out (README: opens up to the last complete one)."""
    if tail.torn_bytes:
        log.warning("journal %s: discarded %d bytes (%d frames) of an incomplete transaction "
                    "at the WAL tail; the journal opens up to its last complete transaction",
                    path, tail.torn_bytes, tail.torn_frames)


def check_schema(conn: sqlite3.Connection, where: str | Path, *, new: bool) -> int:
    """The schema version of the journal on `conn`; JournalError for a foreign schema, a
    damaged version stamp or a newer version. `new`: a database without tables is a journal
    still to be created (version 0), not a foreign one (the writer's case)."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if new and not tables:
        return 0
    try:
        rows = dict(conn.execute("SELECT key, value FROM meta "
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
    return found


@contextlib.contextmanager
def sqlite_errors(where: str | Path, doing: str) -> Iterator[None]:
    """SQLite's errors as JournalErrors saying what was being done (a malformed page: a
    damaged database)."""
    try:
        yield
    except sqlite3.Error as e:
        raise sqlite_error(where, doing, e) from e


def sqlite_error(where: str | Path, doing: str, error: sqlite3.Error) -> JournalError:
    """SQLite's `error` while `doing` something to the journal at `where`, as a JournalError."""
    damaged = "damaged database: " if "malformed" in str(error) else ""
    return JournalError(f"journal {where}: {doing}: {damaged}{error}")
