"""Choosing tokens: greedily from a model's greedy tokens (no torch), or by sampling from
its logits with the request's sampling parameters (ninfer.engine.sampling, torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..lifecycle.request import SamplingParams
from .speculative import accept_greedy


class Choice(Protocol):
    def draft(self, greedy: int, logits: Any, before: Sequence[int] = ()) -> tuple[int, Any]:
        """A draft token and the distribution it was drawn from (None: a point mass);
        `before`: the round's drafts before it."""

    def next(self, greedy: int, logits: Any) -> int:
        """The token after a prefill (the first token)."""

    def accept(self, drafts: Sequence[int], greedy: Sequence[int], logits: Any,
               draft_probs: list[Any] | None) -> tuple[int, int]:
        """(drafts accepted, the verifier's next token)."""


class GreedyChoice:
    def draft(self, greedy: int, logits: Any, before: Sequence[int] = ()) -> tuple[int, Any]:
        return greedy, None

    def next(self, greedy: int, logits: Any) -> int:
        return greedy

    def accept(self, drafts, greedy, logits, draft_probs) -> tuple[int, int]:
        accepted = accept_greedy(drafts, greedy)
        return accepted, greedy[accepted]


def needs_sampling(params: SamplingParams) -> bool:
    return params.temperature > 0 or params.penalised


def make_choice(params: SamplingParams, history: list[int], prompt: Sequence[int] = ()
                ) -> Choice:
    """`history` is the request's output list (penalties read it as it grows); `prompt`
    its prompt (the repetition penalty counts its tokens too)."""
    if not needs_sampling(params):
        return GreedyChoice()
    from .sampling import SampledChoice
    return SampledChoice(params, history, prompt)
