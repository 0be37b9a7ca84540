"""What other threads hand the engine: the engine's configuration, and the commands it
applies at its next step boundary (submit, cancel, stop), with a submit's validation."""

from __future__ import annotations

from dataclasses import dataclass

from ..lifecycle.request import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 2
    prefill_chunk: int = 16
    spec: str = "none"               # none | mtp | ngram
    draft_tokens: int = 3
    max_endpoints: int = 16
    endpoints_per_session: int = 4   # private endpoints (branches) one session key holds
    max_context: int = 4096
    auto_anchors: int = 2            # anchors at up to N of the last message boundaries
    journal_tokens: bool = True      # journal token ids, not only block hashes
    check_reuse: bool = False        # compare every restore with a recomputation (tests)
    keep_finished: bool = True       # keep ended requests in `requests` (tests inspect them)
    detach_prefills: bool = False    # a cut fresh prefill goes on, detached, for its retry

    def __post_init__(self) -> None:
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


def problem(c: Submit, *, vocab_size: int, max_context: int) -> str | None:
    """What is wrong with a submit, in words for the client, or None."""
    if not c.prompt:
        return "prompt is empty"
    if any(not 0 <= t < vocab_size for t in c.prompt):
        return f"token ids must be in [0, {vocab_size})"
    if len(c.prompt) >= max_context:
        return f"prompt of {len(c.prompt)} tokens exceeds max_context {max_context}"
    if c.params.max_tokens < 1:
        return "max_tokens must be at least 1"
    if any(not 0 < b <= len(c.prompt) for b in c.boundaries):
        return "message boundaries must lie within the prompt"
    if not 0 <= c.shared_prefix <= len(c.prompt):
        return "shared_prefix must lie within the prompt"
    return None
