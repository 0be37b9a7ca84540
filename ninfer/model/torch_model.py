"""TorchModel: the Model protocol (ninfer.model.protocol) over the torch HybridModel.

The engine owns the bookkeeping (block tables, slots); this owns the storage they index:
attention KV in blocks of `block_size` positions per attention layer ([num_blocks,
block_size, Hkv, D]), the MTP layer's KV in blocks of its own, and per slot the GDN conv
tail and recurrent matrix of every linear-attention layer plus the last hidden state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from kernels import kernels_for

from ..flags import FLAGS
from . import chunk_attention
from .attention import ContiguousKV
from .gdn import GDNState, SlotGDNState, state_dtype
from .hybrid import HybridModel, HybridState
from .protocol import Forward, Lane, MissingStatePart, MtpOut, Parts, run_through

VERIFY_STATES_UP_TO = 32   # longest forward whose per-position GDN states are kept
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2}


ATTEND_ON_DEVICE_UP_TO = 32  # query positions per lane the paged-attention kernel takes


class PagedKV:
    """The KVStore protocol over block storage, for a batch of lanes' block tables. On a
    GPU it also attends itself (`attend`): the paged-attention kernel reads the blocks in
    place, for decode and verify forwards."""

    def __init__(self, k: dict[int, Tensor], v: dict[int, Tensor], block_size: int,
                 tables: Sequence[Sequence[int]] | Tensor, length: int | None = None) -> None:
        """`length`: one past the last position the forward writes, where the caller knows
        it on the host: attention that reads the KV back then takes it from here rather
        than from the positions on the device (a sync per attention layer)."""
        self.k, self.v, self.bs = k, v, block_size
        self.length = length
        self._lengths: tuple[Tensor, Tensor] | None = None  # (positions, their lengths)
        if isinstance(tables, Tensor):  # a CUDA graph's static table [B, blocks] (long)
            self.run, self.tables = None, tables
            return
        # one lane whose blocks are consecutive (a fresh pool hands them out in order): its
        # KV is a slice of the storage, read without a gather
        only = tables[0] if len(tables) == 1 else None
        self.run = only[0] if only and only[-1] - only[0] == len(only) - 1 and all(
            b - a == 1 for a, b in zip(only, only[1:], strict=False)) else None
        width = max(1, max(len(t) for t in tables))
        device = next(iter(k.values())).device
        self.tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables],
                                   dtype=torch.long, device=device)  # [B, blocks]

    def write(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        blocks = self.tables.gather(1, positions // self.bs)  # [B, T]
        offsets = positions % self.bs
        self.k[layer][blocks, offsets] = k.to(self.k[layer].dtype)
        self.v[layer][blocks, offsets] = v.to(self.v[layer].dtype)

    def prologue(self, layer: int, y: Tensor, positions: Tensor,
                 cos_sin: tuple[Tensor, Tensor], attn) -> Tensor | None:
        """On a GPU, from the attention layer `attn`'s packed projection y: q normed and
        rotated (returned), k normed, rotated and written with v, in one launch
        (`kernels.kv_write`); None elsewhere, and the layer runs the torch chain."""
        dev = kernels_for(y)
        if dev is None:
            return None
        return dev.attention_prologue(y, *self._layer_args(layer, attn, cos_sin), positions)

    def decode_attention(self, layer: int, y: Tensor, positions: Tensor,
                         cos_sin: tuple[Tensor, Tensor], attn) -> Tensor | None:
        """On a GPU, one new token per lane: the attention layer `attn`'s mixer from its
        packed projection y, the KV written and attended in one launch
        (`kernels.decode_attention`); None elsewhere."""
        dev = kernels_for(y)
        if dev is None or y.shape[1] != 1:
            return None
        return dev.decode_attention(y, *self._layer_args(layer, attn, cos_sin), positions)

    def _layer_args(self, layer: int, attn, cos_sin: tuple[Tensor, Tensor]) -> tuple:
        """What the attention kernels take of layer `attn` and this store, between the
        projection and the positions: heads, norms, the angles, the caches, the tables."""
        return (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.q_norm.weight,
                attn.k_norm.weight, attn.q_norm.eps, *cos_sin, self.k[layer], self.v[layer],
                self.tables)

    def attend(self, layer: int, q: Tensor, positions: Tensor) -> Tensor | None:
        """Attention of q [B, T, H, D] at `positions` (consecutive per lane, already written)
        over the lane's KV by the device kernel; None where it does not apply (the CPU, a
        long prefill chunk), and the caller reads the KV instead."""
        dev = kernels_for(q)
        if dev is None or q.shape[1] > ATTEND_ON_DEVICE_UP_TO:
            return None
        k, v = self.k[layer], self.v[layer]
        if self._lengths is None or self._lengths[0] is not positions:  # once per forward
            self._lengths = (positions, positions[:, -1] + 1)
        return dev.attention(q.to(k.dtype).contiguous(), k, v, self.tables,
                             self._lengths[1]).to(q.dtype)

    def read(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        n = -(-length // self.bs)
        if self.run is not None:
            k, v = (t[layer][self.run:self.run + n] for t in (self.k, self.v))
            return (k.reshape(1, n * self.bs, *k.shape[2:])[:, :length],
                    v.reshape(1, n * self.bs, *v.shape[2:])[:, :length])
        idx = self.tables[:, :n]  # [B, n]
        B = idx.shape[0]
        k = self.k[layer][idx].reshape(B, n * self.bs, *self.k[layer].shape[2:])
        v = self.v[layer][idx].reshape(B, n * self.bs, *self.v[layer].shape[2:])
        return k[:, :length], v[:, :length]


class _States(Sequence):
    """The recurrent state after each position of one row of a forward, picked lazily (a
    rollback is a pick, not a recompute)."""

    def __init__(self, out, row: int, n: int, per_position: bool) -> None:
        self.out, self.row, self.n, self.per_position = out, row, n, per_position

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, int, int]:
        i = range(self.n)[i]
        if not self.per_position and i != self.n - 1:
            raise MissingStatePart(f"the state after position {i} of a long forward is kept "
                                   "only at its end")
        return self.out, self.row, i


class _InPlace(Sequence):
    """The state after a one-token graph replay: already in the lane's slot."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> _InPlace:
        range(1)[i]  # 0 and -1 only
        return self


