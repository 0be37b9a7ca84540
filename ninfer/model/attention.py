"""Gated full attention, and the small KV interface it reads and writes through.

The layer never holds its KV: it writes K, V at the tokens' positions and reads K, V for
[0, L) through a `KVStore`, so the engine can swap the contiguous store below for a paged
one (block tables per lane) without touching the model.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import kernels_for, skinny_for

from .chunk_attention import chunk_attention, without_cudnn
from .config import ModelConfig
from .layers import RMSNorm, apply_rope, compute_dtype, packed_weight


class KVStore(Protocol):
    """Attention KV storage for a batch of rows, per layer key (an int chosen by the caller).

    Contract: `write` stores k, v [B, T, Hkv, D] at positions [B, T] (row b's token t goes
    to position positions[b, t], overwriting what was there). `read(layer, length)` returns
    K, V [B, length, Hkv, D] for positions [0, length) of every row; a position a row has
    not written may hold anything (the attention masks keys after each query's position,
    so a row only ever sees positions it wrote). A store may also carry `length`, one past
    the forward's last position where its maker knew it on the host (`PagedKV`); without
    it the attention takes it from the positions."""

    def write(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> None: ...

    def read(self, layer: int, length: int) -> tuple[Tensor, Tensor]: ...


class ContiguousKV:
    """A KVStore holding one growable [B, capacity, Hkv, D] tensor pair per layer key."""

    def __init__(self, initial_capacity: int = 64) -> None:
        self.initial_capacity = initial_capacity
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def _reserve(self, layer: int, like: Tensor, needed: int) -> None:
        B, _, H, D = like.shape
        if layer not in self.k:
            cap = max(self.initial_capacity, needed)
            self.k[layer] = like.new_zeros(B, cap, H, D)
            self.v[layer] = like.new_zeros(B, cap, H, D)
        cap = self.k[layer].shape[1]
        if needed > cap:  # grow geometrically so a long decode does not copy every step
            grow = max(needed, 2 * cap) - cap
            for store in (self.k, self.v):
                store[layer] = torch.cat([store[layer], like.new_zeros(B, grow, H, D)], dim=1)

    def write(self, layer: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        self._reserve(layer, k, int(positions.max()) + 1)
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        self.k[layer][rows, positions] = k
        self.v[layer][rows, positions] = v

    def read(self, layer: int, length: int) -> tuple[Tensor, Tensor]:
        if layer not in self.k or self.k[layer].shape[1] < length:
            raise KeyError(f"KV of layer {layer} has no positions up to {length}")
        return self.k[layer][:, :length], self.v[layer][:, :length]


class GatedAttention(nn.Module):
    """Full causal attention with an output gate (Qwen3-Next / Qwen3.5).

    q_proj yields, per head, the query and a gate of the same width; q and k get a
    zero-centred RMSNorm over head_dim, then partial RoPE; K/V heads are shared by groups of
    query heads (GQA); the attention output is multiplied by sigmoid(gate) before o_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, D = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, D)
        self.q_proj = nn.Linear(h, 2 * self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, h, bias=False)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def forward(self, x: Tensor, positions: Tensor, cos_sin: tuple[Tensor, Tensor], kv: KVStore,
                layer: int, norm: RMSNorm | None = None,
                residual: Tensor | None = None) -> Tensor:
        """x [B, T, hidden], positions [B, T], cos_sin from `rope_cos_sin` -> [B, T, hidden]. Writes
        this layer's K, V at `positions` into `kv` under key `layer`, then attends over
        [0, max position] with a per-row causal mask by position. `norm`: x is normed by it
        first; `residual`: it is added to the output (on the decode path, `skinny_for`, each
        folds into the projection GEMM beside it)."""
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        skinny = skinny_for(x)
        if norm is not None and skinny is None:
            x = norm(x)
        if kernels_for(x) is not None:  # the three projections as one GEMM
            parts = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
            w = packed_weight(self, "_qkv", parts, lambda: torch.cat(parts))
            y = F.linear(x, w) if skinny is None else skinny.linear(x, w) if norm is None \
                else skinny.norm_linear(x, norm.weight, norm.eps, w)
            nq, nk = 2 * H * D, Hkv * D
            q_and_gate = y[..., :nq].view(B, T, H, 2 * D)
            k = y[..., nq:nq + nk].view(B, T, Hkv, D)
            v = y[..., nq + nk:].view(B, T, Hkv, D)
            # a store that takes the packed projection: one new token per lane, the whole
            # mixer in one launch (norms, rotations, the KV write and the attention); else
            # norms, rotations and the KV write in one (None where either does not apply)
            whole = getattr(kv, "decode_attention", None)
            out = whole(layer, y, positions, cos_sin, self) if whole else None
            if out is not None:
                return self._output(out, q_and_gate[..., D:], skinny, residual)
            prologue = getattr(kv, "prologue", None)
            ready = prologue(layer, y, positions, cos_sin, self) if prologue else None
        else:
            q_and_gate = self.q_proj(x).view(B, T, H, 2 * D)
            k = self.k_proj(x).view(B, T, Hkv, D)
            v = self.v_proj(x).view(B, T, Hkv, D)
            ready = None
        q, gate = q_and_gate[..., :D], q_and_gate[..., D:]  # q: [B, T, H, D], gate likewise
        if ready is not None:
            q = ready
        else:
            cos, sin = cos_sin
            q = apply_rope(self.q_norm(q), cos, sin)
            k = apply_rope(self.k_norm(k), cos, sin)
            kv.write(layer, positions, k, v)

        attend = getattr(kv, "attend", None)  # a store that attends on the device itself
        out = attend(layer, q, positions) if attend is not None else None
        if out is None:
            out = self._attend(x, q, positions, kv, layer)
        return self._output(out, gate, skinny, residual)

    def _output(self, out: Tensor, gate: Tensor, skinny, residual: Tensor | None) -> Tensor:
        """The attention output [B, T, H, D] gated by sigmoid(gate), projected (+ residual)."""
        B, T, H, D = out.shape
        if skinny is not None:  # the gate, o_proj and the residual in one kernel
            return skinny.gate_linear(out.contiguous(), gate, self.o_proj.weight, residual)
        dev = kernels_for(out)
        out = dev.sigmoid_mul(out, gate) if dev is not None else out * torch.sigmoid(gate)
        out = self.o_proj(out.reshape(B, T, H * D))
        return out if residual is None else residual + out

    def _attend(self, x: Tensor, q: Tensor, positions: Tensor, kv: KVStore,
                layer: int) -> Tensor:
        """SDPA over K, V [0, max position] read from `kv`: [B, T, H, D] in x's dtype."""
        B, T, H, D = q.shape
        # one past the last position: from the store where the caller knew it on the host
        length = getattr(kv, "length", None) or int(positions.max()) + 1
        keys, values = kv.read(layer, length)  # [B, L, Hkv, D]
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and B == 1 and T > 1:
            return self._prefill_chunk(q, keys.to(x.dtype), values.to(x.dtype))
        wide = compute_dtype(x)
        q_, k_, v_ = (t.transpose(1, 2).to(wide) for t in (q, keys, values))  # [B, H*, ., D]
        mask, causal = None, False
        if B == 1 and length == T:  # a prefill from position 0: plain causal
            causal = T > 1
        elif not (B == 1 and T == 1):  # one decode row sees everything it wrote
            key_pos = torch.arange(length, device=x.device)
            mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, L]
        # (several lanes' prefill, a verify: shapes that follow the requests, so no cuDNN,
        # which builds a plan per shape; eight lanes' first turns together took 180-480 ms
        # of launching on an H100, stop 47, not yet measured without it)
        with without_cudnn():
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, is_causal=causal,
                                                 scale=D ** -0.5,
                                                 enable_gqa=H != self.num_kv_heads)
        return out.transpose(1, 2).to(x.dtype)  # [B, T, H, D]

    def _prefill_chunk(self, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """One lane's T consecutive positions ending at the last of keys / values' L (a
        prefill chunk; every caller's positions are consecutive), on the GPU in bf16 /
        fp16, by `chunk_attention` (the causal mask aligned to the bottom right: query i
        sees keys up to L - T + i). In float32 (the rest of `_attend`) SDPA has no flash
        kernel and takes its math path."""
        k_, v_ = (t.transpose(1, 2) for t in (keys, values))  # [1, Hkv, L, D]
        out = chunk_attention(q.transpose(1, 2), k_, v_, q.shape[-1] ** -0.5)
        return out.transpose(1, 2)  # [1, T, H, D]
