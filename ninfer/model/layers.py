"""Building blocks shared by the hybrid model: norms, rotary embedding, dense MLP, sparse MoE.

Precision: reductions that decide the output's scale (norms, softmax, routing) run in
float32 or wider, `compute_dtype(x)`, so a float64 model stays float64 all the way through
and a bf16 model matches the reference's float32 upcasts.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import kernels_for, skinny_for

from .config import ModelConfig


def compute_dtype(x: Tensor) -> torch.dtype:
    """float32, or x's dtype when it is wider (float64). (Decided in Python: torch's
    promote_types is a dispatched op, and a CPU decode step asks this dozens of times.)"""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in dtype: x itself when it already is, without the dispatch of a no-op `.to`
    (most of a float32 CPU step's casts)."""
    return x if x.dtype == dtype else x.to(dtype)


def packed_weight(module: nn.Module, name: str, sources: list[Tensor], build) -> Tensor:
    """A weight packed from `sources` by `build()` (one GEMM where the checkpoint has
    several), kept on `module` outside its state dict and rebuilt when a source changes.
    The device path uses it; the checkpoint-named parameters stay as they are."""
    key = tuple((t.data_ptr(), t._version) for t in sources)
    cached = module.__dict__.get(name)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, build().contiguous())
        module.__dict__[name] = cached
    return cached[1]


def _rms(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """The zero-centred RMSNorm of Qwen3-Next / Qwen3.5: y = x / rms(x) * (1 + weight).
    Checkpoints store `weight` around 0 (an all-zero weight is the identity scale). Used for
    the decoder norms, the final norm, q/k norms and the MTP norms."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dev = kernels_for(x)
        if dev is not None:  # the whole chain in one kernel
            return dev.rms_norm(x, self.weight, self.eps, 1.0)
        dtype = compute_dtype(x)
        # the scale multiplies before the cast back, as the reference does
        return cast(_rms(cast(x, dtype), self.eps) * (1.0 + cast(self.weight, dtype)), x.dtype)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: y = x / rms(x) * weight * silu(z), with a *plain* weight (stored
    around 1, not zero-centred), over one value head's Dv channels."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        dev = kernels_for(x)
        if dev is not None:
            return dev.gated_rms_norm(x, z, self.weight, self.eps)
        dtype = compute_dtype(x)
        # the reference casts the normalised x back to the input dtype before the weight
        normed = self.weight * cast(_rms(cast(x, dtype), self.eps), x.dtype)
        return cast(normed * F.silu(cast(z, dtype)), x.dtype)


@functools.cache
def _inv_freq(rotary_dim: int, theta: float, wide: torch.dtype, device: torch.device) -> Tensor:
    """The rotary frequencies [rotary_dim/2] twice over (the two halves' angles), made once
    per device (five kernels fewer in every decode step; the first call comes before any
    graph capture)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=wide, device=device)
    half = 1.0 / (theta ** (exponents / rotary_dim))
    return torch.cat([half, half])


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """positions [B, T] -> cos, sin [B, T, rotary_dim] for `apply_rope`, computed in
    float32 or wider, then cast to `dtype`."""
    wide = torch.promote_types(dtype, torch.float32)
    inv_freq = _inv_freq(rotary_dim, float(theta), wide, positions.device)
    # [B, T, rotary_dim] in one kernel: the integer positions promote to `wide` as .to would
    angles = positions[..., None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on the first rotary_dim = cos.shape[-1] channels of each head, in
    the half-split layout (channel i pairs with i + rotary_dim/2); the rest pass through.
    x [B, T, H, D]; cos, sin [B, T, rotary_dim]. Qwen3.5's multimodal RoPE equals this for
    text, where all its position axes agree."""
    dev = kernels_for(x)
    if dev is not None:
        return dev.rope(x, cos, sin)
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = cos[:, :, None], sin[:, :, None]  # broadcast over heads
    return torch.cat([rot * cos + rotated_half * sin, rest], dim=-1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor, norm: RMSNorm | None = None,
                residual: Tensor | None = None) -> Tensor:
        """x [..., hidden] -> [..., hidden]. `norm`: x is normed by it first; `residual`: it
        is added to the output. On the decode path (`skinny_for`) both fold into the GEMMs:
        norm -> gate/up -> silu * up in one kernel, down + residual in another."""
        dev = kernels_for(x)
        if dev is not None:
            g, u = self.gate_proj.weight, self.up_proj.weight
            w = packed_weight(self, "_gate_up", [g, u], lambda: torch.cat([g, u]))
        if dev is not None and skinny_for(x) is not None:
            act = dev.linear(x, w, glu=True) if norm is None else \
                dev.norm_linear(x, norm.weight, norm.eps, w, glu=True)
            return dev.linear(act, self.down_proj.weight, residual)
        if norm is not None:
            x = norm(x)
        if dev is not None:  # gate and up in one GEMM, silu * mul in one kernel
            y = F.linear(x, w)
            n = g.shape[0]
            y = self.down_proj(dev.silu_mul(y[..., :n], y[..., n:]))
        else:
            y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return y if residual is None else residual + y


class SparseMoE(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert.

    Routing: softmax over all experts (wide), keep the top k, renormalise them to sum 1
    when `norm_topk_prob`, weight each chosen expert's output. Experts are kept one module
    each, under the checkpoint's names (`experts.{e}.gate_proj` ...), so loading is a copy;
    a fused device kernel can stack them later."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(h, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(h, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_expert = MLP(h, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # x: [N, D]
        probs = torch.softmax(self.gate(x).to(compute_dtype(x)), dim=-1)  # [N, E]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)
