"""Speculative rounds, model-agnostic: n-gram drafting and greedy acceptance."""

from __future__ import annotations

from collections.abc import Sequence


def ngram_draft(tokens: Sequence[int], k: int, n: int = 2) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens."""
    if k <= 0 or len(tokens) <= n:
        return []
    tail = list(tokens[-n:])
    for start in range(len(tokens) - n - 1, -1, -1):
        if list(tokens[start:start + n]) == tail:
            follow = list(tokens[start + n:start + n + k])
            if follow:
                return follow
    return []


def accept_greedy(drafts: Sequence[int], greedy: Sequence[int]) -> int:
    """Length of the longest prefix of `drafts` the verifier agrees with.

    greedy[j] is the verifier's token after position j of [pending, d1, ..., dk]; draft
    d_{j+1} is accepted while it equals greedy[j]."""
    accepted = 0
    for draft, verified in zip(drafts, greedy, strict=False):
        if draft != verified:
            break
        accepted += 1
    return accepted


def truncate(new_tokens: list[int], room: int,
             stop_tokens: Sequence[int]) -> tuple[int, str | None]:
    """How many of `new_tokens` to commit given `room` left, and the stop reason if any."""
    for i, token in enumerate(new_tokens[:room]):
        if token in stop_tokens:
            return i + 1, "stop_token"
    if len(new_tokens) >= room:
        return room, "max_tokens"
    return len(new_tokens), None
