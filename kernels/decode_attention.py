"""An attention layer's mixer for one new token per lane: the q / k norms and rotary
embedding of the packed projection, the new k and v written into the paged cache and
flash-decoding over the lane's KV in one launch, then `kernels.paged_attention`'s merge of
the splits.

In a batch-1 decode step the first part was two kernels (`kernels.kv_write`'s prologue and
`kernels.paged_attention`'s split kernel), the second waiting on a chain of dependent
reads: the KV length, the block table, then the KV tiles from DRAM. Here a program of
(lane, KV head, split) loads its first tile of the old positions before it waits for the
projection (`kernels.pdl`): what it reads there was written by earlier forwards (the KV)
or before this forward's chain began (the positions and block tables: the host's inputs).
The new position's k and v come from the projection, in registers, for the split that
covers it, which also writes them into the cache. (Merging in the same launch, by the last
split to finish, was measured on the H200: its loop over the splits' parts from L2 made
the kernel 18 us a layer against 11 us for the three kernels; the separate merge reads
them in parallel.)

The arithmetic is `kv_write.attention_prologue` then `paged_attention.paged_attention_decode`
with a causal tail of one: the normed, rotated q and k rounded as the torch chain rounds,
softmax and accumulation in float32, splits merged in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ninfer.flags import FLAGS

from . import pdl
from .kv_write import _check, norm_rope
from .paged_attention import (
    LOG2E,
    _default_splits,
    _interpreting,
    kv_tile,
    merge_splits,
    online_softmax_step,
    split_range,
)


@triton.jit
def _decode_attention_kernel(
    y_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, out_ptr,
    po_ptr, pl_ptr, eps, offset, qk_scale,
    s_yb, s_cb, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_bt, s_pb0, s_ob, s_oh,
    s_pb, s_ph, s_ps, s_lb, s_lh,
    H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    BD: tl.constexpr, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SPLITS: tl.constexpr, F32_DOT: tl.constexpr, SKIP: tl.constexpr, PDL: tl.constexpr,
):
    pdl.launch_dependents(PDL)
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    b, kvh = i_bh // HKV, i_bh % HKV
    # the position this forward adds: an input of the forward, read before the wait
    new = tl.load(pos_ptr + b * s_pb0).to(tl.int32)
    lo, hi = split_range(new + 1, i_s, BN, SPLITS)
    if (lo < hi) | (SPLITS == 1) | (not SKIP):  # an empty split ends here, writing nothing
        _attend_new(y_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, bt_ptr, out_ptr,
                    po_ptr, pl_ptr, eps, offset, qk_scale,
                    s_yb, s_cb, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_bt, s_ob, s_oh,
                    s_pb, s_ph, s_ps, s_lb, s_lh, b, kvh, i_s, new, lo, hi,
                    H, HKV, G, D, R, BD, BLOCK, BM, BN, SPLITS, F32_DOT, PDL)


@triton.jit
def _attend_new(
    y_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, bt_ptr, out_ptr,
    po_ptr, pl_ptr, eps, offset, qk_scale,
    s_yb, s_cb, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_bt, s_ob, s_oh,
    s_pb, s_ph, s_ps, s_lb, s_lh, b, kvh, i_s, new, lo, hi,
    H: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    BD: tl.constexpr, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SPLITS: tl.constexpr, F32_DOT: tl.constexpr, PDL: tl.constexpr,
):
    """Split i_s's tiles [lo, hi) of lane b's KV head kvh, with the new position `new`."""
    dt = y_ptr.dtype.element_ty
    seq_len = new + 1
    # before the wait: the first tile of this split's old positions (earlier forwards')
    offs_d = tl.arange(0, BD)
    m_d = offs_d < D
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    offs_n = lo * BN + tl.arange(0, BN)
    k0, v0 = kv_tile(k_ptr, v_ptr, bt_row, offs_n, (offs_n < new) & (offs_n < hi * BN), offs_d,
                     m_d, kvh, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, BLOCK)
    pdl.wait(PDL)

    # the G query heads of this KV head (rows >= G: padding), and the new k and v
    row = y_ptr + b.to(tl.int64) * s_yb
    rows = tl.arange(0, BM)
    m_row = rows < G
    head = kvh * G + tl.minimum(rows, G - 1)  # [q | gate] per query head
    c_ptr, s_ptr = cos_ptr + b * s_cb, sin_ptr + b * s_cb
    q = norm_rope(row + (head * 2 * D)[:, None], qw_ptr, c_ptr, s_ptr, offs_d, m_d, eps, offset,
                  D, R, dt)  # [BM, BD]
    k_new = norm_rope(row + 2 * H * D + kvh * D, kw_ptr, c_ptr, s_ptr, offs_d, m_d, eps,
                      offset, D, R, dt)  # [BD]
    v_new = tl.load(row + (2 * H + HKV) * D + kvh * D + offs_d, mask=m_d, other=0.0)
    if (new >= lo * BN) & (new < hi * BN):  # this split holds the new position: it writes it
        page = tl.load(bt_row + new // BLOCK).to(tl.int64)
        within = new % BLOCK
        tl.store(k_ptr + page * s_kn + within * s_kp + kvh * s_kh + offs_d,
                 k_new.to(k_ptr.dtype.element_ty), mask=m_d)
        tl.store(v_ptr + page * s_vn + within * s_vp + kvh * s_vh + offs_d,
                 v_new.to(v_ptr.dtype.element_ty), mask=m_d)
    k_new = k_new.to(k_ptr.dtype.element_ty)[None, :]
    v_new = v_new.to(v_ptr.dtype.element_ty)[None, :]

    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    k, v = k0, v0
    for j in range(lo, hi):
        offs_n = j * BN + tl.arange(0, BN)
        if j > lo:
            k, v = kv_tile(k_ptr, v_ptr, bt_row, offs_n, offs_n < new, offs_d, m_d, kvh,
                           s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, BLOCK)
        is_new = (offs_n == new)[:, None]
        k = tl.where(is_new, k_new, k)
        v = tl.where(is_new, v_new, v)
        m_i, l_i, acc = online_softmax_step(q, k, v, (offs_n < seq_len)[None, :], m_i, l_i,
                                            acc, qk_scale, F32_DOT)

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # a row that saw nothing gives zeros
    m_out = m_row[:, None] & m_d[None, :]
    head = kvh * G + rows
    if SPLITS == 1:
        tl.store(out_ptr + b.to(tl.int64) * s_ob + head[:, None] * s_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_out)
    else:  # this split's part, merged by `paged_attention`'s merge kernel
        tl.store(po_ptr + b * s_pb + head[:, None] * s_ph + i_s * s_ps + offs_d[None, :], o,
                 mask=m_out)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(pl_ptr + b * s_lb + head * s_lh + i_s, lse, mask=m_row)


def decode_attention(y: Tensor, heads: int, kv_heads: int, head_dim: int, q_norm: Tensor,
                     k_norm: Tensor, eps: float, cos: Tensor, sin: Tensor, k_cache: Tensor,
                     v_cache: Tensor, block_tables: Tensor, positions: Tensor,
                     offset: float = 1.0, scale: float | None = None,
                     num_splits: int | None = None, BN: int | None = None,
                     num_warps: int | None = None) -> Tensor:
    """One new token per lane. y [B, 1, (2H + 2Hkv) D]: the packed projection ([q | gate]
    per query head, then k, then v); positions [B, 1] int: the new token's position in
    each lane (block_tables [B, blocks] must hold its block). Writes the normed, rotated k
    and v there in k_cache, v_cache [blocks, block_size, Hkv, D], and returns the
    attention output [B, 1, H, D] (y's dtype) of the normed, rotated q over positions
    [0, position]. cos, sin: [B, 1, R]. Equals `attention_prologue` then
    `paged_attention_decode` (`decode_attention_reference`)."""
    B, T, _ = y.shape
    if T != 1 or positions.shape != (B, 1) or heads % kv_heads:
        raise ValueError(f"decode attention takes one token per lane and positions [{B}, 1], "
                         f"got y {tuple(y.shape)}, positions {tuple(positions.shape)}")
    _check(y, heads, kv_heads, head_dim, cos, k_cache, v_cache, block_tables, positions)
    if sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    G, D = heads // kv_heads, head_dim
    BD = triton.next_power_of_2(D)
    f32 = y.dtype == torch.float32
    BM = max(16, triton.next_power_of_2(G))
    # KV positions per tile (and so per split's first load, held in registers before the
    # PDL wait): fewer where the heads are wider than 128 or the dtype is float32
    BN = BN or (64 if D <= 128 and not f32 else FLAGS.wide_attention_tile)
    splits = num_splits or _default_splits(B * kv_heads, block_tables.shape[1] * k_cache.shape[1],
                                           BN)
    num_warps = num_warps or (8 if f32 or BM * BD > 4096 else 4)
    out = y.new_empty(B, 1, heads, D)
    if splits > 1:  # [B, 1, H, splits, D] and [B, 1, H, splits], as the merge kernel reads
        part_o = torch.empty(B, 1, heads, splits, D, dtype=torch.float32, device=y.device)
        part_l = torch.empty(B, 1, heads, splits, dtype=torch.float32, device=y.device)
    else:
        part_o = part_l = out  # unused
    p_strides = part_o.stride()[:4] if splits > 1 else (0, 0, 0, 0)
    l_strides = part_l.stride()[:3] if splits > 1 else (0, 0, 0)
    scale = D ** -0.5 if scale is None else float(scale)
    _decode_attention_kernel[(B * kv_heads, splits)](
        y, q_norm, k_norm, cos, sin, k_cache, v_cache, block_tables, positions, out,
        part_o, part_l, eps, offset, scale * LOG2E,
        y.stride(0), cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), positions.stride(0), out.stride(0), out.stride(2),
        p_strides[0], p_strides[2], p_strides[3], l_strides[0], l_strides[2],
        H=heads, HKV=kv_heads, G=G, D=D, R=cos.shape[-1], BD=BD, BLOCK=k_cache.shape[1],
        BM=BM, BN=BN, SPLITS=splits, F32_DOT=f32 or _interpreting(),
        SKIP=FLAGS.skip_empty_splits, num_warps=num_warps, **pdl.launch(y))
    if splits > 1:
        merge_splits(out, part_o, part_l, p_strides, l_strides, splits, BN, positions[:, 0],
                     add=1, early=True)
    return out


def decode_attention_reference(y, heads, kv_heads, head_dim, q_norm, k_norm, eps, cos, sin,
                               k_cache, v_cache, block_tables, positions, offset=1.0):
    """The chain this replaces: the prologue's torch reference, then paged attention's."""
    from .kv_write import attention_prologue_reference
    from .paged_attention import paged_attention_reference
    q = attention_prologue_reference(y, heads, kv_heads, head_dim, q_norm, k_norm, eps, cos,
                                     sin, k_cache, v_cache, block_tables, positions, offset)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, positions[:, 0] + 1)
