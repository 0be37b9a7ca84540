"""Reasoning budgets on every API: how many tokens the model may reason before the server
closes its reasoning block itself (the engine commits the close as if chosen:
engine/budget.py), and how each API's request names one.

A request's budget, first found: its own number (Anthropic's `thinking.budget_tokens`),
else its effort through the table below (chat completions' `reasoning_effort`, the Responses
API's `reasoning.effort`, Anthropic's `output_config.effort` with adaptive thinking), else
the server's `--reasoning-budget` (none by default: the model reasons until it closes the
block or runs out of tokens). Each API's adapter resolves it into the request type underneath
(`UnifiedRequest.reasoning_budget`); the one path underneath (submission.py) applies it with
`bounded`, so it is enforced on every API.

| effort  | budget (tokens) |
| ---     | ---             |
| none    | 0: thinking off (the template's switch; a template without one closes at once) |
| minimal | 256             |
| low     | 1,024           |
| medium  | 4,096           |
| high    | 16,384          |
| xhigh   | 32,768          |
| max     | no budget       |

The budget counts the output tokens of the reasoning block, from the first one. It binds only
where the prompt left a reasoning block open (the template's generation prompt opened it);
the output limit (`max_tokens`) still counts every token.
"""

from __future__ import annotations

import dataclasses

from ..lifecycle.request import SamplingParams
from ..model.tokenizer import Tokenizer
from .parsing import ANSWER_GAP, THINK_CLOSE

EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16_384,
    "xhigh": 32_768, "max": None,
}

# what the chat template writes after a turn's reasoning: the parser splits it off
# (server/parsing.py), so a forced close leaves no mark in the reasoning or the answer; a
# grammar that holds the answer starts with the same gap (reply_grammar.py), so its mask
# never refuses the close
CLOSE_TEXT = "\n" + THINK_CLOSE + ANSWER_GAP


def budget_for_effort(effort: str | None, default: int | None) -> int | None:
    """The budget an effort names (the table above); `default` when none is named."""
    if effort is None:
        return default
    if effort not in EFFORT_BUDGETS:
        raise ValueError(f"unknown reasoning effort {effort!r}; one of "
                         f"{', '.join(EFFORT_BUDGETS)}")
    return EFFORT_BUDGETS[effort]


def bounded(params: SamplingParams, budget: int | None, tokenizer: Tokenizer
            ) -> SamplingParams:
    """`params` with the reasoning budget the engine enforces; unchanged for no budget, or
    for a tokenizer without an end-of-thinking token (nothing could close the block)."""
    end = tokenizer.special.think_end
    if budget is None or end is None:
        return params
    close = tuple(tokenizer.encode(CLOSE_TEXT))
    if end not in close:
        return params
    return dataclasses.replace(params, reasoning_budget=budget, reasoning_close=close,
                               reasoning_end=end)
