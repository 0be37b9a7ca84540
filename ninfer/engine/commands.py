"""What other threads hand the engine: the engine's configuration, and the commands it
applies at its next step boundary (submit, cancel, stop), with a submit's validation, in an
inbox any thread may write to."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..lifecycle.request import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 2
    prefill_chunk: int = 16
    spec: str = "none"               # none | mtp | ngram
    draft_tokens: int = 3
    adaptive_drafting: bool = True   # false: always draft_tokens (to measure a drafter)
    max_endpoints: int = 16
    endpoints_per_session: int = 4   # private endpoints (branches) one session key holds
    max_context: int = 4096
    auto_anchors: int = 2            # anchors at up to N of the last message boundaries
    journal_tokens: bool = True      # journal token ids, not only block hashes
    check_reuse: bool = False        # compare every restore with a recomputation (tests)
    keep_finished: bool = True       # keep ended requests in `requests` (tests inspect them)
    detach_prefills: bool = False    # a cut fresh prefill goes on, detached, for its retry
    # > 1: while lanes decode, a long prompt (over one chunk) prefills one chunk per step,
    # sized from measured step times so a decoding client waits at most this many decode
    # steps between tokens (pacing.py); 0: every prefilling lane takes a whole chunk a step
    decode_gap: float = 0.0
    # > 0: with a decode gap, a prompt of more than this many tokens is paced beside
    # decoding lanes, in chunks of at least this many (0: more than one prefill chunk, in
    # chunks of 16 or more). A GPU's: a forward costs ~20 ms of host time at any length, so
    # a smaller chunk only slows the prefill, and a bigger one stalls the streams longer
    paced_from: int = 0
    # > 0: a step that takes at least this long is logged with where its time went (what
    # it prefilled, the lanes it decoded, the device wait, the journal commit): what
    # stalled a stream, read from the server's log (None: not logged)
    slow_step_s: float | None = None

    def __post_init__(self) -> None:
        if self.paced_from < 0 or self.paced_from > self.prefill_chunk:
            raise ValueError("paced_from must be 0 .. prefill_chunk")
        if self.endpoints_per_session < 1:  # 0 is what older journals record: "one, replaced"
            raise ValueError("endpoints_per_session must be at least 1")


@dataclass(frozen=True)
class Submit:
    id: str
    prompt: tuple[int, ...]
    session: str | None
    tenant: str
    params: SamplingParams
    boundaries: tuple[int, ...] = ()
    shared_prefix: int = 0


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Stop:
    """End an active request as if it had stopped by itself (a stop string the server
    found in the text): it finishes and publishes, unlike a cancel."""

    id: str
    reason: str = "stop_string"


def _in_range(ids: tuple[int, ...], vocab_size: int) -> bool:
    """Every id in [0, vocab_size): one C pass through numpy (a 32K prompt took 0.8 ms as
    Python's `min` and `max`, ~2x that on a GPU machine's host, on the HTTP thread)."""
    try:
        a = np.fromiter(ids, dtype=np.int64, count=len(ids))
    except (OverflowError, TypeError, ValueError):
        return False
    return int(a.min()) >= 0 and int(a.max()) < vocab_size


def problem(c: Submit, *, vocab_size: int, max_context: int,
            end_tokens: tuple[int, ...] | None = None) -> str | None:
    """What is wrong with a submit, in words for the client, or None. `end_tokens`: the
    engine's grammars' (None: it constrains no output)."""
    if not c.prompt:
        return "prompt is empty"
    if not _in_range(c.prompt, vocab_size):
        return f"token ids must be in [0, {vocab_size})"
    if len(c.prompt) >= max_context:
        return f"prompt of {len(c.prompt)} tokens exceeds max_context {max_context}"
    if c.params.max_tokens < 1:
        return "max_tokens must be at least 1"
    if c.params.reasoning_budget is not None and (
            c.params.reasoning_budget < 0 or not c.params.reasoning_close
            or c.params.reasoning_end not in c.params.reasoning_close):
        return "a reasoning budget needs a close sequence that holds its end token"
    if any(not 0 <= t < vocab_size for t in c.params.reasoning_close):
        return f"reasoning close token ids must be in [0, {vocab_size})"
    if any(not 0 < b <= len(c.prompt) for b in c.boundaries):
        return "message boundaries must lie within the prompt"
    if not 0 <= c.shared_prefix <= len(c.prompt):
        return "shared_prefix must lie within the prompt"
    if any(not 0 <= t < vocab_size for t, _ in c.params.logit_bias):
        return f"logit_bias token ids must be in [0, {vocab_size})"
    if c.params.grammar is not None:
        if end_tokens is None:
            return "this engine has no tokenizer to constrain an output with"
        if not set(end_tokens) <= set(c.params.stop_tokens):
            return "a constrained request stops at its grammar's end tokens: they must be " \
                   "among its stop tokens"
    return None


Command = Submit | Cancel | Stop


class Inbox:
    """Commands from any thread, taken by the engine thread at a step boundary. Request ids
    are unique for the journal's whole life: recovery takes the ones it has seen."""

    def __init__(self, *, vocab_size: int, max_context: int,
                 end_tokens: tuple[int, ...] | None = None) -> None:
        self.vocab_size, self.max_context, self.end_tokens = vocab_size, max_context, end_tokens
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, command: Submit) -> None:
        """Validate (ValueError says what is wrong) and enqueue."""
        wrong = problem(command, vocab_size=self.vocab_size, max_context=self.max_context,
                        end_tokens=self.end_tokens)
        if wrong:
            raise ValueError(wrong)
        if not self.take_id(command.id):
            raise ValueError(f"request id {command.id} is already in use")
        self._queue.put(command)

    def take_id(self, request_id: str) -> bool:
        """Take a request id; False if it was taken."""
        with self._lock:
            if request_id in self._ids:
                return False
            self._ids.add(request_id)
            return True

    def put(self, command: Cancel | Stop) -> None:
        self._queue.put(command)

    def empty(self) -> bool:
        return self._queue.empty()

    def drain(self) -> Iterator[Command]:
        """The commands enqueued so far, in order."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return
