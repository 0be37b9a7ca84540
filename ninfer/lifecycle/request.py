"""A request: the model object the shared lifecycle machine drives.

Its `state` changes only through `machine.fire`. The guards named in
specs/lifecycle.toml are methods here, and pure questions: what a transition needs that
the request does not hold (a salvage decision) is decided by the engine first and passed
as the trigger's arguments.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from . import adoption, salvage
from .eventlog import EventLog
from .facts import Mode
from .hashing import extend_block_hashes
from .planner import Plan


class TokensSoFar(Sequence[int]):
    """A request's prompt and outputs as one sequence, read in place: an item or a slice
    copies only what it returns."""

    __slots__ = ("prompt", "outputs")

    def __init__(self, prompt: tuple[int, ...], outputs: list[int]) -> None:
        self.prompt, self.outputs = prompt, outputs

    def __len__(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[int, ...]: ...

    def __getitem__(self, i: int | slice) -> int | tuple[int, ...]:
        p = len(self.prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return (self.prompt + tuple(self.outputs))[i]
            if stop <= p:
                return self.prompt[start:stop]
            if start >= p:
                return tuple(self.outputs[start - p:stop - p])
            return self.prompt[start:] + tuple(self.outputs[:stop - p])
        n = len(self)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError("index out of range")
        return self.prompt[j] if j < p else self.outputs[j - p]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    stop_tokens: tuple[int, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0    # 1 for none (prompt and output tokens, vLLM's sense)
    min_tokens: int = 0                # no stop token chosen before this many outputs
    seed: int | None = None
    logprobs: int = 0                  # top-n log-probabilities per token, 0 for none
    # added to a token's logit before anything else (OpenAI's logit_bias), (id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None         # what the output must match (llguidance's grammar text)
    grammar_after: int | None = None   # the grammar applies after this token (the end of the
    #                                    reasoning block); None: from the first output token
    # a reasoning budget (engine/budget.py): when `reasoning_budget` outputs are written and
    # none of them is `reasoning_end`, the next outputs are `reasoning_close`, committed as
    # if chosen; None: no budget
    reasoning_budget: int | None = None
    reasoning_close: tuple[int, ...] = ()
    reasoning_end: int | None = None

    @property
    def penalised(self) -> bool:
        """Whether a position's logits are changed by the tokens before it (the penalties,
        or stop tokens held back by min_tokens)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1 or (self.min_tokens > 0 and bool(self.stop_tokens)))

    @property
    def shaped(self) -> bool:
        """Whether the logits are changed before any choice: a logit bias, a grammar's mask."""
        return bool(self.logit_bias) or self.grammar is not None

    def to_dict(self, content: bool = True) -> dict[str, Any]:
        """The parameters as RequestQueued journals them (the shaping and the budget fields
        only when set); without `content` (a journal that keeps no token ids) the grammar's
        text is replaced by its hash."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__ if f not in _SHAPING}
        out["stop_tokens"] = list(self.stop_tokens)
        if self.logit_bias:
            out["logit_bias"] = [list(pair) for pair in self.logit_bias]
        if self.grammar is not None:
            out["grammar_after"] = self.grammar_after
            if content:
                out["grammar"] = self.grammar
            else:
                out["grammar_hash"] = grammar_hash(self.grammar)
        if self.reasoning_budget is None:  # journaled only when set: most requests have none
            for name in ("reasoning_budget", "reasoning_close", "reasoning_end"):
                del out[name]
        else:
            out["reasoning_close"] = list(self.reasoning_close)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Parameters back from `to_dict` (fields a journal lacks take their defaults; a
        grammar hash without its text is dropped: there is nothing to constrain with)."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        known["stop_tokens"] = tuple(known.get("stop_tokens", ()))
        known["logit_bias"] = tuple((int(t), float(b)) for t, b in known.get("logit_bias", ()))
        known["reasoning_close"] = tuple(known.get("reasoning_close", ()))
        return cls(**known)


_SHAPING = ("logit_bias", "grammar", "grammar_after")


def grammar_hash(grammar: str) -> str:
    """The name a grammar is cached and journaled under: its text's SHA-256, in hex."""
    return hashlib.sha256(grammar.encode("utf-8")).hexdigest()


