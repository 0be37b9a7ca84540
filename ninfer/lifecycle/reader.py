"""The journal reader: how every reader of a journal reads it, the writer included.

`JournalReader.open` opens a journal file read-only after the checks the writer makes too
(`journalfile`: a whole SQLite file, ninfer's schema, not newer; a torn WAL tail logged, the
file read up to its last complete transaction). `Journal`, the writer, reads through a
JournalReader on its own connection. A row that does not decode is an `UnreadableEvent`,
the one error that names an event the journal holds but this code cannot read."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from . import events as ev
from .events import Event, UnknownEventKind, from_row
from .journalfile import (
    JournalError,
    check_schema,
    inspect_file,
    sqlite_error,
    sqlite_errors,
    warn_torn,
)
from .listrefs import Resolver

COLUMNS = "seq, time, request, conversation, kind, data"
# Lean reads leave out token ids (prompts' and checkpoints': most of a journal's bytes) and
# output grammars (a tool list's schemas run to tens of KB), dropped by SQLite before Python
# parses the JSON: kind -> json_replace's (path, value) pairs
LEAN_DROP = {"RequestQueued": "'$.tokens', NULL, '$.block_hashes', json('[]'), "
                              "'$.params.grammar', NULL",
             "EndpointPublished": "'$.endpoint.checkpoint.tokens', NULL",
             "CheckpointCaptured": "'$.checkpoint.tokens', NULL"}
# the lean payload column; a payload that is not JSON comes as it is, for `decode` to name
LEAN_DATA = "CASE kind " + " ".join(
    f"WHEN '{k}' THEN CASE WHEN json_valid(data) THEN json_replace(data, {drop}) ELSE data END"
    for k, drop in LEAN_DROP.items()) + " ELSE data END"
LEAN_COLUMNS = f"seq, time, request, conversation, kind, {LEAN_DATA}"
NOT_JSON = "payload is not JSON"
# (seq, request, conversation, kind) as SQLite returns it: a NamedTuple made of each row
# would cost recovery ~0.25 us an envelope, 3% of its time
Envelope = tuple[int, str | None, str | None, str]
_BATCH = 1024


class UnreadableEvent(JournalError):
    """The event at `seq` is in the journal but cannot be read: a kind this code does not
    know, or a payload that is not the kind's. (The one place its message is written.)"""

    def __init__(self, where: str | Path, seq: int, kind: str, why: object) -> None:
        super().__init__(f"journal {where}: undecodable {kind!r} event at seq {seq}: {why}")
        self.seq, self.kind = seq, kind

    @classmethod
    def unknown_kind(cls, where: str | Path, seq: int, kind: str) -> UnreadableEvent:
        return cls(where, seq, kind, f"unknown event kind {kind!r}")

    @classmethod
    def of_row(cls, where: str | Path, row: tuple, error: Exception) -> UnreadableEvent:
        """Why `from_row(*row)` raised `error`."""
        if isinstance(error, UnknownEventKind):
            return cls.unknown_kind(where, row[0], row[4])
        return cls(where, row[0], row[4], error)


