"""The Gated DeltaNet (linear attention) layer and its explicit per-sequence state."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import kernels_for, skinny_for
from kernels.gdn_reference import (
    causal_conv1d_update,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)

from ..flags import FLAGS
from .config import ModelConfig
from .layers import GatedRMSNorm, RMSNorm, cast, compute_dtype, packed_weight


@dataclass(frozen=True)
class GDNState:
    """One GDN layer's state at a position: the conv tail (the last K-1 conv inputs) and the
    recurrent matrix. Per sequence: conv [B, conv_dim, K-1], recurrent [B, Hv, Dk, Dv].
    A per-position result (`all_states=True`) has a T axis after B: conv [B, T, conv_dim,
    K-1], recurrent [B, T, Hv, Dk, Dv]; `pick` turns it back into a per-sequence state."""

    conv: Tensor
    recurrent: Tensor

    def pick(self, index: Tensor | int) -> GDNState:
        """From a per-position state: the state after position index[b] of each row b."""
        if isinstance(index, int):
            return GDNState(self.conv[:, index], self.recurrent[:, index])
        rows = torch.arange(self.conv.shape[0], device=self.conv.device)
        return GDNState(self.conv[rows, index], self.recurrent[rows, index])

    @staticmethod
    def zeros(config: ModelConfig, batch: int, dtype: torch.dtype,
              device: torch.device | str | None = None) -> GDNState:
        """The state before any token. The recurrent matrix is kept in float32 or wider
        (`state_dtype`), whatever the activations' dtype: it accumulates over the whole
        sequence."""
        c = config
        conv = torch.zeros(batch, c.conv_dim, c.linear_conv_kernel_dim - 1, dtype=dtype,
                           device=device)
        recurrent = torch.zeros(batch, c.linear_num_value_heads, c.linear_key_head_dim,
                                c.linear_value_head_dim, dtype=state_dtype(dtype), device=device)
        return GDNState(conv, recurrent)


@dataclass(frozen=True)
class SlotGDNState:
    """A GDN layer's state left where the engine keeps it: slot pools conv [S, conv_dim,
    K-1] and recurrent [S, Hv, Dk, Dv], lane b at slot `slots[b]` (negative: a padding lane).
    A one-token forward on the GPU updates it in place and returns it as the new state (no
    copy: what a decode step and its CUDA graph need); any other forward reads a copy.
    `dests` [B]: that forward writes lane b's new state to slot dests[b] instead, leaving
    its input as it was (a step run ahead, whose result may be thrown away)."""

    conv_pool: Tensor
    rec_pool: Tensor
    slots: Tensor
    dests: Tensor | None = None

    def gather(self) -> GDNState:
        return GDNState(self.conv_pool[self.slots], self.rec_pool[self.slots])



def state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last axis (eps inside the root, as the reference)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Projections -> causal conv (SiLU) over q, k, v -> L2-normalised q, k -> gated delta rule
    with beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) -> gated RMSNorm with z
    -> out_proj. The two families differ only in how the input projections are packed."""

    # at or below this many tokens the token-by-token rule is cheaper than the chunked one
    RECURRENT_MAX_TOKENS = 4

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        h, kd, vd = c.hidden_size, c.linear_key_dim, c.linear_value_dim
        hv = c.linear_num_value_heads
        self.family = c.family
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, hv
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        if c.family == "qwen3_next":
            # packed per key-head group: [q | k | v (r heads) | z (r heads)], then [b | a]
            self.in_proj_qkvz = nn.Linear(h, 2 * kd + 2 * vd, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, 2 * kd + vd, bias=False)
            self.in_proj_z = nn.Linear(h, vd, bias=False)
            self.in_proj_b = nn.Linear(h, hv, bias=False)
            self.in_proj_a = nn.Linear(h, hv, bias=False)
        # depthwise: weight [conv_dim, 1, K], the checkpoint's shape
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.linear_conv_kernel_dim,
                                groups=c.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(c.linear_value_head_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(vd, h, bias=False)

    def _project(self, x: Tensor, norm: RMSNorm | None = None, conv: tuple | None = None,
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [B, T, hidden] (normed by `norm` first, if given) -> qkv [B, T, conv_dim]
        (q, k, v flat, in that order), z [B, T, Hv, Dv], b, a [B, T, Hv]. `conv`: the
        skinny GEMM's conv epilogue (`skinny.norm_linear`'s; a skinny GEMM with `norm` only)."""
        B, T, _ = x.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        skinny = skinny_for(x)
        if conv is not None and (skinny is None or norm is None):
            raise ValueError("the conv folds only into a one-row GEMM with its norm")
        if norm is not None and skinny is None:
            x = norm(x)
        if kernels_for(x) is not None:  # one GEMM into [q | k | v | z | b | a], views of it
            w = self._packed()
            y = F.linear(x, w) if skinny is None else skinny.linear(x, w) if norm is None \
                else skinny.norm_linear(x, norm.weight, norm.eps, w, conv=conv)
            C, vd = 2 * Hk * Dk + Hv * Dv, Hv * Dv
            return (y[..., :C], y[..., C:C + vd].view(B, T, Hv, Dv),
                    y[..., C + vd:C + vd + Hv], y[..., C + vd + Hv:])
        if self.family == "qwen3_5":
            z = self.in_proj_z(x).view(B, T, Hv, Dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = Hv // Hk  # value heads per key head
        grouped = self.in_proj_qkvz(x).view(B, T, Hk, 2 * Dk + 2 * r * Dv)
        q, k, v, z = grouped.split([Dk, Dk, r * Dv, r * Dv], dim=-1)
        ba = self.in_proj_ba(x).view(B, T, Hk, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        # value head kh * r + j belongs to key head kh: flattening keeps that order
        qkv = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return qkv, z.reshape(B, T, Hv, Dv), b.reshape(B, T, Hv), a.reshape(B, T, Hv)

    def _packed(self) -> Tensor:
        """The input projections as one weight, rows in `_project`'s output order."""
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if self.family == "qwen3_5":
            parts = [self.in_proj_qkv.weight, self.in_proj_z.weight, self.in_proj_b.weight,
                     self.in_proj_a.weight]
            return packed_weight(self, "_packed_in", parts, lambda: torch.cat(parts))
        r = Hv // Hk
        qkvz, ba = self.in_proj_qkvz.weight, self.in_proj_ba.weight

        def build() -> Tensor:
            g = qkvz.view(Hk, 2 * Dk + 2 * r * Dv, -1)  # per key head: q, k, v (r), z (r)
            q, k, v, z = g.split([Dk, Dk, r * Dv, r * Dv], dim=1)
            b, a = ba.view(Hk, 2 * r, -1).split([r, r], dim=1)
            return torch.cat([t.reshape(-1, qkvz.shape[-1]) for t in (q, k, v, z, b, a)])
        return packed_weight(self, "_packed_in", [qkvz, ba], build)

    def forward(self, x: Tensor, state: GDNState | SlotGDNState, all_states: bool = False,
                chunk_size: int = 64, norm: RMSNorm | None = None,
                residual: Tensor | None = None) -> tuple[Tensor, GDNState | SlotGDNState]:
        """x [B, T, hidden] continuing from `state` (the state at the first token's
        position) -> (y [B, T, hidden], new state). The new state is the state after the
        last token, or with `all_states` the per-position state (see GDNState). A
        `GDNState` is not modified; a `SlotGDNState` is updated in place by a one-token
        forward on the GPU (and returned), read as a copy otherwise. On a GPU the Triton
        kernels compute what the torch references compute. `norm`: x is normed by it
        first; `residual`: y is residual + the layer's output (on the decode path,
        `skinny_for`, each folds into the projection GEMM beside it)."""
        B, T, _ = x.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        dev = kernels_for(x)
        if isinstance(state, SlotGDNState):
            if dev is not None and T == 1 and not all_states:
                return self._step_in_place(x, state, dev, norm, residual), state
            if dev is not None and all_states and FLAGS.verify_in_place:
                return self._verify_off_pools(x, state, dev, norm, residual)
            state = state.gather()
        qkv, z, b, a = self._project(x, norm)
        weight = self.conv1d.weight.squeeze(1)
        if dev is not None:  # the kernel writes the tail into the state it gets: a copy
            conv_out, conv_tail = dev.conv(qkv.transpose(1, 2), state.conv.clone(), weight,
                                           activation="silu", all_states=all_states)
        else:
            conv_out, conv_tail = causal_conv1d_update(
                qkv.transpose(1, 2), state.conv, weight, activation="silu",
                all_states=all_states)
        if dev is not None and (all_states or T == 1):  # a verify, or a step off the pools
            o, recurrent = self._steps_on_device(dev, conv_out, b, a, state, all_states)
        else:
            q, k, v = conv_out.transpose(1, 2).split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
            q, k = q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk)
            v = v.reshape(B, T, Hv, Dv)
            o, recurrent = self._rule(dev, q, k, v, b, a, state, all_states, chunk_size)
        return self._out(o, z, residual), GDNState(conv_tail, recurrent.to(state.recurrent.dtype))

    def _rule(self, dev, q, k, v, b, a, state: GDNState, all_states: bool,
              chunk_size: int) -> tuple[Tensor, Tensor]:
        """The rule over q, k, v [B, T, H, D] straight from the conv: a prefill chunk in the
        Triton chunk kernel (its norms and gates in one launch), else the torch references."""
        if dev is not None:
            q, k, beta, g = dev.qk_norm_gates(q, k, b, a, self.A_log, self.dt_bias)
            return dev.chunk(q, k, v, g, beta, initial_state=state.recurrent)
        wide = compute_dtype(q)
        q, k = l2_normalize(cast(q, wide)), l2_normalize(cast(k, wide))  # [B, T, Hk, Dk]
        beta, g = self._gates(b, a, wide)  # [B, T, Hv]
        if all_states or q.shape[1] <= self.RECURRENT_MAX_TOKENS:
            return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state.recurrent,
                                              all_states=all_states)
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state.recurrent,
                                      chunk_size=chunk_size)

    def _out(self, o: Tensor, z: Tensor, residual: Tensor | None) -> Tensor:
        """o, z [B, T, Hv, Dv] -> out_proj(gated norm(o, z)) (+ residual) [B, T, hidden]."""
        B, T, Hv, Dv = o.shape
        skinny = skinny_for(o.reshape(B, T, Hv * Dv))
        if skinny is not None:  # the norm, out_proj and the residual in one kernel
            return skinny.gated_norm_linear(o, z, self.norm.weight, self.norm.eps,
                                            self.out_proj.weight, residual)
        y = self.out_proj(self.norm(o, z).reshape(B, T, Hv * Dv))
        return y if residual is None else residual + y

    def _gates(self, b: Tensor, a: Tensor, wide: torch.dtype) -> tuple[Tensor, Tensor]:
        """beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), in `wide`."""
        beta = torch.sigmoid(cast(b, wide))
        g = -cast(self.A_log, wide).exp() * F.softplus(cast(a, wide) + cast(self.dt_bias, wide))
        return beta, g

    def _steps_on_device(self, dev, conv_out: Tensor, b: Tensor, a: Tensor,
                         state: GDNState | SlotGDNState, all_states: bool
                         ) -> tuple[Tensor, Tensor]:
        """The rule token by token in the step kernel, which normalises q and k and makes
        beta and g from the raw projections itself, as in a decode step (one launch where
        torch takes ~20 a layer, and a verify's arithmetic is the decode step's):
        conv_out [B, conv_dim, T] -> o [B, T, Hv, Dv] and the state after every position
        (`all_states`, a verify) or after the last (on a copy of the input's). A
        `SlotGDNState` (with `all_states` only) is read at the lanes' slots."""
        B, _, T = conv_out.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        qkv = conv_out.transpose(1, 2).contiguous()  # the kernel reads unit-stride heads
        q, k, v = qkv.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        q, k, v = q.view(B, T, Hk, Dk), k.view(B, T, Hk, Dk), v.view(B, T, Hv, Dv)
        gates = (a, b, self.A_log, self.dt_bias)
        if isinstance(state, SlotGDNState):
            return dev.step(q, k, v, None, None, state.rec_pool, state_indices=state.slots,
                            all_states=True, use_qk_l2norm=True, gates=gates)
        if all_states:
            return dev.step(q, k, v, None, None, state.recurrent, all_states=True,
                            use_qk_l2norm=True, gates=gates)
        recurrent = state.recurrent.clone()
        return dev.step(q, k, v, None, None, recurrent, use_qk_l2norm=True,
                        gates=gates), recurrent

    def _verify_off_pools(self, x: Tensor, state: SlotGDNState, dev, norm: RMSNorm | None,
                          residual: Tensor | None) -> tuple[Tensor, GDNState]:
        """A verify's positions continuing from the lanes' slots, which the conv and step
        kernels read in place, and the per-position states (`all_states`). (Gathering both
        pools first was two copies a layer: ~10 us of the ~65 a GDN layer of a 4-position
        verify took on the H100.)"""
        qkv, z, b, a = self._project(x, norm)
        conv_out, conv_tail = dev.conv(qkv.transpose(1, 2), state.conv_pool,
                                       self.conv1d.weight.squeeze(1), activation="silu",
                                       state_indices=state.slots, all_states=True)
        o, recurrent = self._steps_on_device(dev, conv_out, b, a, state, True)
        return self._out(o, z, residual), GDNState(conv_tail, recurrent)

    def _step_in_place(self, x: Tensor, state: SlotGDNState, dev, norm: RMSNorm | None,
                       residual: Tensor | None) -> Tensor:
        """One token per lane, the conv tail and recurrent matrix updated in their slots (or
        written to `state.dests`)."""
        B = x.shape[0]
        dests = state.dests if state.dests is not None else state.slots
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        weight = self.conv1d.weight.squeeze(1)
        if norm is not None and skinny_for(x) is not None:
            # one row: the conv folds into the in-projection's GEMM (one launch fewer)
            conv_out, z, b, a = self._project(x, norm, conv=(
                state.conv_pool, state.slots, weight, dests))
        else:
            qkv, z, b, a = self._project(x, norm)  # qkv: [B, 1, conv_dim]
            conv_out = dev.conv(qkv.transpose(1, 2), state.conv_pool, weight,
                                activation="silu", state_indices=state.slots,
                                out_indices=dests)[0].transpose(1, 2)
        q, k, v = conv_out.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        o = dev.step(q.reshape(B, 1, Hk, Dk), k.reshape(B, 1, Hk, Dk), v.reshape(B, 1, Hv, Dv),
                     None, None, state.rec_pool, state_indices=state.slots, use_qk_l2norm=True,
                     gates=(a, b, self.A_log, self.dt_bias), out_indices=dests,
                     early_state=True)  # the pools were written before this forward began
        return self._out(o, z, residual)  # o: [B, 1, Hv, Dv]
