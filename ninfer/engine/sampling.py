"""Sampling from logits: penalties, temperature, top-k / top-p / min-p, seeded draws, top-n
logprobs, and speculative acceptance (greedy, or rejection sampling that keeps the target
model's distribution exactly)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    temperature: float = 0.0          # 0: greedy
    top_k: int = 0                    # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0   # 1: off
    seed: int | None = None
    min_tokens: int = 0               # the stop tokens held back before this many outputs
    stop_tokens: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def apply_penalties(logits: torch.Tensor, history: Sequence[int], cfg: SamplingConfig,
                    prompt_ids: torch.Tensor | None = None) -> torch.Tensor:
    """OpenAI's presence / frequency penalties over the tokens generated so far (history),
    then the repetition penalty (vLLM's and transformers' sense) over every token of the
    history or of the prompt (prompt_ids: its distinct tokens, `distinct`): a positive
    logit divided by it, a negative one multiplied; and while the history is shorter than
    `min_tokens`, the stop tokens ruled out.
    logits: [V] or [N, V] (the same history for every row)."""
    out = logits
    if history and (cfg.presence_penalty != 0.0 or cfg.frequency_penalty != 0.0):
        ids, counts = torch.tensor(list(history)).unique(return_counts=True)
        penalty = cfg.frequency_penalty * counts.to(logits.dtype) + cfg.presence_penalty
        out = out.clone()
        out[..., ids] -= penalty
    if cfg.repetition_penalty != 1.0 and (history or prompt_ids is not None):
        ids = distinct(history) if prompt_ids is None else \
            torch.cat([prompt_ids, distinct(history)]).unique()
        seen = out[..., ids]
        out = out.clone()
        out[..., ids] = torch.where(seen > 0, seen / cfg.repetition_penalty,
                                    seen * cfg.repetition_penalty)
    if len(history) < cfg.min_tokens and cfg.stop_tokens:  # too early to stop
        out = out.clone()
        out[..., list(cfg.stop_tokens)] = float("-inf")
    return out


def distinct(tokens: Sequence[int]) -> torch.Tensor:
    """The distinct token ids of a sequence, as an int64 tensor (sorted)."""
    return torch.tensor(list(tokens), dtype=torch.int64).unique()


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution a token is drawn from: temperature, then top-k, top-p and min-p
    filters (renormalised). logits: [..., V] -> probs [..., V], float64 for exactness."""
    logits = logits.to(torch.float64)
    if cfg.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    # shifted so the largest is 0 before dividing: a tiny temperature sends the others to
    # -inf (probability 0), never inf - inf (NaN)
    shifted = logits - logits.amax(-1, keepdim=True)
    probs = torch.softmax(shifted / cfg.temperature, dim=-1)
    if cfg.top_k > 0 and cfg.top_k < probs.shape[-1]:
        kth = probs.topk(cfg.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs >= kth, probs, 0.0)
    if cfg.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        keep_sorted = before < cfg.top_p * sorted_p.sum(-1, keepdim=True)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    if cfg.min_p > 0.0:
        floor = cfg.min_p * probs.amax(-1, keepdim=True)
        probs = torch.where(probs >= floor, probs, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V], drawn where `generator` is (a request's is on the CPU, so
    a seed draws alike on every device; a GPU's probs go there first)."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def top_logprobs(logits: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens with their log-probabilities (of the unfiltered model)."""
    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    values, ids = logp.topk(n)
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]


def token_logprobs(rows: torch.Tensor, tokens, n: int) -> tuple[dict, ...]:
    """For each chosen token (row i of logits [k, V] predicted tokens[i]): its
    log-probability and the top n alternatives, as OpenAI reports them (tokens a mask ruled
    out, at -inf, are no alternatives)."""
    logp = torch.log_softmax(rows.to(torch.float64), dim=-1)
    out = []
    for row, token in zip(logp, tokens, strict=False):
        values, ids = row.topk(n)
        top = [[int(i), float(v)] for i, v in zip(ids, values, strict=True) if v > -math.inf]
        out.append({"token": int(token), "logprob": float(row[token]), "top": top})
    return tuple(out)


def accept_drafts(drafts: Sequence[int], target: torch.Tensor, draft: torch.Tensor | None,
                  cfg: SamplingConfig, generator: torch.Generator | None
                  ) -> tuple[int, int]:
    """Speculative acceptance. target: probs [k+1, V] of the verifier at [pending, d1..dk];
    draft: probs [k, V] the drafter drew d1..dk from (None for a deterministic drafter such
    as n-gram lookup, whose proposal is a point mass). Returns (accepted, next token).

    Greedy: accept while the draft is the target's argmax; the next token is the argmax.
    Otherwise rejection sampling: accept d_i with probability min(1, p(d_i) / q(d_i)); at
    the first rejection draw from norm(max(0, p - q)); after k acceptances draw the bonus
    token from p. The tokens produced are distributed exactly as the target's."""
    k = len(drafts)
    for i, token in enumerate(drafts):
        p = target[i]
        q = draft[i] if draft is not None else _point_mass(token, p)
        if cfg.greedy:
            if int(p.argmax()) != token:
                return i, int(p.argmax())
            continue
        ratio = float(p[token] / q[token]) if q[token] > 0 else 0.0
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u >= min(1.0, ratio):
            residual = torch.clamp(p - q, min=0.0)
            total = residual.sum()
            return i, draw(residual / total if total > 0 else p, generator)
    return k, int(target[k].argmax()) if cfg.greedy else draw(target[k], generator)