@dataclass(eq=False)
class Request:
    id: str
    prompt: tuple[int, ...]
    session: str | None
    tenant: str
    log: EventLog
    mode: Mode
    params: SamplingParams = field(default_factory=SamplingParams)
    boundaries: tuple[int, ...] = ()   # message boundaries: anchor candidates
    shared_prefix: int = 0             # end of the stable shared prefix, 0 if none
    journal_tokens: bool = True        # journal token ids, not only block hashes

    state: str = "Queued"
    outputs: list[int] = field(default_factory=list)
    plan: Plan | None = None
    cursor: int = 0                    # the state frontier: tokens whose state is computed
    stop_reason: str | None = None
    failure: tuple[str, str] | None = None
    hashes: tuple[int, ...] = ()       # the prompt's block hashes (given: a prefix's)

    def __post_init__(self) -> None:
        # `hashes` given: a prefix's, checked by the caller (the chain extends them)
        self.hashes = extend_block_hashes(self.prompt, self.hashes)

    # --- derived ------------------------------------------------------------------------

    @property
    def sequence(self) -> tuple[int, ...]:
        """Prompt plus committed output: what a (re)start plans and prefills against."""
        return self.prompt + tuple(self.outputs)

    @property
    def so_far(self) -> TokensSoFar:
        """`sequence` without the copy (a decode round's drafting, verify and commit read a
        few of its tokens; copying 32K of context cost ~40 us each, three times a round,
        on every lane): a view that follows the outputs as they grow."""
        return TokensSoFar(self.prompt, self.outputs)

    @property
    def last_token(self) -> int:
        """The sequence's last token (the one a decode round feeds)."""
        return self.outputs[-1] if self.outputs else self.prompt[-1]

    @property
    def target(self) -> int:
        """Frontier to reach before decoding: the last output token is never fed yet."""
        return len(self.prompt) + max(len(self.outputs) - 1, 0)

    @property
    def sequence_hashes(self) -> tuple[int, ...]:
        """Block hashes of `sequence` (the prompt's are computed once, at admission; only
        the output's blocks are hashed here)."""
        return extend_block_hashes(self.so_far, self.hashes) if self.outputs else self.hashes

    @property
    def detached_goal(self) -> int:
        """Where a detached prefill stops and publishes: the last prompt position but one,
        so that the same prompt sent again plans from it (a plan feeds at least one token)."""
        return len(self.prompt) - 1

    @property
    def prefill_goal(self) -> int:
        """The frontier this request's prefill runs to."""
        return self.detached_goal if self.state == "Detached" else self.target

    @property
    def reuse_base(self) -> int:
        return self.plan.reuse_base if self.plan else 0

    def emit(self, cls, **fields):
        return self.log.emit(cls, request=self.id, conversation=self.session, **fields)

    # --- guards (named in specs/lifecycle.toml) -----------------------------------------

    def has_plan(self, _event=None) -> bool:
        return self.plan is not None and self.plan.reuse_base < len(self.so_far)

    def prefill_done(self, _event=None) -> bool:
        return self.cursor == self.target

    def fresh_prefill(self, _event=None) -> bool:
        """Nothing decoded yet and prompt left to prefill: what a detached prefill needs."""
        return not self.outputs and self.cursor < self.detached_goal

    def adoptable(self, event) -> bool:
        """The trigger's `adopter` may take over this detached prefill (adoption.py)."""
        return adoption.refusal(self, event.kwargs["adopter"]) is None

    def salvage_ok(self, event) -> bool:
        """The salvage decided before the trigger publishes the frontier."""
        return salvage_of(event).frontier_ok


def salvage_of(event) -> salvage.Salvage:
    """The `salvage` argument of a finish / cancel / preempt trigger (`machine.fire(request,
    "cancel", salvage=decision)`): what the engine decided to publish and refuse."""
    decision = event.kwargs.get("salvage")
    if not isinstance(decision, salvage.Salvage):
        raise TypeError(f"{event.event.name} needs salvage=<Salvage>, got {decision!r}")
    return decision
