"""The Model protocol: everything the engine and its runner ask of a model, declared here
(none of it found by probing). SimModel (exact integer arithmetic, `sim_model.py`) and the
torch model (`torch_model.py`) implement it; the engine owns the bookkeeping (lanes, block
tables, pools), the model owns the storage those ids index.

This module imports neither side's code and no torch: the engine and the models both
import it."""

from __future__ import annotations

from collections.abc import Collection, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable


class MissingStatePart(RuntimeError):
    """A forward read a state part that was never written: a stale reuse."""


class KeptOnly(Sequence):
    """A forward's per-position states of which only those at `kept` may be picked (what a
    forward with `reads` keeps: `Model.forward`); picking another raises MissingStatePart."""

    def __init__(self, states: Sequence[Any], kept: Collection[int]) -> None:
        self.states, self.kept = states, kept

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> Any:
        i = range(len(self.states))[i]
        if i not in self.kept:
            raise MissingStatePart(f"the state after position {i} was not kept "
                                   f"(kept: {sorted(self.kept)})")
        return self.states[i]


class ModelLost(RuntimeError):
    """The model can no longer run: a tensor-parallel rank died or did not answer within
    its timeout. Nothing it computed since the last fence can be trusted; the engine fails
    every request in flight and stops, and the server exits for its supervisor to restart
    it."""


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

    # greedy next token after each position; a prefill (a forward not per position of
    # more than one token) may make only its last position's, the others None
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


class HeldStorage(Protocol):
    """What a model reads of a checkpoint's storage (the runner's `Held`) to export or
    import its parts."""

    position: int            # attention KV [0, position), recurrent state at position
    attn_blocks: list[int]
    mtp_blocks: list[int]
    mtp_kv: int              # MTP KV [0, mtp_kv)
    slot: int


# One forward's input: the lane, the tokens fed, the position of the first.
ForwardItem = tuple[Lane, Sequence[int], int]

T = TypeVar("T")