def _point_mass(token: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


class SampledChoice:
    """The Choice protocol (ninfer.engine.choice) over logits, for one request: its own
    seeded generator, penalties over its output so far (and its prompt, for the repetition
    penalty), its logit bias and its grammar's masks (`constraint`, a
    ninfer.engine.constraint.Constraint). Without logits (SimModel), greedy (the grammar's
    lowest allowed token where it refuses the greedy one)."""

    def __init__(self, params, history: list[int], prompt: Sequence[int] = (),
                 constraint=None) -> None:
        self.cfg = SamplingConfig(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            min_p=params.min_p, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, seed=params.seed,
            min_tokens=params.min_tokens, stop_tokens=tuple(params.stop_tokens))
        self.history = history
        self.penalised = params.penalised
        self.prompt_ids = distinct(prompt) if prompt and self.cfg.repetition_penalty != 1.0 \
            else None
        self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64)
        self.bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float64)
        self.constraint = constraint
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def shaped(self, logits: torch.Tensor, drafts: Sequence[int] = ()) -> torch.Tensor:
        """The logits as this request sees them before any choice: its logit bias added,
        tokens its grammar refuses at -inf. logits [V] following the output and then
        `drafts`, or rows [n, V] where row i follows drafts[:i]."""
        if self.bias.numel():
            logits = logits.to(torch.float64).clone()
            logits[..., self.bias_ids] += self.bias
        if self.constraint is not None:
            if logits.dim() == 1:
                allowed = self.constraint.masks(drafts)[-1]
            else:
                allowed = self.constraint.masks(drafts[:logits.shape[0] - 1])
            logits = logits.masked_fill(~allowed, -math.inf)
        return logits

    def _probs(self, logits: torch.Tensor, drafts: Sequence[int] = ()) -> torch.Tensor:
        """The distributions of the next tokens: logits [V] following the output and then
        `drafts`, or a verify's rows [k+1, V] (row i follows the first i of `drafts`): the
        penalties count the drafts before each position too."""
        logits = self.shaped(logits, drafts)
        if not self.penalised:
            return probabilities(logits, self.cfg)
        if logits.dim() == 1:
            history = [*self.history, *drafts] if drafts else self.history
            return probabilities(_keep_some(
                apply_penalties(logits, history, self.cfg, self.prompt_ids), logits), self.cfg)
        return torch.stack([
            probabilities(_keep_some(apply_penalties(row, [*self.history, *drafts[:i]],
                                                     self.cfg, self.prompt_ids), row), self.cfg)
            for i, row in enumerate(logits)])

    def admit(self, drafts: Sequence[int]) -> int:
        return len(drafts) if self.constraint is None else self.constraint.admissible(drafts)

    def prepare(self, drafts: Sequence[int]) -> None:
        if self.constraint is not None:
            self.constraint.prefetch(drafts)

    @property
    def _argmax(self) -> bool:
        """Greedy over shaped logits alone (no penalties): the argmax, no distribution."""
        return self.cfg.greedy and not self.penalised

    def draft(self, greedy: int, logits, before: Sequence[int] = ()):
        if logits is None:
            return greedy, None
        if self._argmax:  # a point mass: greedy acceptance reads no draft distribution
            return int(self.shaped(logits, before).argmax()), None
        q = self._probs(logits, before)
        return draw(q, self.generator), q

    def next(self, greedy: int, logits) -> int:
        if logits is None:
            return greedy if self.constraint is None else self.constraint.pick(greedy)
        if self._argmax:
            return int(self.shaped(logits).argmax())
        return draw(self._probs(logits), self.generator)

    def accept(self, drafts, greedy, logits, draft_probs) -> tuple[int, int]:
        if logits is None or self._argmax:
            from .speculative import accept_greedy
            if logits is not None:
                greedy = self.shaped(logits, drafts).argmax(-1).tolist()
            elif self.constraint is not None:
                greedy = [self.constraint.pick(g, drafts[:i]) for i, g in enumerate(greedy)]
            n = accept_greedy(drafts, greedy)
            return n, greedy[n]
        q = torch.stack(draft_probs) if draft_probs and draft_probs[0] is not None else None
        return accept_drafts(drafts, self._probs(logits, drafts), q, self.cfg, self.generator)


def _keep_some(penalised: torch.Tensor, shaped: torch.Tensor) -> torch.Tensor:
    """The penalised logits, unless they rule out every token the grammar allows (stop
    tokens held back by min_tokens where only the end may come): then the grammar's."""
    if bool((penalised > -math.inf).any()):
        return penalised
    return shaped
