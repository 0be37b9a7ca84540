"""The event log: stamps events with their `seq`, folds them into the store at once, and
writes them to the journal in one transaction per engine step."""

from __future__ import annotations

import time
from collections.abc import Callable

from .events import Event, without_token_ids
from .store import ContinuationStore


class EventLog:
    def __init__(self, store: ContinuationStore, journal=None, *, last_seq: int = 0,
                 clock: Callable[[], float] = time.time, journal_tokens: bool = True) -> None:
        """`journal_tokens` False: output token ids reach listeners (the server streams
        them) but not the journal (`without_token_ids`)."""
        self.store = store
        self.journal_tokens = journal_tokens
        self.journal = journal
        self.seq = last_seq
        self.clock = clock
        self.pending: list[Event] = []
        self.listeners: list[Callable[[Event], None]] = []

    def emit(self, cls: type[Event], *, request: str | None = None,
             conversation: str | None = None, **fields) -> Event:
        """Create the next event, fold it into the store, queue it for the journal."""
        self.seq += 1
        event = cls(seq=self.seq, time=self.clock(), request=request,
                    conversation=conversation, **fields)
        self.store.apply(event)
        self.pending.append(event if self.journal_tokens else without_token_ids(event))
        for listener in self.listeners:
            listener(event)
        return event

    def flush(self) -> list[Event]:
        """Write the step's events to the journal as one transaction; return them."""
        batch, self.pending = self.pending, []
        if batch and self.journal is not None:
            self.journal.append(batch)
        return batch
