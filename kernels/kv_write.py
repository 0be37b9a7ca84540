"""The attention layer's step between its projection and its attention, in one launch:
q and k each get the zero-centred RMSNorm over the head and the half-split rotary
embedding, and k and v are written into the paged KV cache at the tokens' positions.

As torch ops that is two norms, two rotary embeddings, the block lookup (a division, a
gather, a remainder) and two indexed writes: nine kernels per attention layer and step.
Here one program takes one head of one token (query heads first, then the KV heads) and
rounds where that chain rounds (the normed head to the input dtype before the rotation, each
product of the rotation, then their sum), so it agrees with `attention_prologue_reference`
to the bit on a GPU. The KV lands cast to the cache's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl


@triton.jit
def _normed(x, w_ptr, cols, m, inv, offset, dt: tl.constexpr):
    """Columns `cols` of a head (x: their float32 values), normed: x * inv * (offset + w),
    rounded to dt."""
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    return (x * inv * (offset + w)).to(dt)


@triton.jit
def norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, cols, m, eps, offset, D: tl.constexpr,
              R: tl.constexpr, dt: tl.constexpr):
    """Heads normed and rotated, rounded where the torch chain rounds: x_ptr points at
    channel 0 of one head (a scalar pointer: [BD] back) or of several ([N, 1]: [N, BD]);
    cols [BD] the channels (m: those below D); cos_ptr / sin_ptr the position's [R] angles."""
    x = tl.load(x_ptr + cols, mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
    normed = _normed(x, w_ptr, cols, m, inv, offset, dt)
    rot = cols < R
    half: tl.constexpr = R // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    x_partner = tl.load(x_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    other = _normed(x_partner, w_ptr, partner, rot, inv, offset, dt).to(tl.float32)
    other = tl.where(cols < half, -other, other)  # rotate_half: [-x2, x1]
    c = tl.load(cos_ptr + cols, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cols, mask=rot, other=0.0).to(tl.float32)
    a = (normed.to(tl.float32) * c).to(dt).to(tl.float32)
    return tl.where(rot, (a + (other * s).to(dt).to(tl.float32)).to(dt), normed)


# T, the block table's width (s_bt) and the positions' row stride (s_pb = T) follow the
# request, not the model: never specialised
@triton.jit(do_not_specialize=["T", "s_bt", "s_pb"])
def _prologue_kernel(y_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out, k_cache, v_cache,
                     bt_ptr, pos_ptr, T, eps, offset,
                     s_yb, s_yt, s_qb, s_qt, s_qh, s_cb, s_ct, s_kn, s_kp, s_kh,
                     s_vn, s_vp, s_vh, s_bt, s_pb, s_pt,
                     H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                     BD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    bt_row, head = tl.program_id(0), tl.program_id(1)
    b, t = bt_row // T, bt_row % T
    dt = y_ptr.dtype.element_ty
    cols = tl.arange(0, BD)
    m = cols < D
    row = y_ptr + b.to(tl.int64) * s_yb + t.to(tl.int64) * s_yt
    pos = tl.load(pos_ptr + b * s_pb + t * s_pt).to(tl.int64)
    block = tl.load(bt_ptr + b.to(tl.int64) * s_bt + pos // BLOCK).to(tl.int64)
    slot = pos % BLOCK
    if head >= H + HKV:  # a value head: copied into its block
        kvh = head - H - HKV
        v = tl.load(row + (2 * H + HKV) * D + kvh * D + cols, mask=m, other=0.0)
        dst = v_cache + block * s_vn + slot * s_vp + kvh * s_vh + cols
        tl.store(dst, v.to(v_cache.dtype.element_ty), mask=m)
    else:
        if head < H:  # the query of head h sits in the first half of its [q | gate] pair
            x_ptr = row + head * 2 * D
            w_ptr = qw_ptr
        else:
            x_ptr = row + 2 * H * D + (head - H) * D
            w_ptr = kw_ptr
        y = norm_rope(x_ptr, w_ptr, cos_ptr + b * s_cb + t * s_ct, sin_ptr + b * s_cb + t * s_ct,
                      cols, m, eps, offset, D, R, dt)
        if head < H:
            tl.store(q_out + b * s_qb + t * s_qt + head * s_qh + cols, y, mask=m)
        else:
            kvh = head - H
            dst = k_cache + block * s_kn + slot * s_kp + kvh * s_kh + cols
            tl.store(dst, y.to(k_cache.dtype.element_ty), mask=m)


def _check(y: Tensor, heads: int, kv_heads: int, head_dim: int, cos: Tensor,
           k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, positions: Tensor) -> None:
    B, T, width = y.shape
    if width != (2 * heads + 2 * kv_heads) * head_dim or y.stride(-1) != 1:
        raise ValueError(f"y must be [B, T, (2 * {heads} + 2 * {kv_heads}) * {head_dim}] with "
                         f"a unit last stride, got {tuple(y.shape)}")
    if positions.shape != (B, T) or cos.shape[:2] != (B, T) or cos.stride(-1) != 1:
        raise ValueError(f"positions and cos / sin must be [{B}, {T}, ...], got "
                         f"{tuple(positions.shape)}, {tuple(cos.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[2:]) != (kv_heads, head_dim) or c.stride(-1) != 1:
            raise ValueError(f"{name} must be [blocks, block_size, {kv_heads}, {head_dim}] "
                             f"with a unit last stride, got {tuple(c.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [{B}, blocks], got {tuple(block_tables.shape)}")


def attention_prologue(y: Tensor, heads: int, kv_heads: int, head_dim: int,
                       q_norm: Tensor, k_norm: Tensor, eps: float, cos: Tensor, sin: Tensor,
                       k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                       positions: Tensor, offset: float = 1.0) -> Tensor:
    """y [B, T, (2H + 2Hkv) D]: the packed projection, per query head [q | gate], then the
    keys and the values. Writes the normed, rotated k and v at `positions` [B, T] through
    `block_tables` [B, blocks] into k_cache, v_cache [blocks, block_size, Hkv, D], and
    returns the normed, rotated q [B, T, H, D]. cos, sin: [B, T, R] (R even, <= D)."""
    _check(y, heads, kv_heads, head_dim, cos, k_cache, v_cache, block_tables, positions)
    B, T, _ = y.shape
    R = cos.shape[-1]
    if sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(B, T, heads, head_dim, dtype=y.dtype, device=y.device)
    if B * T == 0:
        return q
    _prologue_kernel[(B * T, heads + 2 * kv_heads)](
        y, q_norm, k_norm, cos, sin, q, k_cache, v_cache, block_tables, positions, T,
        eps, offset, y.stride(0), y.stride(1), q.stride(0), q.stride(1), q.stride(2),
        cos.stride(0), cos.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), positions.stride(0), positions.stride(1),
        H=heads, HKV=kv_heads, D=head_dim, R=R, BD=triton.next_power_of_2(head_dim),
        BLOCK=k_cache.shape[1], **pdl.launch(y))
    return q


def attention_prologue_reference(y, heads, kv_heads, head_dim, q_norm, k_norm, eps, cos, sin,
                                 k_cache, v_cache, block_tables, positions, offset=1.0):
    """The torch chain: norms, rotary embeddings, the block lookup and the writes."""
    B, T, _ = y.shape
    H, Hkv, D = heads, kv_heads, head_dim
    nq = 2 * H * D
    q = y[..., :nq].view(B, T, H, 2 * D)[..., :D]
    k = y[..., nq:nq + Hkv * D].view(B, T, Hkv, D)
    v = y[..., nq + Hkv * D:].view(B, T, Hkv, D)
    wide = torch.promote_types(y.dtype, torch.float32)

    def norm(x, w):
        xf = x.to(wide)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                * (offset + w.to(wide))).to(x.dtype)

    def rope(x):
        R = cos.shape[-1]
        rot, rest = x[..., :R], x[..., R:]
        rotated = torch.cat([-rot[..., R // 2:], rot[..., :R // 2]], dim=-1)
        c, s = cos[:, :, None], sin[:, :, None]
        return torch.cat([rot * c + rotated * s, rest], dim=-1)

    q, k = rope(norm(q, q_norm)), rope(norm(k, k_norm))
    block_size = k_cache.shape[1]
    blocks = block_tables.gather(1, positions // block_size)
    slots = positions % block_size
    k_cache[blocks, slots] = k.to(k_cache.dtype)
    v_cache[blocks, slots] = v.to(v_cache.dtype)
    return q
