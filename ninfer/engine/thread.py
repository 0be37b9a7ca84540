"""The engine thread: the only thread that touches the machine, the store and the journal.

Other threads call `submit` and `cancel`, which validate and enqueue; each request's events
reach its `Handle` through a queue (the server streams from it), and through the handle's
optional `on_event` callback (the server bridges it into its event loop). `call(fn)` runs a
function on the engine thread between two steps (metrics snapshots, operator evictions)."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..lifecycle import events as ev
from ..model.protocol import ModelLost
from .engine import Engine, Submit

log = logging.getLogger("ninfer.engine")


@dataclass(eq=False)
class Handle:
    id: str
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    done: threading.Event = field(default_factory=threading.Event)
    outcome: ev.Event | None = None   # the terminal event
    on_event: Callable[[ev.Event], None] | None = None  # called on the engine thread
    # called on the engine thread once every event of a batch (a step's, across all handles)
    # reached its handle: a consumer can wake its reader once per batch, not per event
    on_released: Callable[[], None] | None = None
    cancel_asked: float | None = None     # monotonic time of the first cancel
    cancel_step: int | None = None        # engine.steps when the cancel was asked
    cancel_latency: float | None = None   # seconds from the cancel to RequestCancelled
    cancel_steps: int | None = None       # engine steps begun between the two

    def wait(self, timeout: float | None = None) -> ev.Event | None:
        self.done.wait(timeout)
        return self.outcome


class EngineThread:
    """`step_delay` (seconds) sleeps after every engine step: a test and demo aid that
    slows the model down so a client can place a disconnect in a chosen phase."""

    def __init__(self, engine: Engine, *, idle_wait: float = 0.05,
                 step_delay: float = 0.0) -> None:
        self.engine = engine
        self.idle_wait = idle_wait
        self.step_delay = step_delay
        self._handles: dict[str, Handle] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._running = False
        self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
        self.error: BaseException | None = None
        self.cancel_latencies: list[tuple[float, int]] = []  # (seconds, steps), bounded
        self.on_cancel_latency: Callable[[float, int], None] | None = None
        # events reach the handles once their step is committed to the journal: a client is
        # never told of a token or an ending that a crash could take back
        self._uncommitted: list[ev.Event] = []
        engine.log.listeners.append(self._uncommitted.append)

    @property
    def model_lost(self) -> bool:
        """The loop stopped because the model was lost (a tensor-parallel rank gone)."""
        return isinstance(self.error, ModelLost)

    @property
    def native(self) -> threading.Thread:
        """The thread the loop runs on (benchmarks read its CPU clock)."""
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def start(self) -> EngineThread:
        self._running = True
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._running = False
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, command: Submit, *,
               on_event: Callable[[ev.Event], None] | None = None,
               on_released: Callable[[], None] | None = None) -> Handle:
        """Validate (raises ValueError) and enqueue; the handle follows the request.
        `on_event` is set before the request can emit anything, so it sees every event;
        `on_released` follows each batch that held one of them (see `Handle`)."""
        if self.error is not None:
            raise RuntimeError(f"the engine thread stopped: {self.error!r}")
        handle = Handle(command.id, on_event=on_event, on_released=on_released)
        with self._lock:
            if command.id in self._handles:
                raise ValueError(f"request id {command.id} is already in use")
            self._handles[command.id] = handle
        try:
            self.engine.submit(command)
        except ValueError:
            with self._lock:
                self._handles.pop(command.id, None)
            raise
        self._wake.set()
        return handle

    def cancel(self, request_id: str) -> None:
        with self._lock:
            handle = self._handles.get(request_id)
            if handle is not None and handle.cancel_asked is None:
                handle.cancel_asked = time.monotonic()
                handle.cancel_step = self.engine.steps
        self.engine.cancel(request_id)
        self._wake.set()

    def stop_request(self, request_id: str, reason: str = "stop_string") -> None:
        """End an active request as finished (it publishes what it computed)."""
        self.engine.stop_request(request_id, reason)
        self._wake.set()

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread at the next step boundary."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.error is not None or not self._thread.is_alive():
            future.set_exception(RuntimeError("the engine thread is not running"))
            return future
        self._calls.put((fn, future))
        self._wake.set()
        return future

    def _release(self) -> None:
        """Route the events the journal now holds (called after each commit), then tell
        the handles that had one that the batch is complete."""
        if not self._uncommitted:
            return
        events = self._uncommitted[:]
        self._uncommitted.clear()
        reached = {}
        for handle, event in self._route(events):
            if event.kind in ("RequestCancelled", "PrefillDetached") \
                    and handle.cancel_asked is not None:
                handle.cancel_latency = time.monotonic() - handle.cancel_asked
                handle.cancel_steps = self.engine.steps - (handle.cancel_step or 0)
                self._record_cancel(handle.cancel_latency, handle.cancel_steps)
            self._deliver(handle, event)
            reached[handle.id] = handle
        self._released(reached.values())

    def _route(self, events: list[ev.Event]) -> list[tuple[Handle, ev.Event]]:
        """Each event with its request's handle, those nobody follows left out; a handle
        leaves the table with its request's last event for the client. One lock a batch."""
        routed = []
        with self._lock:
            handles = self._handles
            for event in events:
                rid = event.request
                handle = handles.get(rid) if rid is not None else None
                if handle is not None:
                    if event.kind in ev.CLIENT_END_KINDS:
                        del handles[rid]
                    routed.append((handle, event))
        return routed

    def _deliver(self, handle: Handle, event: ev.Event) -> None:
        handle.events.put(event)
        if event.kind in ev.CLIENT_END_KINDS:
            handle.outcome = event
        if handle.on_event is not None:
            try:
                handle.on_event(event)
            except Exception:  # a consumer's bug must not stop the engine
                log.exception("event consumer of %s failed", handle.id)
        if event.kind in ev.CLIENT_END_KINDS:
            handle.done.set()

    def _released(self, handles) -> None:
        for handle in handles:
            if handle.on_released is not None:
                try:
                    handle.on_released()
                except Exception:  # a consumer's bug must not stop the engine
                    log.exception("event consumer of %s failed", handle.id)

    def _record_cancel(self, seconds: float, steps: int) -> None:
        self.cancel_latencies.append((seconds, steps))
        del self.cancel_latencies[:-1000]
        if self.on_cancel_latency is not None:
            self.on_cancel_latency(seconds, steps)

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(self.engine)
                    self._release()  # what it emitted, the engine committed (evict, say)
                    future.set_result(result)
                except Exception as exc:
                    future.set_exception(exc)

    def _loop(self) -> None:
        try:
            while self._running:
                self._run_calls()
                if self.engine.idle():
                    self._wake.wait(self.idle_wait)
                    self._wake.clear()
                    continue
                self.engine.step()
                self._release()
                if self.step_delay:
                    time.sleep(self.step_delay)
        except BaseException as exc:  # surfaced to whoever owns the thread (`alive`,
            # `submit`), logged here once with its traceback: not raised again, which would
            # only print it a second time through threading's excepthook
            self.error = exc
            log.critical("engine thread stopped: %r", exc, exc_info=True)
            if isinstance(exc, ModelLost):  # the engine committed its requests' failures
                self._release()
            self._abandon(exc)
        finally:
            self._run_calls()  # nobody waits forever on a call made while stopping

    def _abandon(self, exc: BaseException) -> None:
        """The loop died: end every open handle with a RequestFailed (not journaled), so
        no client waits forever."""
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            failed = ev.RequestFailed(request=handle.id, failure="interrupted" if isinstance(
                exc, ModelLost) else "internal",
                                      message=f"engine stopped: {exc!r}")
            self._deliver(handle, failed)
        self._released(handles)
