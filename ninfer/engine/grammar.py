"""Grammars an output may be held to, compiled against the served model's tokenizer.

A grammar is llguidance's grammar text (the server builds it from a request's format:
ninfer/server/formats.py). `Grammars.compile` checks and compiles it once, bounded by
llguidance's resource limits, and caches the result under the text's hash
(`lifecycle.request.grammar_hash`); every request gets a copy of the compiled matcher, so a
request's grammar state starts the same however often the grammar is used.

No torch here: the server compiles (and refuses) grammars before anything is queued. And
llguidance is imported when grammars are first made, so the engine loads without it (the
GPU machine's benches carry no wheel of it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..lifecycle.request import grammar_hash

# Compile time is bounded by llguidance's fuel limits (the lexer's work to build a grammar,
# ~50k units/ms, and per token; the Earley items per token), kept at its defaults, and by
# the server's timeout around `compile`
MAX_GRAMMAR_BYTES = 512 * 1024   # the grammar text (a tool list's schemas run to tens of KB)
# from this vocabulary up a round's masks are computed while its verify runs: at 152K tokens a
# mask costs ~0.2-0.6 ms, a GPU decode step's order; at 4K ~25 us, less than handing it over
PREFETCH_VOCAB = 32_768


class GrammarError(ValueError):
    """A grammar that cannot constrain an output: malformed, using what is not supported,
    too large or too complex. The message names the problem, for the client."""


class ConstraintError(RuntimeError):
    """A request's grammar cannot go on: its matcher refused a committed token or ran out
    of its per-token budget (a grammar too complex at that point)."""


class Grammars:
    """Compiles grammars for one tokenizer and caches them by hash (least recently used
    dropped past `cache` entries). Thread-safe: the server compiles, the engine copies.

    `end_tokens` are the ids that end a reply (the model's end-of-text ones): the only
    tokens a complete grammar allows, and none of them while a reply's reasoning lasts."""

    def __init__(self, tokenizer_json: str, vocab_size: int, end_tokens: Sequence[int], *,
                 cache: int = 64, prefetch: bool | None = None) -> None:
        """`prefetch`: compute a round's masks while its verify runs (None: from
        PREFETCH_VOCAB tokens up)."""
        if not end_tokens:
            raise ValueError("a grammar needs at least one end-of-text token")
        self.vocab_size = vocab_size
        self.end_tokens = tuple(sorted(set(end_tokens)))
        import llguidance
        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(self.end_tokens))
        self.limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()   # hash -> a pristine matcher
        self._size = cache
        self._lock = threading.Lock()
        self.compiled = 0            # grammars compiled (cache misses), for tests and metrics
        self.prefetch = vocab_size >= PREFETCH_VOCAB if prefetch is None else prefetch

    def compile(self, grammar: str) -> str:
        """Check and compile `grammar` (or find it compiled); its hash. Raises GrammarError
        naming what is wrong."""
        key = grammar_hash(grammar)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return key
        size = len(grammar.encode("utf-8"))
        if size > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"the grammar is {size:,} bytes, over the limit of "
                               f"{MAX_GRAMMAR_BYTES:,}")
        failed, messages = self._llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer, limits=self.limits)
        if failed:
            raise GrammarError(_one_line(messages[0]))
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(_one_line(matcher.get_error()))
        with self._lock:
            self.compiled += 1
            self._cache[key] = matcher
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return key

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher of `grammar` (at its start), compiled once."""
        key = self.compile(grammar)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                return pristine.deep_copy()
        # dropped between the two looks by a burst of other grammars: compile this one anew
        return self._llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self.limits)

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, **kw) -> Grammars:
        """For a `ninfer.model.tokenizer.Tokenizer` (its tokenizer.json, its stop ids)."""
        return cls(tokenizer.json_text, vocab_size, sorted(tokenizer.special.stop_ids), **kw)


def _one_line(message: str) -> str:
    """llguidance's message on one line, without the caret lines of its source excerpts."""
    lines = [line.strip() for line in message.strip().splitlines()]
    text = " ".join(line for line in lines if line and set(line) != {"^"})
    return text[:500] if text else "the grammar is invalid"
