"""Choosing tokens: greedily from a model's greedy tokens (no torch), or from its logits
with the request's sampling parameters, logit bias and grammar (ninfer.engine.sampling and
ninfer.engine.constraint, torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..lifecycle.request import SamplingParams
from .speculative import accept_greedy

if TYPE_CHECKING:
    from .grammar import Grammars


class Choice(Protocol):
    def draft(self, greedy: int, logits: Any, before: Sequence[int] = ()) -> tuple[int, Any]:
        """A draft token and the distribution it was drawn from (None: a point mass);
        `before`: the round's drafts before it."""

    def next(self, greedy: int, logits: Any) -> int:
        """The token after a prefill (the first token)."""

    def accept(self, drafts: Sequence[int], greedy: Sequence[int], logits: Any,
               draft_probs: list[Any] | None) -> tuple[int, int]:
        """(drafts accepted, the verifier's next token)."""

    def admit(self, drafts: Sequence[int]) -> int:
        """How many of a round's drafts may be verified, in order (a grammar cuts them at
        the first it refuses, before the verify)."""

    def shaped(self, logits: Any, drafts: Sequence[int] = ()) -> Any:
        """The logits as the choice sees them (logit bias added, a grammar's mask applied),
        row i following the output and then drafts[:i]: what log-probabilities report."""

    def prepare(self, drafts: Sequence[int]) -> None:
        """The round's verify of `drafts` starts: begin what accepting it will need (a
        grammar's masks), to overlap the forward."""


class GreedyChoice:
    def draft(self, greedy: int, logits: Any, before: Sequence[int] = ()) -> tuple[int, Any]:
        return greedy, None

    def next(self, greedy: int, logits: Any) -> int:
        return greedy

    def accept(self, drafts, greedy, logits, draft_probs) -> tuple[int, int]:
        accepted = accept_greedy(drafts, greedy)
        return accepted, greedy[accepted]

    def admit(self, drafts: Sequence[int]) -> int:
        return len(drafts)

    def shaped(self, logits: Any, drafts: Sequence[int] = ()) -> Any:
        return logits

    def prepare(self, drafts: Sequence[int]) -> None:
        pass


def needs_sampling(params: SamplingParams) -> bool:
    return params.temperature > 0 or params.penalised


def make_choice(params: SamplingParams, history: list[int], prompt: Sequence[int] = (),
                grammars: Grammars | None = None) -> Choice:
    """`history` is the request's output list (penalties and the grammar read it as it
    grows); `prompt` its prompt (the repetition penalty counts its tokens too); `grammars`
    compiles the request's grammar (ninfer.engine.grammar)."""
    if not needs_sampling(params) and not params.shaped:
        return GreedyChoice()
    from .sampling import SampledChoice
    constraint = None
    if params.grammar is not None:
        if grammars is None:
            raise ValueError("this engine has no tokenizer to constrain an output with")
        from .constraint import Constraint
        constraint = Constraint(grammars.matcher(params.grammar), history,
                                after=params.grammar_after, end_tokens=grammars.end_tokens,
                                vocab_size=grammars.vocab_size, prefetch=grammars.prefetch)
    return SampledChoice(params, history, prompt, constraint)
