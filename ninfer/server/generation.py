"""One request's generation as the HTTP side sees it: submit to the engine thread, follow
its events through an inbox (inbox.py; the event loop never waits on model work), turn tokens
into text, reasoning and tool calls, and cancel at once when asked (client gone, stop
string, pending timeout)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ..engine.engine import Submit
from ..lifecycle import events as ev
from ..lifecycle.request import SamplingParams
from . import logs
from .bodies import PromptTokensDetails, Timings, Usage
from .errors import ApiError
from .handoff import handoff_for
from .history import Known
from .inbox import Inbox
from .parsing import Delta, OutputParser, StopScanner, merged

log = logging.getLogger("ninfer.server")


@dataclass(frozen=True)
class Settings:
    """Server options the HTTP side needs."""

    model_id: str
    max_context: int
    default_max_tokens: int = 512
    derive_session_keys: bool = True
    api_keys: tuple[str, ...] = ()
    max_pending: int = 64
    pending_timeout: float = 600.0
    max_body_bytes: int = 8 * 2**20
    keepalive_s: float = 5.0
    spec: str = "none"
    grammar_timeout: float = 10.0   # seconds a request's grammar may take to compile
    reasoning_budget: int | None = None     # reasoning tokens before the server closes it
    model_aliases: tuple[str, ...] = ()     # more names the served model answers to
    claude_names: bool = True               # the Messages API serves any claude-* name


class Generation:
    """Follows one engine request. Create and use on the event loop's thread."""

    def __init__(self, server, *, route: str, prompt: tuple[int, ...], session: str | None,
                 tenant: str, params: SamplingParams, boundaries: tuple[int, ...] = (),
                 shared_prefix: int = 0, stops: tuple[str, ...] = (),
                 parser: OutputParser | None = None, arrival: float | None = None,
                 prompt_text: str | None = None) -> None:
        self.server = server
        self.id = server.next_request_id()
        self.route = route
        self.prompt, self.session, self.tenant, self.params = prompt, session, tenant, params
        self.prompt_text = prompt_text
        self.outputs: list[int] = []
        self.logprobs: list[dict] = []   # per committed token, when asked for
        self.logprobs_sent = 0           # how many of them a stream has sent
        self.boundaries, self.shared_prefix = boundaries, shared_prefix
        self.arrival = arrival if arrival is not None else time.time()
        self.loop = asyncio.get_running_loop()
        self.queue = Inbox(self.loop)
        self.handoff = handoff_for(self.loop)
        self.detok = server.tokenizer.stream()
        self.hidden_ids = frozenset(params.stop_tokens)
        self.stops = StopScanner(stops)
        self.parser = parser
        self.phase = "queue"
        self.plan: str | None = None
        self.reuse_base = 0
        self.started_at: float | None = None
        self.first_at: float | None = None      # the engine's time of the first token
        self.first_seen: float | None = None    # when it reached the server (its TTFT)
        self.last_at: float | None = None
        self.completion_tokens = 0
        self.drafted = self.accepted = 0
        self.stop_reason: str | None = None
        self.terminal: ev.Event | None = None
        self.finished: ev.RequestFinished | None = None
        self.cancel_reason: str | None = None   # disconnect | stop_string | timeout
        self.cancel_phase: str | None = None
        self.handle = None
        self._pending = False
        self._reported = False

    # --- engine side ------------------------------------------------------------------------

    def submit(self) -> None:
        settings = self.server.settings
        metrics = self.server.metrics
        if metrics.pending >= settings.max_pending:
            raise ApiError(429, f"too many requests waiting ({metrics.pending}); retry later",
                           code="queue_full", retry_after=1)
        command = Submit(self.id, self.prompt, self.session, self.tenant, self.params,
                         boundaries=self.boundaries, shared_prefix=self.shared_prefix)
        try:
            self.handle = self.server.thread.submit(command, on_event=self._from_engine,
                                                    on_released=self.handoff.release)
        except ValueError as exc:  # the engine's own validation: the request is at fault
            raise ApiError(400, str(exc)) from exc
        except RuntimeError as exc:
            raise ApiError(503, "the engine is not running", code="engine_stopped",
                           retry_after=5) from exc
        metrics.pending += 1
        self._pending = True

    def _from_engine(self, event: ev.Event) -> None:  # engine thread
        self.handoff.put(self.queue, event)

    def cancel(self, reason: str) -> None:
        """Ask the engine to cancel now (at its next step boundary). Idempotent."""
        if self.cancel_reason is None and self.terminal is None:
            self.cancel_reason, self.cancel_phase = reason, self.phase
            self.server.thread.cancel(self.id)

    def _unpend(self) -> None:
        if self._pending:
            self._pending = False
            self.server.metrics.pending -= 1

    # --- following events ---------------------------------------------------------------

    async def next_event(self, timeout: float | None = None) -> ev.Event | None:
        """The next event, or None on timeout."""
        return await self.queue.get(timeout)

    async def wait_started(self) -> list[Delta]:
        """Until the request starts (or ends); raises 503 after the pending timeout. Returns
        deltas of events seen on the way (normally none)."""
        deadline = time.monotonic() + self.server.settings.pending_timeout
        out: list[Delta] = []
        while self.phase == "queue" and self.terminal is None:
            left = deadline - time.monotonic()
            event = await self.next_event(max(left, 0.0)) if left > 0 else None
            if event is None:
                self.cancel("timeout")
                while self.terminal is None:
                    out += self.absorb(await self.queue.get())
                if self.cancelled:
                    self.report()
                    raise ApiError(503, "the request waited too long for a free lane",
                                   code="pending_timeout", retry_after=2)
                break
            out += self.absorb(event)
        return out

    def absorb(self, event: ev.Event) -> list[Delta]:
        """Update bookkeeping with one event; the text deltas it releases."""
        if isinstance(event, ev.TokensCommitted):  # first: nearly every event is one
            if self.first_at is None:
                # the time to first token is until the token reached the server, as the
                # client meets it: its step's journal commit and delivery included
                self.first_at, self.first_seen = event.time, time.time()
                self.phase = "decode"
                self.server.metrics.first_token(self.first_seen - self.arrival)
            self.last_at = event.time
            self.completion_tokens += len(event.tokens)
            self.outputs.extend(event.tokens)
            if event.logprobs:
                self.logprobs.extend(event.logprobs)
            self.drafted += event.drafted
            self.accepted += event.accepted
            if self.stops.hit:
                return []
            text = self.detok.push([t for t in event.tokens if t not in self.hidden_ids])
            text = self.stops.push(text)
            if self.stops.hit and self.cancel_reason is None:
                # the turn ends here, as finished: the engine publishes its state for reuse
                self.cancel_reason, self.cancel_phase = "stop_string", self.phase
                self.server.thread.stop_request(self.id)
            return self._parse(text)
        elif isinstance(event, ev.RequestStarted):
            self._unpend()
            self.plan, self.reuse_base, self.phase = event.plan, event.reuse_base, "prefill"
            self.started_at = self.started_at or event.time
        elif isinstance(event, ev.StopReached):
            self.stop_reason, self.phase = event.reason, "finishing"
        elif event.kind in ev.CLIENT_END_KINDS:
            self._unpend()
            self.terminal, self.phase = event, "done"
            self._remember()
            if isinstance(event, ev.RequestFinished):
                self.finished = event
                if event.cached_tokens != self.reuse_base:
                    log.warning("%s: RequestFinished.cached_tokens %d != plan reuse base %d",
                                self.id, event.cached_tokens, self.reuse_base)
            if self.succeeded:
                tail = "" if self.stops.hit else self.stops.push(self.detok.finish())
                tail += self.stops.finish()
                out = self._parse(tail)
                if self.parser is not None:
                    out += self.parser.finish()
                return out
        return []

    def absorb_ready(self, event: ev.Event) -> list[Delta]:
        """Absorb `event` and every event already queued behind it, up to the terminal one:
        tokens ready together (a step's, or several steps' when the loop fell behind) give
        their text as one delta of each kind in turn, so a stream sends them in one event."""
        out = self.absorb(event)
        while self.terminal is None and not self.queue.empty():
            out += self.absorb(self.queue.get_nowait())
        return merged(out)

    def _remember(self) -> None:
        """The conversation's computed text and ids, for encoding its next turn."""
        if self.prompt_text is None or self.session is None:
            return
        if isinstance(self.terminal, ev.RequestFailed):
            return
        output = tuple(self.outputs)
        text = self.server.tokenizer.decode(output) if output else ""
        self.server.history.remember(self.tenant, self.session, [
            Known(self.prompt_text, self.prompt), Known(self.prompt_text + text,
                                                         self.prompt + output)])

    def _parse(self, text: str) -> list[Delta]:
        if self.parser is None:
            return [Delta("content", text)] if text else []
        return self.parser.push(text) if text else []

    async def run_to_end(self) -> list[Delta]:
        """Absorb events until the terminal one (also taken from the handle, should an
        event have been lost to a cancelled wait)."""
        out: list[Delta] = []
        while self.terminal is None:
            event = await self.next_event(0.5)
            if event is None and self.handle is not None and self.handle.done.is_set():
                await asyncio.sleep(0.05)  # let queued deliveries land first
                while not self.queue.empty() and self.terminal is None:
                    out += self.absorb(self.queue.get_nowait())
                if self.terminal is None:
                    out += self.absorb(self.handle.outcome)
            elif event is not None:
                out += self.absorb(event)
        return out

    # --- results ------------------------------------------------------------------------

    @property
    def cancelled(self) -> bool:
        """Ended for the client by a cancel: cancelled, or its prefill detached (going on
        without it, for a retry)."""
        return isinstance(self.terminal, ev.RequestCancelled | ev.PrefillDetached)

    @property
    def succeeded(self) -> bool:
        return isinstance(self.terminal, ev.RequestFinished) or (
            isinstance(self.terminal, ev.RequestCancelled) and self.cancel_reason == "stop_string")

    @property
    def finish_reason(self) -> str:
        if self.stop_reason in ("max_tokens", "context_limit") and not self.stops.hit:
            return "length"
        if self.parser is not None and self.parser.calls:
            return "tool_calls"
        return "stop"

    @property
    def outcome(self) -> str:
        if self.succeeded:
            return self.finish_reason
        if self.cancelled:
            return {"disconnect": "cancelled", "timeout": "timeout"}.get(self.cancel_reason or "",
                                                                         "cancelled")
        return "failed"

    def usage(self) -> Usage:
        prompt = len(self.prompt)
        return Usage(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                     total_tokens=prompt + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.reuse_base))

    def timings(self) -> Timings:
        prompt_n = len(self.prompt) - self.reuse_base
        prompt_ms = 1000 * ((self.first_at or 0) - (self.started_at or 0)) if self.first_at else 0.0
        predicted_ms = 1000 * ((self.last_at or 0) - (self.first_at or 0))
        n = self.completion_tokens
        return Timings(
            cache_n=self.reuse_base, prompt_n=prompt_n, prompt_ms=round(prompt_ms, 3),
            prompt_per_token_ms=round(prompt_ms / prompt_n, 4) if prompt_n else 0.0,
            prompt_per_second=round(1000 * prompt_n / prompt_ms, 2) if prompt_ms else 0.0,
            predicted_n=n, predicted_ms=round(predicted_ms, 3),
            predicted_per_token_ms=round(predicted_ms / n, 4) if n else 0.0,
            predicted_per_second=(round(1000 * (n - 1) / predicted_ms, 2)
                                  if predicted_ms and n > 1 else 0.0))

    def failure(self) -> ApiError:
        """The error for a request that ended without an answer."""
        t = self.terminal
        if isinstance(t, ev.RequestFailed) and t.failure == "capacity":
            return ApiError(503, "not enough KV memory for this request now",
                            code="capacity", retry_after=2)
        if isinstance(t, ev.RequestFailed) and t.failure == "invalid":
            return ApiError(400, t.message)
        if isinstance(t, ev.RequestFailed) and t.failure == "interrupted":
            return ApiError(503, "the model was lost (a tensor-parallel rank stopped); the "
                            "server restarts", code="engine_stopped", retry_after=5)
        return ApiError(500, "internal error while generating", code="internal_error")

    def report(self, status: int | None = None) -> None:
        """Metrics and the log line(s) of a request that has ended (once)."""
        if self._reported:
            return
        self._reported = True
        metrics = self.server.metrics
        outcome = self.outcome
        metrics.request_done(self.route, outcome, self.plan or "none", prompt=len(self.prompt),
                             completion=self.completion_tokens, cached=self.reuse_base,
                             drafted=self.drafted, accepted=self.accepted)
        now = time.time()
        prefill_s = (self.first_at - self.started_at) if self.first_at and self.started_at else 0
        decode_s = (self.last_at - self.first_at) if self.first_at and self.last_at else 0
        line = logs.request_line(
            f"req#{self.id}", self.route, outcome, prompt=len(self.prompt),
            output=self.completion_tokens, cached=self.reuse_base, plan=self.plan,
            ttft=(self.first_seen - self.arrival) if self.first_seen else None,
            total=now - self.arrival, prefill_s=prefill_s, decode_s=decode_s,
            spec=self.server.settings.spec, drafted=self.drafted, accepted=self.accepted)
        if isinstance(self.terminal, ev.RequestFailed):
            log.error("%s | %s", line, self.terminal.message)
        else:
            log.info(line)
        if self.cancel_reason == "disconnect":
            status = 499
            handle = self.handle
            log.info(logs.disconnect_line(f"req#{self.id}", self.route, self.cancel_phase or "?",
                                          handle.cancel_latency if handle else None,
                                          handle.cancel_steps if handle else None))
        if status is not None:
            metrics.response(status)
