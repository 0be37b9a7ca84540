"""CUDA graphs of the one-token forward: a decode step of up to 8 lanes as one replay.

A graph is captured per (batch size, block-table width) on first use: batch sizes 1, 2, 4,
8 (a smaller batch is padded: padding lanes have slot -1, which the kernels neither read
nor write, and a block table pointing at the scratch block, where their KV lands), widths
from 64 blocks up. Inputs reach the graph through one static int64 buffer (token, position,
slot, block table of every lane) filled with a single host-to-device copy; the GDN state is
updated in place in the slot pools by the kernels (`SlotGDNState`), the KV is written into
the blocks, and the logits and last hidden states come back in static outputs, which the
caller copies before the next replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .gdn import SlotGDNState
from .hybrid import HybridState

SIZES = (1, 2, 4, 8)
WIDTHS = (64, 256, 1024, 4096, 16384)   # block-table columns (x block_size positions)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: Tensor        # [3 * S + S * W] int64: ids, positions, slots, tables
    host: Tensor          # its pinned twin on the host
    logits: Tensor        # [S, 1, V]
    hidden: Tensor        # [S, 1, D]


class DecodeGraphs:
    """Replays of `net.forward` for one token per lane over `model`'s storage (a
    TorchModel on CUDA whose net has no MoE layer: routing syncs with the host)."""

    def __init__(self, model, compile: bool = False) -> None:
        """`compile`: torch.compile the forward before capture (fuses its elementwise
        chains; minutes of compilation at start-up)."""
        self.model = model
        self.pool = torch.cuda.graph_pool_handle()  # replays are sequential: one pool
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.forward = torch.compile(model.net.forward, dynamic=False) if compile \
            else model.net.forward

    @staticmethod
    def fits(lanes) -> bool:
        return len(lanes) <= SIZES[-1] and max(len(x.attn_blocks) for x in lanes) <= WIDTHS[-1]

    def run(self, lanes, tokens: list[int], starts: list[int]) -> tuple[Tensor, Tensor]:
        """Logits [B, V] and hidden states [B, D] of one token per lane (copies)."""
        B = len(lanes)
        S = next(s for s in SIZES if s >= B)
        W = next(w for w in WIDTHS if w >= max(len(x.attn_blocks) for x in lanes))
        cap = self.graphs.get((S, W)) or self._capture(S, W)
        # the pinned buffer written through numpy: a torch op per element costs microseconds
        # of host time, and the GPU idles for all of it
        host = cap.host.numpy()
        host[:2 * S] = 0
        host[2 * S:3 * S] = -1                       # padding lanes: no slot
        tables = host[3 * S:].reshape(S, W)
        tables.fill(self.model.scratch_block)
        for b, (lane, token, start) in enumerate(zip(lanes, tokens, starts, strict=True)):
            host[b], host[S + b], host[2 * S + b] = token, start, lane.slot
            tables[b, :len(lane.attn_blocks)] = lane.attn_blocks
        cap.inputs.copy_(cap.host, non_blocking=True)
        cap.graph.replay()
        return cap.logits[:B, 0].clone(), cap.hidden[:B, 0].clone()

    def _capture(self, S: int, W: int) -> _Captured:
        m = self.model
        inputs = torch.zeros(3 * S + S * W, dtype=torch.long, device=m.device)
        ids, positions = inputs[:S].view(S, 1), inputs[S:2 * S].view(S, 1)
        slots, tables = inputs[2 * S:3 * S], inputs[3 * S:].view(S, W)
        slots.fill_(-1)
        tables.fill_(m.scratch_block)
        from .torch_model import PagedKV
        gdn = {i: SlotGDNState(m.conv[i], m.recurrent[i], slots) for i in m.conv}

        def forward():
            return self.forward(ids, positions, HybridState(gdn, PagedKV(
                m.kv_k, m.kv_v, m.block_size, tables)))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # Triton compiles, cuBLAS picks its kernels: not in a graph
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        cap = _Captured(graph, inputs, torch.zeros_like(inputs, device="cpu").pin_memory(),
                        out.logits, out.hidden)
        self.graphs[(S, W)] = cap
        return cap
