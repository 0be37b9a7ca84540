"""CUDA graphs of a speculative round's forwards: the verify (T = 2 .. MAX_TOKENS tokens
per lane, a round's last token and its drafts, the GDN state kept after every position) and
the MTP head over a few entries of one lane (one: a draft; up to `FLAGS.mtp_graph_span`:
the catch-up of a round's committed positions).

Eager, a verify of 4 positions on anchor-1b is ~800 kernel launches: on the H200 machine
42 ms of host time for 1.9 ms of GPU work (bench/NOTES.md), 70 plain decode steps, and an
MTP step ~2 ms; decoding with MTP drafts was ~100x slower than without. A replay costs the
GPU work alone.

Verify graphs are captured per (lanes S, tokens T, block-table width W) on first use, S and
W as the decode graphs (`ninfer.model.graphs`: a smaller batch is padded with lanes of slot
-1, whose KV lands in the scratch block and whose outputs nobody reads); MTP graphs per
(entries T, width W of the MTP layer's block table). Inputs reach a graph through one
static int64 buffer (tokens, positions, state slots, block tables) filled by one
host-to-device copy, and the MTP entries' hidden states by a device copy into their static
input. The forwards are the eager ones (`HybridModel.forward` with `all_states`,
`HybridModel.mtp_forward`, `TorchModel.mtp_span`'s), so a replay computes what the eager
call computes; a verify writes the lanes' KV at the verified
positions and leaves the slot pools alone, as the eager verify does.

What a replay returns lives in the graph's static outputs until that graph's next replay:
greedy tokens are read at once, logits and hidden states are copied out (a lane keeps its
hidden states for the MTP layer; a draft's logits may be sampled from after the verify),
and a verify's per-position states are read where they are, by `TorchModel.accept`, which
the engine calls for every lane of a round before it launches the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..flags import FLAGS
from .gdn import SlotGDNState
from .graphs import SIZES, WIDTHS, bucket, warm_and_capture
from .hybrid import ForwardOutput, HybridState
from .protocol import MtpOut

MAX_TOKENS = 8   # longest verify taken by a graph (drafts + 1)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    S: int
    T: int
    W: int
    inputs: Tensor        # [S * T + 2 * S + S * W] int64: tokens, starts, slots, tables
    staging: Tensor       # its pinned host twin
    out: ForwardOutput    # the static outputs: logits [S, T, V], hidden, per-position states


class VerifyGraphs:
    """Replays of `net.forward(..., all_states=True)` for T tokens per lane over `model`'s
    storage (a TorchModel on CUDA whose net has no MoE layer), sharing the decode graphs'
    memory pool (one stream: replays never overlap)."""

    def __init__(self, model, pool) -> None:
        self.model, self.pool = model, pool
        self.graphs: dict[tuple[int, int, int], _Captured] = {}

    @staticmethod
    def fits(lanes, n: int) -> bool:
        return 2 <= n <= MAX_TOKENS and len(lanes) <= SIZES[-1] \
            and max(len(x.attn_blocks) for x in lanes) <= WIDTHS[-1]

    def run(self, lanes, tokens: list[list[int]], starts: list[int]) -> ForwardOutput:
        """The verify of tokens[b] at positions starts[b].. for each lane b: logits [B, T, V]
        and hidden states [B, T, D] (copies), per-position states in the graph's outputs
        (rows past B are padding)."""
        B, T = len(lanes), len(tokens[0])
        S = bucket(SIZES, B)
        W = bucket(WIDTHS, max(len(x.attn_blocks) for x in lanes))
        cap = self.graphs.get((S, T, W)) or self._capture(S, T, W)
        host = cap.staging.numpy()  # the last replay's copy has completed: its caller
        host[:] = 0                 # read its greedy tokens before returning
        host[S * T + S:S * T + 2 * S] = -1  # padding lanes: no slot
        ids = host[:S * T].reshape(S, T)
        tables = host[S * T + 2 * S:].reshape(S, W)
        tables.fill(self.model.scratch_block)
        for b, (lane, start) in enumerate(zip(lanes, starts, strict=True)):
            ids[b] = tokens[b]
            host[S * T + b], host[S * T + S + b] = start, self.model._at(lane.slot)
            tables[b, :len(lane.attn_blocks)] = lane.attn_blocks
        cap.inputs.copy_(cap.staging, non_blocking=True)
        cap.graph.replay()
        out = cap.out
        return ForwardOutput(out.logits[:B].clone(), out.hidden[:B].clone(), out.state,
                             out.states)

    def _capture(self, S: int, T: int, W: int) -> _Captured:
        m, net = self.model, self.model.net
        inputs = torch.zeros(S * T + 2 * S + S * W, dtype=torch.long, device=m.device)
        ids = inputs[:S * T].view(S, T)
        starts, slots = inputs[S * T:S * T + S], inputs[S * T + S:S * T + 2 * S]
        tables = inputs[S * T + 2 * S:].view(S, W)
        slots.fill_(-1)
        tables.fill_(m.scratch_block)
        from .torch_model import PagedKV

        def forward() -> ForwardOutput:
            # the positions made in the graph: a replay may read only tensors that stay
            # alive (`warm_and_capture`)
            positions = starts[:, None] + torch.arange(T, device=m.device)
            gdn = {i: SlotGDNState(m.conv[i], m.recurrent[i], slots) for i in m.conv}
            state = HybridState(gdn, PagedKV(m.kv_k, m.kv_v, m.block_size, tables))
            return net.forward(ids, positions, state, all_states=True)

        graph, out = warm_and_capture(forward, self.pool)
        cap = _Captured(graph, S, T, W, inputs,
                        torch.zeros_like(inputs, device="cpu").pin_memory(), out)
        self.graphs[(S, T, W)] = cap
        return cap


@dataclass
class _MtpCaptured:
    graph: torch.cuda.CUDAGraph
    inputs: Tensor        # [2 * T + W] int64: the next tokens, the positions, the table
    staging: Tensor       # its pinned host twin
    hidden: Tensor        # [1, T, D] the static hidden-state input
    logits: Tensor        # [V] (the last entry's) and
    out: Tensor           # [D] (the last entry's): the static outputs


class MtpGraphs:
    """Replays of the MTP head over T = 1 .. `FLAGS.mtp_graph_span` consecutive entries of
    one lane over `model`'s MTP KV: one entry (a draft, `net.mtp_forward`), or the catch-up
    of a round's committed positions (`TorchModel.mtp_span`'s forward: logits of the last
    entry only). Eager, a catch-up of the 4 positions of a round whose 3 drafts were all
    accepted took ~3 ms of host time on the H100, more than the round's verify."""

    def __init__(self, model, pool) -> None:
        self.model, self.pool = model, pool
        self.graphs: dict[tuple[int, int], _MtpCaptured] = {}

    @staticmethod
    def fits(lane, entries: int = 1) -> bool:
        return len(lane.mtp_blocks) <= WIDTHS[-1] and 1 <= entries <= FLAGS.mtp_graph_span

    def run(self, lane, position: int, hidden: Tensor, next_token: int) -> MtpOut:
        """The MTP entry at `position` from the main hidden state there and the token after
        it: its greedy draft, output hidden state and logits (copies)."""
        return self.span(lane, position, [hidden], [next_token])

    def span(self, lane, start: int, hidden, next_tokens) -> MtpOut:
        """Entries start .. start+T-1 from the main hidden states there (T of them) and the
        tokens after each: the last entry's greedy draft, output hidden state and logits
        (copies)."""
        T = len(hidden)
        W = bucket(WIDTHS, len(lane.mtp_blocks))
        cap = self.graphs.get((T, W)) or self._capture(T, W)
        host = cap.staging.numpy()  # free: the last replay's caller read its draft
        host[:T] = next_tokens
        host[T:2 * T] = range(start, start + T)
        host[2 * T:] = self.model.scratch_block
        host[2 * T:2 * T + len(lane.mtp_blocks)] = lane.mtp_blocks
        cap.inputs.copy_(cap.staging, non_blocking=True)
        if T == 1:
            cap.hidden.view(-1).copy_(hidden[0].reshape(-1))
        else:
            torch.stack(list(hidden), out=cap.hidden[0])
        cap.graph.replay()
        logits = cap.logits.clone()
        return MtpOut(int(logits.argmax()), cap.out.clone(), logits)

    def _capture(self, T: int, W: int) -> _MtpCaptured:
        m, net = self.model, self.model.net
        inputs = torch.zeros(2 * T + W, dtype=torch.long, device=m.device)
        inputs[2 * T:] = m.scratch_block
        hidden = torch.zeros(1, T, m.config.hidden_size, dtype=m.dtype, device=m.device)
        from .torch_model import PagedKV

        def forward() -> tuple[Tensor, Tensor]:
            kv = PagedKV(m.mtp_k, m.mtp_v, m.block_size, inputs[2 * T:].view(1, W))
            ids, positions = inputs[:T].view(1, T), inputs[T:2 * T].view(1, T)
            if T == 1:  # a draft: `mtp_forward`, as `TorchModel.mtp` runs it eagerly
                out = net.mtp_forward(hidden, ids, positions, kv)
                return out.logits[0, 0], out.hidden[0, 0]
            # a catch-up: `TorchModel.mtp_span`'s forward
            y = net.mtp(hidden, net.model.embed_tokens(ids), positions,
                        net.rope(positions, m.dtype), kv)
            return net.lm_logits(y[0, -1]), y[0, -1]

        graph, (logits, out) = warm_and_capture(forward, self.pool)
        cap = _MtpCaptured(graph, inputs,
                           torch.zeros_like(inputs, device="cpu").pin_memory(), hidden,
                           logits, out)
        self.graphs[(T, W)] = cap
        return cap
