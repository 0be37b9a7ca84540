"""Reasoning budgets: a request that has written its budget of reasoning without closing the
reasoning block gets the tokens that close it committed as if the model had chosen them;
the model then goes on from there to its answer.

The budget is three request parameters (`SamplingParams.reasoning_budget`,
`reasoning_close`, `reasoning_end`), journaled with the request in `RequestQueued`, so a
`journal redrive` forces the same tokens at the same positions. The forcing lives in the
token choice: `budgeted` wraps whatever choice the request has (greedy, sampled, or the
recorded tokens of a redrive), so prefill's first token, drafts and speculative acceptance
all see it. A forced token is committed like any other (the next round feeds it), so every
state part covers it exactly as if it had been sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..lifecycle.request import SamplingParams
from .choice import Choice, GreedyChoice


class ForcedClose:
    """Which token an output position must be: output `budget + i` is `close[i]`, unless
    the model wrote the end token itself within its budget."""

    def __init__(self, params: SamplingParams, outputs: list[int]) -> None:
        self.budget, self.close = params.reasoning_budget, params.reasoning_close
        self.end, self.outputs = params.reasoning_end, outputs

    def at(self, position: int) -> int | None:
        """The token output `position` (0: the first output) is forced to, or None."""
        offset = position - self.budget
        if not 0 <= offset < len(self.close):
            return None
        if self.end in self.outputs[:self.budget]:  # closed by the model: nothing to force
            return None
        return self.close[offset]


class ClosingChoice:
    """A `Choice` (engine/choice.py) that commits the forced close at its positions and
    leaves every other position to `inner`. `outputs` is the request's output list (the
    pending token, committed but not fed yet, is its last)."""

    def __init__(self, inner: Choice, forced: ForcedClose, outputs: list[int]) -> None:
        self.inner, self.forced, self.outputs = inner, forced, outputs

    def draft(self, greedy: int, logits: Any, before: Sequence[int] = ()) -> tuple[int, Any]:
        token = self.forced.at(len(self.outputs) + len(before))
        if token is not None:  # drafting the forced token: the verify then accepts it
            return token, None
        return self.inner.draft(greedy, logits, before)

    def next(self, greedy: int, logits: Any) -> int:
        chosen = self.inner.next(greedy, logits)
        token = self.forced.at(len(self.outputs))
        return chosen if token is None else token

    def accept(self, drafts: Sequence[int], greedy: Sequence[int], logits: Any,
               draft_probs: list[Any] | None) -> tuple[int, int]:
        base = len(self.outputs)  # draft i is output base + i; the verifier's, base + accepted
        at = self.forced.at
        first = next((i for i in range(len(drafts) + 1) if at(base + i) is not None), None)
        if first is None:
            return self.inner.accept(drafts, greedy, logits, draft_probs)
        if first > 0:  # the positions before the close are the inner choice's to judge
            accepted, token = self.inner.accept(
                drafts[:first], greedy[:first + 1], None if logits is None else logits[:first + 1],
                None if draft_probs is None else draft_probs[:first])
            if accepted < first:
                return accepted, token
        # a draft equal to the forced token is accepted; the close's last token is always a
        # round's own token, so the position after it is chosen by the next round
        i = first
        while i < len(drafts) and drafts[i] == at(base + i) and at(base + i + 1) is not None:
            i += 1
        return i, at(base + i)

    # a grammar's masks and cuts are the inner choice's: before the grammar starts (at the end
    # of the reasoning) it allows every token but end-of-text, and after the end token it
    # starts with the blank line the close ends with, so it never refuses the close
    def admit(self, drafts: Sequence[int]) -> int:
        return self.inner.admit(drafts)

    def shaped(self, logits: Any, drafts: Sequence[int] = ()) -> Any:
        return self.inner.shaped(logits, drafts)

    def prepare(self, drafts: Sequence[int]) -> None:
        self.inner.prepare(drafts)


class ClosingGreedy(ClosingChoice, GreedyChoice):
    """A greedy request under a budget is still greedy for the rounds' fast path (no logits
    read, steps run ahead on the greedy token): at the close's few positions the token fed
    is not the greedy one, and the model drops the step it ran ahead (model/protocol.py),
    which costs only that step's time."""


def budgeted(choice: Choice, params: SamplingParams, outputs: list[int]) -> Choice:
    """`choice` under the request's reasoning budget; `choice` itself when it has none."""
    if params.reasoning_budget is None or not params.reasoning_close:
        return choice
    kind = ClosingGreedy if isinstance(choice, GreedyChoice) else ClosingChoice
    return kind(choice, ForcedClose(params, outputs), outputs)
