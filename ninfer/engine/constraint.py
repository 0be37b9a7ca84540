"""One request's grammar state: which tokens its grammar allows at each position of a round.

The matcher's state is a pure function of the grammar and the request's committed output:
`Constraint` follows the output list as it grows and feeds the matcher the tokens after the
grammar's start (the first `after` token, the end of the reasoning block, when the request
has one). A request rebuilt after a preemption, or resumed from an endpoint, builds a new
Constraint over the output it has: the same state.

A round asks for masks beyond the committed output: row i of a verify follows the output
and then the round's first i drafts. The matcher is advanced over the drafts, a mask taken
at each, and rolled back, so it always rests at the committed output. Before the grammar
starts (reasoning) every token is allowed but the end tokens: a reply cannot end before its
constrained part has come.

With `prefetch` (a large vocabulary, where a mask costs as much as a GPU's decode step) a
round's masks are computed in a worker thread while its verify forward runs (llguidance
releases the GIL): `prefetch(drafts)` starts them, and every other call waits for them
first, so the matcher is only ever used by one thread at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .grammar import ConstraintError

# masks computed while a verify runs, for every constrained lane of the batch
_WORKERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ninfer-masks")


class Constraint:
    def __init__(self, matcher, history: list[int], *, after: int | None,
                 end_tokens: Sequence[int], vocab_size: int, prefetch: bool = False) -> None:
        """`matcher`: a fresh llguidance matcher of the grammar; `history`: the request's
        output list (read as it grows, never written); `after`: the token that starts the
        grammar (None: it starts at the first output token); `prefetch`: a round's masks
        are computed while its verify runs."""
        self.matcher, self.history, self.after = matcher, history, after
        self.prefetching = prefetch
        self._pending: Future | None = None
        self.vocab_size = vocab_size
        self.end_tokens = tuple(end_tokens)
        self.start: int | None = 0 if after is None else None  # output index the grammar
        self.seen = 0                                          # starts at; outputs fed
        self._words = torch.zeros(-(-vocab_size // 32), dtype=torch.int32)  # the bitmask
        self._bytes = self._words.numpy().view(np.uint8)
        self._free = torch.ones(vocab_size, dtype=torch.bool)
        self._free[list(self.end_tokens)] = False
        self._only_end = ~self._free
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}
        self._memo_at = -1

    # --- the committed output ------------------------------------------------------------

    def _settle(self) -> None:
        """Wait for masks computing in a worker (their errors are raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def prefetch(self, tokens: Sequence[int]) -> None:
        """Start the masks `masks(tokens)` will return, in a worker (when prefetching)."""
        if self.prefetching:
            self._settle()
            self._pending = _WORKERS.submit(self._rows, tuple(tokens))

    def _sync(self) -> None:
        """Feed the matcher the committed tokens it has not seen."""
        n = len(self.history)
        if self.seen >= n:
            return
        if self.start is None and self.after in self.history[self.seen:n]:
            self.start = self.history.index(self.after, self.seen) + 1
        if self.start is not None:
            tokens = self.history[max(self.seen, self.start):n]
            if tokens and not self.matcher.consume_tokens(tokens):
                raise ConstraintError(f"the grammar refused a committed token: "
                                      f"{self.matcher.get_error() or 'invalid'}")
        self.seen = n

    @property
    def started(self) -> bool:
        """Whether the committed output has reached the grammar's start."""
        self._settle()
        self._sync()
        return self.start is not None

    # --- a round's positions -------------------------------------------------------------

    def masks(self, tokens: Sequence[int] = ()) -> torch.Tensor:
        """Allowed tokens [len(tokens) + 1, V] (bool): row i after the committed output and
        then tokens[:i]. `tokens` must be ones the grammar admits (`admissible`)."""
        self._settle()
        return self._rows(tokens)

    def _rows(self, tokens: Sequence[int]) -> torch.Tensor:
        self._sync()
        if self._memo_at != len(self.history):
            self._memo, self._memo_at = {}, len(self.history)
        key = tuple(tokens)
        if all(key[:i] in self._memo for i in range(len(key) + 1)):
            return torch.stack([self._memo[key[:i]] for i in range(len(key) + 1)])
        rows, fed = [], 0
        started, ended = self.start is not None, False
        try:
            for i in range(len(key) + 1):
                if i:
                    token = key[i - 1]
                    # an end token is never fed while drafts are: llguidance's matcher does
                    # not roll back over its stop; the reply ends there (rows after it are
                    # dropped with it)
                    ended = ended or (started and token in self.end_tokens)
                    if started and not ended:
                        if not self.matcher.consume_token(token):
                            raise ConstraintError(f"the grammar refused token {token}: "
                                                  f"{self.matcher.get_error()}")
                        fed += 1
                    elif token == self.after:
                        started = True
                if key[:i] not in self._memo:
                    self._memo[key[:i]] = (self._only_end if ended else self._mask_now()
                                           if started else self._free)
                rows.append(self._memo[key[:i]])
        finally:
            if fed and not self.matcher.rollback(fed):
                raise ConstraintError("the grammar could not roll a round's drafts back")
        return torch.stack(rows)

    def _mask_now(self) -> torch.Tensor:
        """The matcher's allowed tokens at its state ([V] bool); the end tokens alone once
        the grammar allows nothing more (after its end token)."""
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar failed: {self.matcher.get_error()}")
        self.matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar failed: {self.matcher.get_error()}")
        # numpy's unpacking is ~5x torch's shifts at a 152K vocabulary (bench constrained)
        bits = np.unpackbits(self._bytes, count=self.vocab_size, bitorder="little")
        allowed = torch.from_numpy(bits.view(np.bool_))
        return allowed if bool(allowed.any()) else self._only_end

    def admissible(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (drafts after the committed output) the grammar admits, in
        order: the rest is cut before the verify."""
        self._settle()
        self._sync()
        if self.start is not None:
            return self.matcher.validate_tokens(list(tokens))
        for i, token in enumerate(tokens):
            if token in self.end_tokens:
                return i          # the reply cannot end inside its reasoning
            if token == self.after:
                return i + 1 + self.matcher.validate_tokens(list(tokens[i + 1:]))
        return len(tokens)

    def pick(self, token: int, tokens: Sequence[int] = ()) -> int:
        """`token` if the grammar allows it after the output and `tokens`, else the lowest
        id it allows (the choice of a model without logits)."""
        allowed = self.masks(tokens)[-1]
        return token if bool(allowed[token]) else int(allowed.nonzero()[0])
