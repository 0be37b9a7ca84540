"""Value types the journal records: the server's mode, checkpoint facts, endpoint facts.

Facts are what the predicate judges. They describe a checkpoint's state parts (which
positions each part covers) without holding the parts: tensors never enter the journal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

SPEC_MODES = ("none", "mtp", "ngram")

# lists a journal row packs (`events.pack`): long (a prompt's, a checkpoint's prefix's), and
# JSON of 32K token ids costs 7x their packing on the engine thread
TokenIds = Annotated[tuple[int, ...], "packed u32"]
BlockHashes = Annotated[tuple[int, ...], "packed u64"]   # 64-bit chained block hashes


@dataclass(frozen=True, slots=True)
class Mode:
    """What a checkpoint must match to be usable by this server."""

    spec: str      # none | mtp | ngram
    model: str     # model identity (name + weights digest)
    dtypes: str    # dtypes the state parts are computed and stored in

    def __post_init__(self) -> None:
        if self.spec not in SPEC_MODES:
            raise ValueError(f"spec mode must be one of {SPEC_MODES}, not {self.spec!r}")


@dataclass(frozen=True, slots=True)
class CheckpointFacts:
    """An immutable snapshot of the state parts at `position` P, as recorded facts.

    attn_kv: attention KV covers [0, attn_kv); recurrent_at: position of the GDN state and
    conv tail; mtp_kv: the MTP layer's KV covers [0, mtp_kv); hidden_at: position of the
    stored last hidden state (None if not stored); fenced: the device work that wrote the
    parts has completed.
    """

    id: str
    position: int
    block_hashes: BlockHashes
    prefix_hash: int
    attn_kv: int
    recurrent_at: int
    mtp_kv: int
    hidden_at: int | None
    fenced: bool
    model: str
    dtypes: str
    tokens: TokenIds | None = None


@dataclass(frozen=True, slots=True)
class EndpointFacts:
    """A checkpoint published in the continuation store."""

    id: str
    kind: str              # private | anchor | shared
    tenant: str
    session: str | None    # None for shared prefixes
    checkpoint: CheckpointFacts

    @property
    def position(self) -> int:
        return self.checkpoint.position
