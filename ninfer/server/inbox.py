"""One request's events on the event loop: what the handoff delivers (handoff.py), taken by
the one task that follows the request (generation.py).

An `asyncio.Queue` with an `asyncio.timeout` around each wait cost a timer per token: a
`TimerHandle` pushed on the loop's heap and cancelled again at every event. The inbox keeps
one timer per request instead, re-armed lazily: a wait that ends with an event leaves it
armed, and when it fires before the current wait's deadline it is armed again for the rest.
A wait still ends with None exactly at its deadline, as `asyncio.timeout` ends it. The
timer's time is kept here: uvloop's handles have no `when()` (only asyncio's TimerHandle
has), and uvicorn runs on uvloop wherever it is installed."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class Inbox:
    """A FIFO of events with one waiter at a time. Create and use on the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._deadline: float | None = None       # the current wait's (None: no timeout)
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0                      # the loop time the timer fires at

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def get_nowait(self) -> Any:
        """The oldest item; IndexError when empty."""
        return self._items.popleft()

    async def get(self, timeout: float | None = None) -> Any:
        """The oldest item, waiting for one; None when `timeout` seconds pass first (None:
        wait as long as it takes)."""
        if self._items:
            return self._items.popleft()
        if self._waiter is not None:
            raise RuntimeError("an inbox has one reader")
        loop = self._loop
        waiter = self._waiter = loop.create_future()
        if timeout is not None:
            self._deadline = loop.time() + timeout
            if self._timer is None or self._timer_at > self._deadline:
                self._arm(self._deadline)
        try:
            await waiter
        finally:
            self._waiter = self._deadline = None
        return self._items.popleft() if waiter.result() else None

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(when, self._fired), when

    def _fired(self) -> None:
        when, self._timer = self._timer_at, None
        waiter, deadline = self._waiter, self._deadline
        if waiter is None or waiter.done() or deadline is None:
            return          # no wait (or one without a timeout): the next wait arms anew
        if when >= deadline:
            waiter.set_result(False)   # the wait's own deadline
        else:
            self._arm(deadline)        # armed for an earlier wait: on to this one's