def _forwards(out, n: int, keep: bool, last: bool) -> list[Forward]:
    """Each row's `Forward` of a batched network forward of n tokens a row."""
    greedy = out.logits.argmax(-1).tolist()  # [B][T], or [B][1] for the last only
    # hidden: the row's [T, hidden], not a list of T views (a 2K-token prefill spent ~4 ms
    # of host time making them)
    return [Forward([None] * (n - 1) + greedy[row] if last else greedy[row], out.hidden[row],
                    _States(out, row, n, keep), out.logits[row])
            for row in range(len(greedy))]


def _copy_all(dsts: list[Tensor], srcs: list[Tensor]) -> None:
    """dsts[i] = srcs[i] for every i, in a few launches on a GPU: a state slot of anchor-1b
    is 36 tensors, and a `copy_` each was 36 launches of host time per restore, per capture
    and per accept."""
    if dsts:
        torch._foreach_copy_(dsts, srcs)


class TorchModel:
    def __init__(self, net: HybridModel, *, num_blocks: int, block_size: int, num_slots: int,
                 identity: str, device: str | torch.device = "cpu",
                 graphs: bool = True) -> None:
        """`graphs` false: no CUDA graphs even where they would apply (a tensor-parallel
        rank, whose forward holds collectives)."""
        self.net = net.eval()
        self.config = c = net.config
        self.dtype = next(net.parameters()).dtype
        self.dtypes = str(self.dtype).removeprefix("torch.")
        self.identity, self.device = identity, torch.device(device)
        self.vocab_size, self.block_size = c.vocab_size, block_size

        # one block past the pool's: the scratch block, where padding lanes of a CUDA
        # graph write their KV (never handed out, never read by a real lane)
        self.scratch_block = num_blocks

        def blocks(keys):
            shape = (num_blocks + 1, block_size, c.num_key_value_heads, c.head_dim)
            return ({i: self._zeros(shape) for i in keys}, {i: self._zeros(shape) for i in keys})

        self.kv_k, self.kv_v = blocks(c.attention_layers)
        self.mtp_k, self.mtp_v = blocks(range(c.mtp_num_hidden_layers) if net.has_mtp else ())
        # graphs need the kernels for the model's dtype (their first kernel and the greedy
        # keys are Triton's) and no MoE layer (routing syncs with the host)
        graphs = graphs and kernels_for(
            torch.empty(0, dtype=self.dtype, device=self.device)) is not None \
            and self.device.type == "cuda" and not any(
                c.is_moe_layer(i) for i in range(c.num_hidden_layers))
        # with decode graphs each slot has a twin: a step run ahead of the engine writes
        # the state it makes there, and `flip[slot]` says which of the two holds the slot's
        # state (`_at`): adopting the step flips it, dropping it leaves the state as it was
        self.num_slots = num_slots
        self.flip = [0] * num_slots
        pool = 2 * num_slots if graphs else num_slots
        self.conv = {i: self._zeros((pool, c.conv_dim, c.linear_conv_kernel_dim - 1))
                     for i in c.linear_layers}
        self.recurrent = {i: self._zeros((pool, c.linear_num_value_heads,
                                          c.linear_key_head_dim, c.linear_value_head_dim),
                                         state_dtype(self.dtype)) for i in c.linear_layers}
        self.hidden = self._zeros((num_slots, c.hidden_size))
        self.hidden_valid = [False] * num_slots
        self._launched = self._completed = 0
        self.graphs = self.verify_graphs = self.mtp_graphs = self.turn_graphs = None
        if graphs:
            from .graphs import DecodeGraphs
            from .spec_graphs import MtpGraphs, VerifyGraphs
            from .turn_graphs import TurnGraphs
            self.graphs = DecodeGraphs(self)
            self.verify_graphs = VerifyGraphs(self, self.graphs.pool)
            self.turn_graphs = TurnGraphs(self, self.graphs.pool)
            if net.has_mtp:
                self.mtp_graphs = MtpGraphs(self, self.graphs.pool)

    @property
    def keeps_states_up_to(self) -> int:
        return VERIFY_STATES_UP_TO

    @property
    def runs_ahead(self) -> bool:
        """Whether greedy one-token steps may be launched ahead of the engine (decode
        graphs, `FLAGS.run_ahead`): the engine then reserves the next position's block a step
        early."""
        return self.graphs is not None and FLAGS.run_ahead

    def _at(self, slot: int) -> int:
        """Where the GDN state of engine slot `slot` is in the pools (it or its twin)."""
        return slot + self.flip[slot] * self.num_slots

    def twin(self, slot: int) -> int:
        """The other of the slot's two places: where a step run ahead writes its state."""
        return slot + (1 - self.flip[slot]) * self.num_slots

    def _writing(self, slot: int) -> None:
        """The engine writes `slot`'s state: a step run ahead from it is stale."""
        if self.graphs is not None:
            self.graphs.drop_ahead(slot)

    def _zeros(self, shape, dtype=None) -> Tensor:
        return torch.zeros(shape, dtype=dtype or self.dtype, device=self.device)

    # --- the forward --------------------------------------------------------------------

    def _state(self, slots: Sequence[int], tables, length: int | None = None) -> HybridState:
        idx = torch.tensor([self._at(s) for s in slots], device=self.device)
        if kernels_for(self.hidden) is not None:  # left in the pools: a step updates them
            gdn = {i: SlotGDNState(self.conv[i], self.recurrent[i], idx) for i in self.conv}
        else:
            gdn = {i: GDNState(self.conv[i][idx], self.recurrent[i][idx]) for i in self.conv}
        return HybridState(gdn, PagedKV(self.kv_k, self.kv_v, self.block_size, tables, length))

    def forward(self, lane: Lane, tokens: Sequence[int], start: int,
                per_position: bool = False, reads: Sequence[int] | None = None) -> Forward:
        return self.forward_batch([(lane, tokens, start)], per_position, reads=reads)[0]

    @torch.inference_mode()
    def forward_batch(self, items: Sequence[tuple[Lane, Sequence[int], int]],
                      per_position: bool = True, ahead: bool = False,
                      outputs: bool = True, reads: Sequence[int] | None = None,
                      ) -> list[Forward]:
        """Several lanes' forwards; lanes feeding the same number of tokens share one batched
        call (decode and verify rounds of equal length). `per_position` keeps the recurrent
        state after every position (a verify's rollback is then a pick); a prefill keeps only
        the last, and takes the chunked GDN path. `ahead`: the caller will feed each lane
        its greedy token next if the lane goes on, so a one-token graph step launches the
        next step before returning (`DecodeGraphs.run`). `outputs` false: the caller reads
        only the greedy tokens, so a graph step may leave logits and hidden states out
        (None). `reads` (one item): see `Model.forward`; a forward of 9 .. 32 tokens with
        them (a next turn's delta, a prompt's last piece) is then a graph replay
        (`turn_graphs`)."""
        results: list[Forward | None] = [None] * len(items)
        groups: dict[int, list[int]] = {}
        for index, (_, tokens, _) in enumerate(items):
            groups.setdefault(len(tokens), []).append(index)
        if self.graphs is not None and not (set(groups) == {1} and self.graphs.fits(
                [lane for lane, _, _ in items])):
            self.graphs.drop_ahead()  # these forwards write the lanes' state themselves
        for n, members in groups.items():
            lanes = [items[m][0] for m in members]
            if n == 1 and self.graphs is not None and self.graphs.fits(lanes):
                self._launched += 1
                logits, hidden, greedy = self.graphs.run(
                    lanes, [items[m][1][0] for m in members], [items[m][2] for m in members],
                    ahead=ahead, outputs=outputs)
                for row, m in enumerate(members):  # (None: outputs left out)
                    results[m] = Forward([greedy[row]], [hidden[row] if outputs else None],
                                         _InPlace(), logits[row:row + 1] if outputs else None)
                continue
            starts = [items[m][2] for m in members]
            keep = per_position and 1 < n <= VERIFY_STATES_UP_TO  # one token: its end is it
            # a prefill (not per position, or per position with `reads`: a next turn's
            # delta) reads only its last position's greedy token and logits: the others are
            # not made (None)
            last = n > 1 and (not per_position or reads is not None)
            self._launched += 1
            # a per-position delta, or a prefill's short piece (a chat prompt's last: the
            # generation prompt past its message's end): an eager forward of a few tokens
            # costs ~20 ms of launches on anchor-1b, a replay ~1 (bench/NOTES.md, stop 46)
            if (keep or last) and self.turn_graphs is not None \
                    and self.turn_graphs.fits(lanes, n, starts[0], reads):
                greedy, logits, hidden, kept = self.turn_graphs.run(
                    lanes[0], items[members[0]][1], starts[0], reads)
                results[members[0]] = Forward([None] * (n - 1) + [greedy], hidden, kept,
                                              logits[None])
                continue
            if keep and self.verify_graphs is not None and self.verify_graphs.fits(lanes, n):
                out = self.verify_graphs.run(lanes, [list(items[m][1]) for m in members],
                                             starts)
            else:
                out = run_through(self._eager(lanes, [items[m][1] for m in members], starts,
                                              keep, last))
            for m, forward in zip(members, _forwards(out, n, keep, last), strict=True):
                results[m] = forward
        return results

    def _eager(self, lanes: Sequence[Lane], token_lists: Sequence[Sequence[int]],
               starts: Sequence[int], keep: bool, last: bool):
        """The network's forward over the lanes' storage, in parts (a layer each)."""
        n = len(token_lists[0])
        ids = torch.tensor([list(tokens) for tokens in token_lists], device=self.device)
        positions = (torch.tensor(starts, device=self.device)[:, None]
                     + torch.arange(n, device=self.device))  # [B, T]
        state = self._state([lane.slot for lane in lanes], [lane.attn_blocks for lane in lanes],
                            length=max(starts) + n)
        return (yield from self.net.forward_steps(ids, positions, state, all_states=keep,
                                                  last_logits=last))

    @torch.inference_mode()
    def forward_steps(self, lane: Lane, tokens: Sequence[int], start: int,
                      per_position: bool = False, reads: Sequence[int] | None = None):
        """`forward`, a layer a part where it is a prefill chunk run eagerly (more tokens
        than a turn graph takes): between two layers the engine may replay other lanes'
        decode steps. Any other forward is one part."""
        n = len(tokens)
        if per_position or n <= 1 or (self.turn_graphs is not None and self.turn_graphs.fits(
                [lane], n, start, reads)):
            return self.forward(lane, tokens, start, per_position, reads)
        if self.graphs is not None:
            self.graphs.drop_ahead()  # as `forward_batch`: this forward writes its lane
        self._launched += 1
        out = yield from self._eager([lane], [tokens], [start], False, True)
        return _forwards(out, n, False, True)[0]

    def accept(self, lane: Lane, state, hidden=None) -> None:
        if isinstance(state, _InPlace):  # a graph replay updated the slot already
            self._set_hidden(lane.slot, hidden)
            return
        out, row, i = state
        self._writing(lane.slot)
        at = self._at(lane.slot)
        dsts, srcs = [], []
        for layer in self.conv:
            if out.states is not None:
                conv, rec = out.states[layer].conv[row, i], out.states[layer].recurrent[row, i]
            else:
                gdn = out.state.gdn[layer]
                if isinstance(gdn, SlotGDNState):
                    continue  # a one-token step on the GPU updated the slot in place
                conv, rec = gdn.conv[row], gdn.recurrent[row]
            dsts += (self.conv[layer][at], self.recurrent[layer][at])
            srcs += (conv, rec)
        _copy_all(dsts, srcs)
        self._set_hidden(lane.slot, hidden)

    def _set_hidden(self, slot: int, hidden: Tensor | None) -> None:
        self.hidden_valid[slot] = hidden is not None
        if hidden is not None:
            self.hidden[slot] = hidden

    def init_slot(self, lane: Lane) -> None:
        self._writing(lane.slot)
        at = self._at(lane.slot)
        torch._foreach_zero_([t[at] for pool in (self.conv, self.recurrent)
                              for t in pool.values()])
        self.hidden_valid[lane.slot] = False

    def load_hidden(self, slot: int) -> Tensor | None:
        return self.hidden[slot].clone() if self.hidden_valid[slot] else None

    @torch.inference_mode()
    def mtp(self, lane: Lane, position: int, hidden: Tensor, next_token: int) -> MtpOut:
        self._launched += 1
        if self.mtp_graphs is not None and self.mtp_graphs.fits(lane):
            return self.mtp_graphs.run(lane, position, hidden, next_token)
        net = self.net
        positions = torch.tensor([[position]], device=self.device)
        ids = torch.tensor([[next_token]], device=self.device)
        kv = PagedKV(self.mtp_k, self.mtp_v, self.block_size, [lane.mtp_blocks], position + 1)
        out = net.mtp_forward(hidden[None, None], ids, positions, kv)
        logits = out.logits[0, 0]
        return MtpOut(int(logits.argmax()), out.hidden[0, 0], logits)

    @torch.inference_mode()
    def mtp_span(self, lane: Lane, start: int, hidden: Sequence, next_tokens: list) -> MtpOut:
        """One MTP forward over entries start..start+n-1 (a catch-up); logits only for the
        last entry, the one a draft is taken from."""
        self._launched += 1
        if self.mtp_graphs is not None and self.mtp_graphs.fits(lane, len(hidden)):
            return self.mtp_graphs.span(lane, start, hidden, next_tokens)  # one replay
        net, n = self.net, len(hidden)
        positions = torch.arange(start, start + n, device=self.device)[None]  # [1, n]
        ids = torch.tensor([next_tokens], device=self.device)
        kv = PagedKV(self.mtp_k, self.mtp_v, self.block_size, [lane.mtp_blocks], start + n)
        h = torch.stack(list(hidden))[None]  # [1, n, D]
        y = net.mtp(h, net.model.embed_tokens(ids), positions, net.rope(positions, self.dtype),
                    kv)
        logits = net.lm_logits(y[0, -1])
        return MtpOut(int(logits.argmax()), y[0, -1], logits)

    # --- storage ------------------------------------------------------------------------

    def copy_slot(self, src: int, dst: int) -> None:
        self._launched += 1
        self._writing(dst)
        pools = [t for pool in (self.conv, self.recurrent) for t in pool.values()]
        _copy_all([t[self._at(dst)] for t in pools], [t[self._at(src)] for t in pools])
        self.hidden[dst] = self.hidden[src]
        self.hidden_valid[dst] = self.hidden_valid[src]

    def copy_block(self, src: int, dst: int, n: int) -> None:
        self._launched += 1
        stores = [t for store in (self.kv_k, self.kv_v, self.mtp_k, self.mtp_v)
                  for t in store.values()]
        _copy_all([t[dst, :n] for t in stores], [t[src, :n] for t in stores])

    def _positions(self, store: dict[int, Tensor], blocks: list[int], n: int) -> dict:
        """Entries [0, n) of each layer's block storage: [n, Hkv, D] copies."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return {layer: t[idx].reshape(-1, *t.shape[2:])[:n].clone() for layer, t in store.items()}

    def export_parts(self, held) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, store, blocks, n in (
                ("attn_k", self.kv_k, held.attn_blocks, held.position),
                ("attn_v", self.kv_v, held.attn_blocks, held.position),
                ("mtp_k", self.mtp_k, held.mtp_blocks, held.mtp_kv),
                ("mtp_v", self.mtp_v, held.mtp_blocks, held.mtp_kv)):
            if blocks:
                for layer, t in self._positions(store, blocks, n).items():
                    out[f"{name}.{layer}"] = t
        for layer in self.conv:
            out[f"conv.{layer}"] = self.conv[layer][self._at(held.slot)].clone()
            out[f"recurrent.{layer}"] = self.recurrent[layer][self._at(held.slot)].clone()
        if self.hidden_valid[held.slot]:
            out["hidden"] = self.hidden[held.slot].clone()
        return out

    def import_parts(self, held, parts: dict[str, Tensor]) -> None:
        self._launched += 1
        bs = self.block_size
        for name, store, blocks in (("attn_k", self.kv_k, held.attn_blocks),
                                    ("attn_v", self.kv_v, held.attn_blocks),
                                    ("mtp_k", self.mtp_k, held.mtp_blocks),
                                    ("mtp_v", self.mtp_v, held.mtp_blocks)):
            for layer, t in store.items():
                src = parts.get(f"{name}.{layer}")
                if src is None or not blocks:
                    continue
                padded = t.new_zeros((len(blocks) * bs, *t.shape[2:]))
                padded[:src.shape[0]] = src.to(t.device, t.dtype)
                t[torch.tensor(blocks, dtype=torch.long, device=self.device)] = padded.view(
                    len(blocks), bs, *t.shape[2:])
        self._writing(held.slot)
        for layer in self.conv:
            self.conv[layer][self._at(held.slot)] = parts[f"conv.{layer}"].to(self.device)
            self.recurrent[layer][self._at(held.slot)] = parts[f"recurrent.{layer}"].to(
                self.device)
        self._set_hidden(held.slot, parts["hidden"].to(self.device) if "hidden" in parts
                         else None)

    def fence(self) -> int:
        return self._launched

    def completed(self, marker: int) -> bool:
        return marker <= self._completed

    def capture_graphs(self, *, max_context: int, lanes: int,
                       verify_tokens: int = 0) -> dict | None:
        """Capture now every CUDA graph a request could otherwise capture on its first step
        of that shape (the warm-up: `ninfer.server.warmup`): decode graphs of every batch
        size up to `lanes` and block-table width up to `max_context`'s; with
        `verify_tokens` (a round's drafts + 1; 0: no speculation) the verify graphs of 2 ..
        that many tokens, and the MTP graphs when the net has the head; a next turn's (one
        per width, `turn_graphs`). A report (the graphs
        of each kind held afterwards, those a request had captured already among them; the
        seconds and memory the rest took), None without graphs."""
        if self.graphs is None:
            return None
        from .graphs import graph_shapes
        began = time.perf_counter()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        self.graphs.drop_ahead()
        shapes = graph_shapes(max_context=max_context, block_size=self.block_size,
                              lanes=lanes, verify_tokens=verify_tokens,
                              mtp=self.mtp_graphs is not None)
        counts = {"decode": 0, "verify": 0, "mtp": 0, "turn": 0}
        with torch.inference_mode():
            for S, W in shapes["decode"]:
                if (S, W) not in self.graphs.graphs:
                    self.graphs._capture(S, W)
                counts["decode"] += 1
            for S, T, W in shapes["verify"]:
                if (S, T, W) not in self.verify_graphs.graphs:
                    self.verify_graphs._capture(S, T, W)
                counts["verify"] += 1
            for T, W in shapes["mtp"]:
                if (T, W) not in self.mtp_graphs.graphs:
                    self.mtp_graphs._capture(T, W)
                counts["mtp"] += 1
            for (W,) in shapes["turn"]:
                if W not in self.turn_graphs.graphs:
                    self.turn_graphs._capture(W)
                counts["turn"] += 1
        torch.cuda.synchronize(self.device)
        return {**counts, "count": sum(counts.values()),
                "seconds": time.perf_counter() - began,
                "memory_bytes": torch.cuda.memory_reserved(self.device) - before}

    def prepare_prefill(self, *, chunk: int, max_context: int) -> dict:
        """Build now what a served prompt's whole prefill chunks would build on first use
        (the warm-up): cuDNN's plans for the chunk attention's split
        (`chunk_attention.prepare`). The shapes prepared and the seconds taken."""
        began = time.perf_counter()
        c = self.config
        shapes = chunk_attention.prepare(
            heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
            chunk=chunk, max_context=max_context, device=self.device, dtype=self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"shapes": shapes, "seconds": time.perf_counter() - began}

    def allocator_counts(self) -> tuple[int, int] | None:
        """On CUDA, PyTorch's caching allocator's running counts: device memory segments
        allocated (each a cudaMalloc) and allocations retried after freeing its cache (a
        cudaFree of every cached block first); None elsewhere. The slow-step log reports
        what a step added: a first request's cost that no kernel explains."""
        if self.device.type != "cuda":
            return None
        # nested, as the allocator gives them: `memory_stats` flattens ~100 entries in Python,
        # ~0.15 ms on every step of a run with the slow-step log (stop 47's py-spy)
        stats = torch.cuda.memory_stats_as_nested_dict(self.device)
        return (stats.get("segment", {}).get("all", {}).get("allocated", 0),
                stats.get("num_alloc_retries", 0))

    def synchronize(self) -> None:
        """Wait for the engine's work: all of it, but not a step run ahead that nothing
        the engine launched since has to wait for (the GPU goes on with it meanwhile)."""
        if self.device.type == "cuda":
            done = self.graphs.done_before_ahead(self._launched) if self.graphs else None
            if done is not None:
                done.synchronize()
            else:
                torch.cuda.synchronize(self.device)
        self._completed = self._launched

    # --- exactness ----------------------------------------------------------------------

    def read_parts(self, lane: Lane, position: int, mtp_kv: int) -> Parts:
        kv = PagedKV(self.kv_k, self.kv_v, self.block_size, [lane.attn_blocks])
        attn = tuple(t for i in self.kv_k for t in kv.read(i, position))
        mtp: tuple = ()
        if mtp_kv:
            mkv = PagedKV(self.mtp_k, self.mtp_v, self.block_size, [lane.mtp_blocks])
            mtp = tuple(t for i in self.mtp_k for t in mkv.read(i, mtp_kv))
        recurrent = tuple(t for i in self.conv
                          for t in (self.conv[i][self._at(lane.slot)][None],
                                    self.recurrent[i][self._at(lane.slot)][None]))
        return Parts(attn, recurrent, mtp, self.load_hidden(lane.slot))

    @torch.inference_mode()
    def reference_parts(self, tokens: Sequence[int], mtp: bool) -> Parts:
        """The parts at len(tokens), recomputed in one prefill with contiguous KV."""
        c = self.config
        kv = ContiguousKV()
        state = HybridState.initial(c, 1, self.dtype, self.device, kv)
        n = len(tokens)
        ids = torch.tensor([list(tokens)], device=self.device)
        positions = torch.arange(n, device=self.device)[None]
        out = self.net.forward(ids, positions, state)
        attn = tuple(t for i in self.kv_k for t in kv.read(i, n))
        recurrent = tuple(t for i in self.conv
                          for t in (out.state.gdn[i].conv, out.state.gdn[i].recurrent))
        mtp_parts: tuple = ()
        hidden = None
        if mtp and self.net.has_mtp:
            hidden = out.hidden[0, -1]
            mkv = ContiguousKV()
            if n > 1:
                self.net.mtp_forward(out.hidden[:, :-1], ids[:, 1:], positions[:, :-1], mkv)
                mtp_parts = tuple(t for i in self.mtp_k for t in mkv.read(i, n - 1))
        return Parts(attn, recurrent, mtp_parts, hidden)

    def parts_match(self, got: Parts, ref: Parts) -> str | None:
        tol = TOLERANCE.get(self.dtype, 1e-4)
        for name in ("attn_kv", "recurrent", "mtp_kv", "hidden"):
            a, b = getattr(got, name), getattr(ref, name)
            a = a if isinstance(a, tuple) else (a,)
            b = b if isinstance(b, tuple) else (b,)
            if len(a) != len(b) or any(
                    (x is None) != (y is None)
                    or (x is not None and (x.shape != y.shape
                                           or not torch.allclose(x.to(y.dtype), y, atol=tol,
                                                                 rtol=tol)))
                    for x, y in zip(a, b, strict=False)):
                return name
        return None

    @torch.inference_mode()
    def reference_generate(self, tokens: Sequence[int], max_tokens: int,
                           stop_tokens: Sequence[int] = ()) -> list[int]:
        """A plain Root run with contiguous KV: greedy continuation of `tokens`."""
        state = HybridState.initial(self.config, 1, self.dtype, self.device)
        ids = torch.tensor([list(tokens)], device=self.device)
        positions = torch.arange(len(tokens), device=self.device)[None]
        out_tokens: list[int] = []
        while True:
            out = self.net.forward(ids, positions, state, last_logits=True)
            token = int(out.logits[0, -1].argmax())
            out_tokens.append(token)
            if len(out_tokens) >= max_tokens or token in stop_tokens:
                return out_tokens
            state = out.state
            ids = torch.tensor([[token]], device=self.device)
            positions = positions[:, -1:] + 1
