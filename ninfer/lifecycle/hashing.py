"""Token-prefix hashing: the fold and the planner match prefixes on these, never on ids."""

from __future__ import annotations

import hashlib
from array import array

HASH_BLOCK = 16  # tokens per hashed block; independent of the KV block size
TAIL = 64  # a prefix's last ids, compared before the rest (`starts_with`)


def _digest(prev: int, tokens) -> int:
    h = hashlib.blake2b(prev.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens) -> tuple[int, ...]:
    """Chained hashes of every full HASH_BLOCK of `tokens`."""
    return extend_block_hashes(tokens, ())


def extend_block_hashes(tokens, known: tuple[int, ...]) -> tuple[int, ...]:
    """`block_hashes(tokens)`, given `known`: the block hashes of some prefix of `tokens`
    (the chain makes them the leading ones), so only the blocks past it are hashed."""
    full = len(tokens) // HASH_BLOCK
    if full <= len(known):
        return known[:full]
    out = list(known)
    prev = known[-1] if known else 0
    for start in range(len(known) * HASH_BLOCK, full * HASH_BLOCK, HASH_BLOCK):
        prev = _digest(prev, tokens[start:start + HASH_BLOCK])
        out.append(prev)
    return tuple(out)


def prefix_hash(tokens, position: int, hashes: tuple[int, ...]) -> int:
    """Hash of tokens[:position], given `hashes` = block_hashes(tokens) (or a longer prefix's)."""
    full = position // HASH_BLOCK
    prev = hashes[full - 1] if full else 0
    if position % HASH_BLOCK == 0:
        return prev
    return _digest(prev, tokens[full * HASH_BLOCK:position])


def starts_with(tokens, prefix, hashes: tuple[int, ...] = (),
                prefix_hashes: tuple[int, ...] = ()) -> bool:
    """`tokens[:len(prefix)] == prefix`, decided on the ids. Most pairs that differ are
    rejected in O(1) first: on the last block hash both have (`hashes`, `prefix_hashes`:
    block hashes of each, or of a prefix of each), then on the prefix's last `TAIL` ids (two
    branches of a conversation differ in their last messages, and end alike, in the chat
    template's tokens); a pair that passes is compared in full (at 32K of context a full
    comparison takes ~0.1-0.3 ms on a CPU, about three times that on a GPU machine's
    host)."""
    n = len(prefix)
    if n > len(tokens):
        return False
    full = min(n // HASH_BLOCK, len(hashes), len(prefix_hashes))
    if full and hashes[full - 1] != prefix_hashes[full - 1]:
        return False
    tail = max(n - TAIL, 0)
    if tokens[tail:n] != prefix[tail:n]:
        return False
    return tail == 0 or tokens[:tail] == prefix[:tail]
