"""CUDA graphs of a next turn's delta: one lane's forward of 9 .. 32 tokens, every
position's state made and a few of them kept (the ends of the messages the delta holds,
where the engine captures anchors, and its last position). A prompt's short last piece
(a chat's generation prompt after its message's end: 9 tokens on anchor-1b with thinking
off) replays them too, keeping its last position's state only.

A served next turn sends back the reply and a new message: some 10 to 32 tokens the engine
feeds in one per-position forward (`Model.keeps_states_up_to`). Eager, that forward on
anchor-1b is ~950 kernel launches: on the H100, 19.3 ms of wall time for a few ms of GPU work
(`bench/results/turn-profile-h100.json`). The verify graphs (`spec_graphs`) take 2 .. 8
tokens, one graph per length; here every length above theirs is padded to `TOKENS`, so one
graph per block-table width serves them all. On one H200 the time to first token of such a
turn inside the engine fell from 35.5 to 7.9 ms at 4K of context, 44.6 to 9.4 ms at 32K
(`bench/results/turn-graphs-h200.json`).

Padding. The positions past the delta's end are fed token 0. Causal attention and the
recurrence make nothing at a real position depend on them; their KV lands past the lane's
frontier, in the lane's own last block or, past its blocks, in the scratch block (the table
is filled with it), where nothing reads it before it is written again, as with a verify's
rejected drafts. The table's width holds the padded positions, so no column is out of range.

Kept states. All `TOKENS` positions' states are made inside the graph (~576 MB on anchor-1b,
memory the graphs of the pool share), and `PICKS` of them are gathered into its static
output: the delta's last position first, then the positions the caller said it will read
(`reads`, at most `PICKS - 1`); a forward asked for more falls back to the eager one. The
state after any other position is not there (`MissingStatePart`). The logits are made at
the last real position only (the engine reads no other), the hidden states at every
position (the MTP layer's catch-up reads them), copied out; the kept states are read where
they are, before the engine's next forward (`Runner.prefill` returns them and `Prefill.step`
captures them in the same step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .gdn import GDNState, SlotGDNState
from .graphs import WIDTHS, bucket, warm_and_capture
from .hybrid import ForwardOutput, HybridState
from .protocol import KeptOnly
from .spec_graphs import MAX_TOKENS

TOKENS = 32   # a delta of MAX_TOKENS + 1 .. TOKENS tokens is padded to this many
PICKS = 4     # states kept: the last real position and up to three the caller reads


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    W: int
    inputs: Tensor        # [TOKENS + 2 + PICKS + W] int64: tokens, start, slot, picks, table
    staging: Tensor       # its pinned host twin
    logits: Tensor        # [V] at the last real position
    hidden: Tensor        # [1, TOKENS, D]
    states: dict[int, GDNState]   # [1, PICKS, ...] per GDN layer


class TurnGraphs:
    """Replays of one lane's per-position forward of MAX_TOKENS + 1 .. TOKENS tokens over
    `model`'s storage (a TorchModel on CUDA), sharing the decode graphs' memory pool."""

    def __init__(self, model, pool) -> None:
        self.model, self.pool = model, pool
        self.graphs: dict[int, _Captured] = {}

    def width(self, lane, start: int) -> int:
        """The block-table width a forward from `start` needs: its padded positions and
        the lane's blocks."""
        blocks = -(-(start + TOKENS) // self.model.block_size)
        return max(blocks, len(lane.attn_blocks))

    def fits(self, lanes, n: int, start: int, reads: Sequence[int] | None) -> bool:
        return len(lanes) == 1 and MAX_TOKENS < n <= TOKENS and reads is not None \
            and len(set(reads) - {n - 1}) < PICKS and self.width(lanes[0], start) <= WIDTHS[-1]

    def run(self, lane, tokens: Sequence[int], start: int, reads: Sequence[int],
            ) -> tuple[int, Tensor, Tensor, KeptOnly]:
        """The forward of `tokens` at start..: the greedy token and logits [V] at its last
        position, the hidden states [n, D] (copies), and the states after its last
        position and after each of `reads`."""
        n = len(tokens)
        W = bucket(WIDTHS, self.width(lane, start))
        cap = self.graphs.get(W) or self._capture(W)
        picks = [n - 1] + sorted(set(reads) - {n - 1})
        host = cap.staging.numpy()  # free: the last replay's caller read its greedy token
        host[:TOKENS] = 0
        host[:n] = tokens
        host[TOKENS], host[TOKENS + 1] = start, self.model._at(lane.slot)
        host[TOKENS + 2:TOKENS + 2 + PICKS] = picks + [n - 1] * (PICKS - len(picks))
        table = host[TOKENS + 2 + PICKS:]
        table.fill(self.model.scratch_block)
        table[:len(lane.attn_blocks)] = lane.attn_blocks
        cap.inputs.copy_(cap.staging, non_blocking=True)
        cap.graph.replay()
        logits = cap.logits.clone()
        # what `accept` takes: (holder, row 0, column), as (out, row, index) of a forward
        holder = ForwardOutput(None, None, None, cap.states)  # type: ignore[arg-type]
        states: list = [None] * n
        for column, position in enumerate(picks):
            states[position] = (holder, 0, column)
        return (int(logits.argmax()), logits, cap.hidden[0, :n].clone(),
                KeptOnly(states, set(picks)))

    def _capture(self, W: int) -> _Captured:
        m, net, T = self.model, self.model.net, TOKENS
        inputs = torch.zeros(T + 2 + PICKS + W, dtype=torch.long, device=m.device)
        ids, starts = inputs[:T].view(1, T), inputs[T:T + 1]
        slots, picks = inputs[T + 1:T + 2], inputs[T + 2:T + 2 + PICKS]
        tables = inputs[T + 2 + PICKS:].view(1, W)
        slots.fill_(-1)
        tables.fill_(m.scratch_block)
        from .torch_model import PagedKV

        def forward() -> tuple[Tensor, Tensor, dict[int, GDNState]]:
            return turn_forward(net, ids, starts[:, None] + torch.arange(T, device=m.device),
                                {i: SlotGDNState(m.conv[i], m.recurrent[i], slots)
                                 for i in m.conv},
                                PagedKV(m.kv_k, m.kv_v, m.block_size, tables), picks)

        graph, (logits, hidden, states) = warm_and_capture(forward, self.pool)
        cap = _Captured(graph, W, inputs, torch.zeros_like(inputs, device="cpu").pin_memory(),
                        logits, hidden, states)
        self.graphs[W] = cap
        return cap


def turn_forward(net, ids: Tensor, positions: Tensor, gdn: dict, kv, picks: Tensor,
                 ) -> tuple[Tensor, Tensor, dict[int, GDNState]]:
    """What a turn graph computes, on any device: the forward of ids [1, T] at positions
    [1, T] from the GDN states `gdn` and the store `kv`; the logits [V] at position
    picks[0], the hidden states [1, T, D], and each GDN layer's states after positions
    `picks` ([1, P, ...])."""
    out = net.forward(ids, positions, HybridState(gdn, kv), all_states=True, logits=False)
    kept = {i: GDNState(s.conv[:, picks], s.recurrent[:, picks]) for i, s in out.states.items()}
    # (index_select: indexing with a 0-d tensor would read it on the host, a sync)
    return net.lm_logits(out.hidden[0].index_select(0, picks[:1]))[0], out.hidden, kept
