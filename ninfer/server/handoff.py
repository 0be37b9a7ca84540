"""Events from the engine thread to the event loop, handed over in batches: one wake-up of
the loop carries every event released since the last one was taken (a step's tokens for all
its streams), where a `call_soon_threadsafe` per event wrote the loop's self-pipe once per
token and woke the loop as often. The engine thread `put`s a step's events, then `release`s
them: waking the loop at the first `put` let it run (the self-pipe's write gives up the
interpreter lock) with that stream's token alone and take the step's others in a second
wake-up."""

from __future__ import annotations

import asyncio
import threading
import weakref

from ..lifecycle import events as ev
from .inbox import Inbox

_HANDOFFS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class Handoff:
    """Puts events into the queues of one loop (a request's `Inbox`, or an asyncio queue),
    from any other thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)   # the registry's key: held weakly, so it can go
        self._lock = threading.Lock()
        self._pending: list[tuple[Inbox | asyncio.Queue, ev.Event]] = []
        self._waking = False             # a wake-up is on its way and takes what is pending

    def put(self, queue: Inbox | asyncio.Queue, event: ev.Event) -> None:
        """`queue.put_nowait(event)` on the loop once released; events keep their order."""
        with self._lock:
            self._pending.append((queue, event))

    def release(self) -> None:
        """Wake the loop for the events put so far, unless a wake-up on its way takes them."""
        with self._lock:
            if not self._pending or self._waking:
                return
            self._waking = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: nobody is left to read these
            with self._lock:
                self._pending.clear()
                self._waking = False
            raise

    def _deliver(self) -> None:  # on the loop's thread
        with self._lock:
            batch, self._pending, self._waking = self._pending, [], False
        for queue, event in batch:
            queue.put_nowait(event)


def handoff_for(loop: asyncio.AbstractEventLoop) -> Handoff:
    """The loop's one `Handoff` (created on first use)."""
    with _LOCK:
        handoff = _HANDOFFS.get(loop)
        if handoff is None:
            handoff = _HANDOFFS[loop] = Handoff(loop)
        return handoff
