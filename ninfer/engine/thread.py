"""The engine thread: the only thread that touches the machine, the store and the journal.

Other threads call `submit` and `cancel`, which validate and enqueue; each request's events
reach its `Handle` through a queue (the server streams from it)."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from ..lifecycle import events as ev
from .engine import Engine, Submit


@dataclass(eq=False)
class Handle:
    id: str
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    done: threading.Event = field(default_factory=threading.Event)
    outcome: ev.Event | None = None   # the terminal event

    def wait(self, timeout: float | None = None) -> ev.Event | None:
        self.done.wait(timeout)
        return self.outcome


class EngineThread:
    def __init__(self, engine: Engine, *, idle_wait: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait = idle_wait
        self._handles: dict[str, Handle] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._running = False
        self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
        self.error: BaseException | None = None
        engine.log.listeners.append(self._route)

    def start(self) -> EngineThread:
        self._running = True
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._running = False
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, command: Submit) -> Handle:
        """Validate (raises ValueError) and enqueue; the handle follows the request."""
        handle = Handle(command.id)
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
        self.engine.cancel(request_id)
        self._wake.set()

    def _route(self, event: ev.Event) -> None:  # runs on the engine thread
        if event.request is None:
            return
        with self._lock:
            handle = self._handles.get(event.request)
            if handle is not None and event.kind in ev.TERMINAL_KINDS:
                del self._handles[event.request]
        if handle is None:
            return
        handle.events.put(event)
        if event.kind in ev.TERMINAL_KINDS:
            handle.outcome = event
            handle.done.set()

    def _loop(self) -> None:
        try:
            while self._running:
                if self.engine.idle():
                    self._wake.wait(self.idle_wait)
                    self._wake.clear()
                    continue
                self.engine.step()
        except BaseException as exc:  # surfaced to whoever owns the thread
            self.error = exc
            raise