class JournalReader:
    """Reads one journal through one SQLite connection; never writes it. Not thread-safe:
    another thread or process reads through its own (`reopen`)."""

    def __init__(self, conn: sqlite3.Connection, path: str, *, uri: str | None = None) -> None:
        """A reader on `conn`, a connection to a journal already checked (the writer's own);
        `uri`: how to connect again (`reopen`)."""
        self.conn, self.path, self.uri = conn, path, uri
        self._resolve: Resolver | None = None   # made at the first row that needs one

    @classmethod
    def open(cls, path: str | Path) -> JournalReader:
        """Open the journal at `path` read-only: SQLite `mode=ro`, and `immutable` when no WAL
        is beside it (nothing is writing it; no -wal or -shm file is left behind). JournalError
        naming the file: no such file, not a database, truncated, a foreign or newer schema, a
        damaged meta table. A torn WAL tail is logged, and the journal reads up to its last
        complete transaction."""
        where, file = str(path), Path(path)
        if not file.is_file():
            raise JournalError(f"journal {where}: no such file")
        tail = inspect_file(file)
        idle = not Path(f"{file}-wal").exists()
        reader = cls._connect(where, file.resolve().as_uri() + (
            "?mode=ro&immutable=1" if idle else "?mode=ro"))
        try:
            with sqlite_errors(where, "opening"):
                check_schema(reader.conn, where, new=False)
            reader.meta  # noqa: B018 - decoded once: a damaged meta table is refused here
        except BaseException:
            reader.close()
            raise
        warn_torn(where, tail)
        return reader

    @classmethod
    def _connect(cls, where: str, uri: str) -> JournalReader:
        with sqlite_errors(where, "opening"):
            return cls(sqlite3.connect(uri, uri=True), where, uri=uri)

    def reopen(self) -> JournalReader:
        """Another reader of the same file on a connection of its own (for another thread, or
        a forked process), without the checks again."""
        if self.uri is None:
            raise JournalError(f"journal {self.path}: this reader cannot connect again")
        return self._connect(self.path, self.uri)

    # --- what the journal holds --------------------------------------------------------

    @property
    def meta(self) -> dict[str, Any]:
        """The meta table, values decoded from JSON."""
        with self.errors("reading meta"):
            rows = self.conn.execute("SELECT key, value FROM meta").fetchall()
        try:
            return {key: json.loads(value) for key, value in rows}
        except (TypeError, ValueError) as e:
            raise JournalError(f"journal {self.path}: damaged meta table: {e}") from e

    def count(self) -> int:
        """The number of events (a scan of the table: callers keep it)."""
        with self.errors("counting events"):
            return self.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]

    def last_seq(self) -> int:
        """The seq of the last event; in a file without any, the one before its first (a
        rotated file continues its predecessor's seqs), 0 in a new journal."""
        with self.errors("reading last seq"):
            last = self.conn.execute("SELECT MAX(seq) FROM events").fetchone()[0]
            if last is None:
                row = self.conn.execute(
                    "SELECT value FROM meta WHERE key = 'first_seq'").fetchone()
                last = int(json.loads(row[0])) - 1 if row else 0
        return last

    def first_seq(self) -> int:
        """The seq of the first event (in a file without any, the next one's)."""
        with self.errors("reading first seq"):
            first = self.conn.execute("SELECT MIN(seq) FROM events").fetchone()[0]
        return first if first is not None else self.last_seq() + 1

    # --- events ------------------------------------------------------------------------

    def events(self, start_seq: int = 1, kinds: Sequence[str] | None = None, *,
               request: str | None = None, conversation: str | None = None,
               lean: bool = False) -> Iterator[Event]:
        """The events with seq >= start_seq in seq order, streamed from a cursor; only those
        of `kinds` (the store's fold reads only the kinds it folds), of `request`, of
        `conversation` when given. `lean`: without token ids (LEAN_DROP). UnreadableEvent
        at the first row that does not decode; what came before it was yielded."""
        decode = self.decode
        for row in self.rows(start_seq, kinds, request=request, conversation=conversation,
                             lean=lean):
            yield decode(row)

    def rows(self, start_seq: int = 1, kinds: Sequence[str] | None = None, *,
             request: str | None = None, conversation: str | None = None,
             lean: bool = False) -> Iterator[tuple]:
        """The rows `events` would decode, as they are: (seq, time, request, conversation,
        kind, data)."""
        sql, params = self._select(start_seq, kinds, request, conversation, lean)
        with self.errors("reading events"):
            cursor = self.conn.execute(sql, params)
            while rows := cursor.fetchmany(_BATCH):
                yield from rows

    def decode(self, row: tuple) -> Event:
        """The event of one row (seq, time, request, conversation, kind, data); its lists
        that name earlier rows' (schema version 3, `listrefs`) read from this journal."""
        try:
            if type(row[5]) is not str or "le@" not in row[5]:
                return from_row(*row)
            with self.resolving(row[0]):
                return from_row(*row)
        except Exception as e:  # any row that does not decode is the journal's fault
            raise UnreadableEvent.of_row(self.path, row, e) from e

    def readable(self, row: tuple) -> dict[str, Any]:
        """One row as `journal export` writes it: the envelope, kind and payload, its
        packed lists as lists (the ones that name earlier rows' read whole)."""
        seq, time, request, conversation, kind, data = row
        with self.resolving(seq):
            payload = ev.readable_payload(kind, json.loads(data))
        return {"seq": seq, "time": time, "request": request, "conversation": conversation,
                "kind": kind, "data": payload}

    @contextlib.contextmanager
    def resolving(self, seq: int) -> Iterator[None]:
        """A context in which the packed lists of the row at `seq` that name earlier rows
        are read from this journal (`events.token_ids`)."""
        if self._resolve is None:
            self._resolve = Resolver(self._fetch)
        token = ev.resolving(self._resolve.below(seq))
        try:
            yield
        finally:
            ev.reset_resolving(token)

    def _fetch(self, seq: int) -> tuple[str, str] | None:
        return self.conn.execute("SELECT kind, data FROM events WHERE seq = ?",
                                 (seq,)).fetchone()

    def envelopes(self, kinds: Sequence[str]) -> Iterator[Envelope]:
        """The envelopes (seq, request, conversation, kind) of the events of `kinds` in seq
        order, payloads left unread: who came and went, for recovery."""
        sql = (f"SELECT seq, request, conversation, kind FROM events WHERE kind IN "
               f"({','.join('?' * len(kinds))}) ORDER BY seq")
        with self.errors("reading events"):
            yield from self.conn.execute(sql, list(kinds))

    @staticmethod
    def _select(start_seq: int, kinds: Sequence[str] | None, request: str | None,
                conversation: str | None, lean: bool) -> tuple[str, list]:
        where, params = ["seq >= ?"], [start_seq]
        if kinds is not None:
            where.append(f"kind IN ({','.join('?' * len(kinds))})")
            params.extend(kinds)
        for column, value in (("request", request), ("conversation", conversation)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        columns = LEAN_COLUMNS if lean else COLUMNS
        return f"SELECT {columns} FROM events WHERE {' AND '.join(where)} ORDER BY seq", params

    # --- the caller's own SQL (the fast passes) ----------------------------------------

    def query(self, sql: str, params: Sequence = ()) -> sqlite3.Cursor:
        """A cursor over the caller's SELECT. SQLite's errors are the caller's to turn into
        JournalErrors: `errors` around it, or `failure` for one that stopped a pass."""
        return self.conn.execute(sql, params)

    def errors(self, doing: str) -> contextlib.AbstractContextManager[None]:
        """A context in which SQLite's errors become JournalErrors saying what was `doing`."""
        return sqlite_errors(self.path, doing)

    def failure(self, error: sqlite3.Error, after: int) -> JournalError:
        """What stopped a read of the events after seq `after` with SQLite's `error`: the
        first payload there that is not JSON (where SQLite's JSON functions stop), or, when
        there is none, the error itself."""
        try:
            bad = self.conn.execute("SELECT seq, kind FROM events WHERE seq > ? AND NOT "
                                    "json_valid(data) ORDER BY seq LIMIT 1", (after,)).fetchone()
        except sqlite3.Error:
            bad = None
        if bad is None:
            return sqlite_error(self.path, "reading events", error)
        return UnreadableEvent(self.path, bad[0], bad[1], NOT_JSON)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self.conn.close()

    def __enter__(self) -> JournalReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