def run_through(steps: Generator[None, None, T]) -> T:
    """What a forward in parts (`Model.forward_steps`) returns, every part run now."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@runtime_checkable
class Model(Protocol):
    """A model the engine drives. Every device call "launches" work that `fence` counts
    and `synchronize` completes (SimModel's work is done at once; only the markers move).

    Running ahead (`runs_ahead`, `forward_batch(ahead=True)`): the caller promises that
    each lane that goes on is fed its greedy token at the next position next, so the model
    may start that one-token step before `forward_batch` returns and hand it over when it
    is asked for exactly it (same lanes in the same order, same slots, each lane's greedy
    token, the next position, the same blocks); any other call drops it. A step run ahead
    leaves nothing behind when dropped: its recurrent state goes aside (not into the
    slot), its KV lands at the next position of the lane's own blocks, past everything
    committed, and it runs only where that position's block is already the lane's.
    With `runs_ahead` true the engine reserves that block a step early where the pool can
    spare it. Adopting a step gives exactly what computing it then would give: its only
    effect is timing (the GPU works while the host does the engine's bookkeeping), and the
    block held a step early. SimModel runs ahead when built with `runs_ahead=True`, so the
    engine's side of the promise is tested without a GPU."""

    identity: str            # the weights' identity, recorded in every checkpoint
    dtypes: str              # the arithmetic, recorded in every checkpoint
    vocab_size: int
    block_size: int          # KV positions per block of the pools
    runs_ahead: bool         # whether `forward_batch(ahead=True)` may run the next step
    # the longest `per_position` forward whose every position's state `accept` may pick
    # (a prefill with checkpoints inside it is one forward up to this many tokens)
    keeps_states_up_to: int

    def forward(self, lane: Lane, tokens: Sequence[int], start: int,
                per_position: bool = False, reads: Sequence[int] | None = None) -> Forward:
        """One lane's `forward_batch` (a prefill chunk unless `per_position`). `reads`,
        with `per_position`: the indices into `tokens` whose states the caller will pick
        besides the last (None: any); the model may keep only those (a next turn's delta
        on the GPU is a CUDA graph that keeps four), and picking another raises
        `MissingStatePart`. With `reads`, as for a prefill, only the last position's greedy
        token and logits need be made."""

    def forward_steps(self, lane: Lane, tokens: Sequence[int], start: int,
                      per_position: bool = False, reads: Sequence[int] | None = None
                      ) -> Generator[None, None, Forward]:
        """`forward` in parts: each `next` launches a part (a few of the model's layers), and
        the last returns the `Forward` (`run_through` runs them all). Between two parts the
        caller may run other lanes' forwards. Until `accept`, the lane's slot is as it was,
        so a forward left unfinished (closed, or dropped) leaves the lane where it was, with
        KV written only at positions from `start` on. A model may run it in one part."""

    def forward_batch(self, items: Sequence[ForwardItem], per_position: bool = True,
                      ahead: bool = False, outputs: bool = True) -> list[Forward]:
        """Feed each item's tokens at positions start..: write their attention KV, read
        the KV of [0, start) from storage and the recurrent state from the lane's slot. The
        slot is not changed: `accept` picks the state to keep. `per_position`: the state
        after every position is kept (a verify's rollback is then a pick; a prefill's
        checkpoints inside it are picks), for forwards of up to `keeps_states_up_to`
        tokens; otherwise (a prefill) only the last one's state, greedy token and logits
        need be made.
        `ahead`: see the class docstring. `outputs` false: the caller reads only the greedy
        tokens, so the logits and hidden states may be left out (None)."""

    def init_slot(self, lane: Lane) -> None:
        """Set the lane's slot to the state before any token (a Root plan)."""

    def accept(self, lane: Lane, state: Any, hidden: Any = None) -> None:
        """Write a recurrent state returned by a forward into the lane's slot, with the
        last hidden state when the MTP head needs it (None otherwise)."""

    def load_hidden(self, slot: int) -> Any:
        """The last hidden state stored in `slot` (None if none)."""

    def mtp(self, lane: Lane, position: int, hidden: Any, next_token: int) -> MtpOut:
        """MTP forward at `position` from `hidden` and the embedding of `next_token`: write
        its MTP KV entry, attend over MTP KV [0, position]; return (draft of the token
        after next_token, MTP output hidden for chaining)."""

    def mtp_span(self, lane: Lane, start: int, hidden: Sequence[Any],
                 next_tokens: list[int]) -> MtpOut:
        """MTP forwards at positions start.. (one batched call where the model can): write
        their MTP KV entries; return the last one's output (what a first draft comes from)."""

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy a slot: recurrent state, conv tail and last hidden state."""

    def copy_block(self, src: int, dst: int, n: int) -> None:
        """Copy the first `n` entries of block `src` into block `dst`."""

    def export_parts(self, held: HeldStorage) -> dict[str, Any]:
        """A copy of a checkpoint's parts (attention KV [0,P), MTP KV [0,mtp_kv), its slot),
        taken now, that later writes to the pools do not change: tensors, or JSON values."""

    def import_parts(self, held: HeldStorage, parts: dict[str, Any]) -> None:
        """Write parts from `export_parts` into `held`'s (fresh) blocks and slot."""

    def read_parts(self, lane: Lane, position: int, mtp_kv: int) -> Parts:
        """Read the parts at `position` from storage (for the exactness check)."""

    def reference_parts(self, tokens: Sequence[int], mtp: bool) -> Parts:
        """Recompute the parts at len(tokens) from scratch."""

    def parts_match(self, got: Parts, ref: Parts) -> str | None:
        """The name of the first part that differs beyond the model's arithmetic, or None."""

    def reference_generate(self, tokens: Sequence[int], max_tokens: int,
                           stop_tokens: Sequence[int] = ()) -> list[int]:
        """A plain Root run outside the pools: the greedy continuation of `tokens` (the
        tests' oracle for every output)."""

    def fence(self) -> int:
        """A marker for the device work launched so far."""

    def completed(self, marker: int) -> bool:
        """The work launched up to `marker` has completed (the predicate's fence)."""

    def synchronize(self) -> None:
        """Wait for all launched work (the engine does at every step's commit); a step run
        ahead that nothing launched since waits for need not be waited for."""

    def allocator_counts(self) -> tuple[int, int] | None:
        """The device memory allocator's running counts, (segments allocated, allocations
        retried after freeing its cache), for the slow-step log; None where there is
        none to count (the CPU)."""
