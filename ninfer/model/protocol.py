"""The Model protocol: what the engine asks of a model. SimModel (exact integer
arithmetic) and the torch model implement it; the engine owns the bookkeeping (lanes,
block tables, pools), the model owns the storage those ids index."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol


class MissingStatePart(RuntimeError):
    """A forward read a state part that was never written: a stale reuse."""


@dataclass(eq=False)
class Lane:
    """A live request's state on the device: where its parts are stored."""

    slot: int
    attn_blocks: list[int] = field(default_factory=list)
    mtp_blocks: list[int] = field(default_factory=list)
    mtp_valid: int = 0                 # MTP KV covers [0, mtp_valid)
    fence: int = 0                     # Model.fence() after the lane's last launched work
    # main-model hidden states at positions the MTP layer has not consumed yet, plus the
    # one at frontier-1 (a checkpoint's "last hidden state")
    hidden: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Forward:
    """Result of feeding tokens at positions [start, start+n)."""

    # greedy next token after each position; a prefill (`forward` without per_position)
    # may make only its last position's, the others None
    greedy: list[int | None]
    hidden: Sequence[Any]      # main hidden state at each position (a list, or a tensor
    #                            whose rows are the positions')
    states: list[Any]          # recurrent state after each position (kept for rollback)
    # [n, V] when the model has logits (SimModel has none); [1, V], the last position's,
    # where greedy holds only the last
    logits: Any = None


class MtpOut(NamedTuple):
    """One MTP forward: its greedy draft, its output hidden state (for chaining) and, when
    the model has them, its logits [V] (a sampled draft is drawn from them)."""

    token: int
    hidden: Any
    logits: Any = None


class Parts(NamedTuple):
    """State parts at a position, as read from storage or recomputed (for exactness)."""

    attn_kv: tuple
    recurrent: Any
    mtp_kv: tuple
    hidden: Any


class Model(Protocol):
    identity: str
    dtypes: str
    vocab_size: int
    block_size: int

    def forward(self, lane: Lane, tokens: Sequence[int], start: int) -> Forward:
        """Feed `tokens` at positions start..: write their attention KV, read the KV of
        [0, start) from storage and the recurrent state from the lane's slot. The slot is
        not changed: `accept` picks the state to keep."""

    def init_slot(self, lane: Lane) -> None:
        """Set the lane's slot to the state before any token (a Root plan)."""

    def accept(self, lane: Lane, state: Any, hidden: Any = None) -> None:
        """Write a recurrent state returned by `forward` into the lane's slot, with the
        last hidden state when the MTP head needs it (None otherwise)."""

    def load_hidden(self, slot: int) -> Any:
        """The last hidden state stored in `slot` (None if none)."""

    def mtp(self, lane: Lane, position: int, hidden: Any, next_token: int) -> MtpOut:
        """MTP forward at `position` from `hidden` and the embedding of `next_token`: write
        its MTP KV entry, attend over MTP KV [0, position]; return (draft of the token
        after next_token, MTP output hidden for chaining)."""

    def mtp_span(self, lane: Lane, start: int, hidden: list, next_tokens: list) -> MtpOut:
        """MTP forwards at positions start.. (one batched call where the model can): write
        their MTP KV entries; return the last one's output (what a first draft comes from)."""

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy a slot: recurrent state, conv tail and last hidden state."""

    def copy_block(self, src: int, dst: int, n: int) -> None:
        """Copy the first `n` entries of block `src` into block `dst`."""

    def export_parts(self, held) -> dict[str, Any]:
        """A copy of a checkpoint's parts (attention KV [0,P), MTP KV [0,mtp_kv), its slot),
        taken now, that later writes to the pools do not change: tensors, or JSON values."""

    def import_parts(self, held, parts: dict[str, Any]) -> None:
        """Write parts from `export_parts` into `held`'s (fresh) blocks and slot."""

    def read_parts(self, lane: Lane, position: int, mtp_kv: int) -> Parts:
        """Read the parts at `position` from storage (for the exactness check)."""

    def reference_parts(self, tokens: Sequence[int], mtp: bool) -> Parts:
        """Recompute the parts at len(tokens) from scratch."""

    def parts_match(self, got: Parts, ref: Parts) -> str | None:
        """The name of the first part that differs beyond the model's arithmetic, or None."""

    def fence(self) -> int:
        """A marker for the device work launched so far."""

    def completed(self, marker: int) -> bool:
        """The work launched up to `marker` has completed (the predicate's fence)."""

    def synchronize(self) -> None:
        """Wait for all launched work (the engine does at every step's commit)."""
