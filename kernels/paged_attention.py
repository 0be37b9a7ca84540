"""Attention over a paged KV cache for decode and speculative verify (T <= 32 new positions).

Flash-decoding: each lane's KV length is cut into `num_splits` equal runs of tiles, one
program per (lane, KV head, query-row block, split) computes an online softmax over its run
(float32) for all the query heads sharing that KV head and all T positions, and a second
kernel merges the splits by their log-sum-exp. The splits follow each lane's actual
seq_len at run time, so the grid depends only on shapes (CUDA-graph friendly). A split
with no tile of its lane's positions ends at once (`FLAGS.skip_empty_splits`), before its
PDL wait, and writes nothing: the merge reads only the splits that worked, which it counts
from the same seq_len. At batch 1 the grid has ~2 programs per SM so that a long context
fills the GPU, and at a short one all but a few would otherwise wait, write an empty part,
and have the merge read it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ninfer.flags import FLAGS

from . import pdl

LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    # the interpreter's tl.dot is wrong for bfloat16 operands (Triton 3.9): there, dots run
    # in float32 on the same rounded values, which is what the tensor cores compute
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def kv_tile(k_ptr, v_ptr, bt_row, offs_n, m_n, offs_d, m_d, kvh, s_kn, s_kp, s_kh, s_vn, s_vp,
            s_vh, BLOCK: tl.constexpr):
    """K and V of positions offs_n (where m_n) through the lane's block table: [BN, BD].
    Masked to zero: p = 0 times stale (even NaN) cache memory would still poison acc."""
    page = tl.load(bt_row + offs_n // BLOCK, mask=m_n, other=0).to(tl.int64)
    within = offs_n % BLOCK
    m = m_n[:, None] & m_d[None, :]
    k = tl.load(k_ptr + page[:, None] * s_kn + within[:, None] * s_kp + kvh * s_kh
                + offs_d[None, :], mask=m, other=0.0)
    v = tl.load(v_ptr + page[:, None] * s_vn + within[:, None] * s_vp + kvh * s_vh
                + offs_d[None, :], mask=m, other=0.0)
    return k, v


@triton.jit
def split_range(seq_len, i_s, BN: tl.constexpr, SPLITS):
    """The tiles [lo, hi) of BN positions that split i_s of a lane of seq_len attends: the
    lane's tiles cut into SPLITS equal runs (the last ones may be empty). SPLITS: a
    constexpr (a graph's kernel) or a runtime value (`paged_attention_decode`'s)."""
    n_tiles = tl.cdiv(seq_len, BN)
    per_split = tl.cdiv(n_tiles, SPLITS)
    lo = i_s * per_split
    return lo, tl.minimum(lo + per_split, n_tiles)


@triton.jit
def worked_splits(seq_len, BN: tl.constexpr, SPLITS):
    """How many of the SPLITS splits of a lane of seq_len have a tile (`split_range`):
    the first ones, all the others empty."""
    n_tiles = tl.cdiv(seq_len, BN)
    per_split = tl.cdiv(n_tiles, SPLITS)
    return tl.where(per_split > 0, tl.cdiv(n_tiles, tl.maximum(per_split, 1)), 0)


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, F32_DOT: tl.constexpr):
    """One KV tile of flash attention: q [BM, BD], k, v [BN, BD], visible [BM, BN] (or
    broadcast to it); the running max m_i, sum l_i [BM] and output acc [BM, BD] updated."""
    if F32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = (s * qk_scale).to(tl.float32)  # log2 units (a compiled caller may pass fp64)
    s = tl.where(visible, s, float("-inf"))  # s: [BM, BN]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if F32_DOT:
        # p rounded to v's dtype first, as the low-precision dot below does
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


# `splits` is a runtime value, never specialised: it follows the lane's table capacity and
# the programs (`_default_splits`), so as a constexpr every context length of a short
# prefill (a next turn's few tokens: 17 splits at 1K of context, 33 at 4K) compiled a
# kernel of its own on its first request. Nor are the other integers that follow a request
# rather than the model: the query length T, the block table's row stride (its width) and the
# log-sum-exps' strides (they follow `splits`). Triton specialises an integer on being 1 or a
# multiple of 16, so each of them doubled or tripled the kernels a served request could meet
# after the warm-up (stop 43's H100 run met four new ones on its first requests, ~0.5 s each).
_PER_REQUEST = ["T", "splits", "s_bt", "s_lb", "s_lt", "s_lh"]


@triton.jit(do_not_specialize=_PER_REQUEST)
def _paged_attn_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, out_ptr, po_ptr, pl_ptr,
    T, qk_scale,
    s_qb, s_qt, s_qh, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_bt,
    s_ob, s_ot, s_oh, s_pb, s_pt, s_ph, s_ps, s_lb, s_lt, s_lh,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, splits, SPLIT: tl.constexpr,
    CAUSAL: tl.constexpr, F32_DOT: tl.constexpr, SKIP: tl.constexpr, PDL: tl.constexpr,
):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)  # (the lengths are this forward's: a kernel may have written them)
    i_bh, i_m, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kvh = i_bh // HKV, i_bh % HKV
    seq_len = tl.load(len_ptr + b).to(tl.int32)
    lo, hi = split_range(seq_len, i_s, BN, splits)
    if (lo < hi) | (not SPLIT) | (not SKIP):  # (an empty split writes nothing)
        _attend_split(q_ptr, k_ptr, v_ptr, bt_ptr, out_ptr, po_ptr, pl_ptr, T, qk_scale,
                      s_qb, s_qt, s_qh, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_bt,
                      s_ob, s_ot, s_oh, s_pb, s_pt, s_ph, s_ps, s_lb, s_lt, s_lh,
                      b, kvh, i_m, i_s, seq_len, lo, hi, G, D, BD, BLOCK, BM, BN, SPLIT,
                      CAUSAL, F32_DOT)


@triton.jit
def _attend_split(q_ptr, k_ptr, v_ptr, bt_ptr, out_ptr, po_ptr, pl_ptr, T, qk_scale,
                  s_qb, s_qt, s_qh, s_kn, s_kp, s_kh, s_vn, s_vp, s_vh, s_bt,
                  s_ob, s_ot, s_oh, s_pb, s_pt, s_ph, s_ps, s_lb, s_lt, s_lh,
                  b, kvh, i_m, i_s, seq_len, lo, hi, G: tl.constexpr, D: tl.constexpr,
                  BD: tl.constexpr, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  SPLIT: tl.constexpr, CAUSAL: tl.constexpr, F32_DOT: tl.constexpr):
    # query rows: row r is position t = r // G of query head kvh * G + r % G
    rows = i_m * BM + tl.arange(0, BM)
    t_of = rows // G
    head = kvh * G + rows % G
    m_row = rows < T * G
    offs_d = tl.arange(0, BD)
    m_d = offs_d < D
    q = tl.load(q_ptr + b * s_qb + t_of[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=m_row[:, None] & m_d[None, :], other=0.0)  # q: [BM, BD]
    if CAUSAL:
        last = seq_len - T + t_of  # the last position row r sees
    else:
        last = seq_len - 1 + t_of * 0
    last = tl.where(m_row, last, -1)

    # a finite floor, not -inf: a row with nothing visible yet keeps alpha = exp2(0) = 1
    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    for j in range(lo, hi):
        offs_n = j * BN + tl.arange(0, BN)
        k, v = kv_tile(k_ptr, v_ptr, bt_row, offs_n, offs_n < seq_len, offs_d, m_d, kvh, s_kn,
                       s_kp, s_kh, s_vn, s_vp, s_vh, BLOCK)  # k, v: [BN, BD]
        m_i, l_i, acc = online_softmax_step(q, k, v, offs_n[None, :] <= last[:, None], m_i, l_i,
                                            acc, qk_scale, F32_DOT)

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # a row that saw nothing gives zeros
    m_out = m_row[:, None] & m_d[None, :]
    if not SPLIT:
        tl.store(out_ptr + b * s_ob + t_of[:, None] * s_ot + head[:, None] * s_oh
                 + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=m_out)
    else:
        tl.store(po_ptr + b * s_pb + t_of[:, None] * s_pt + head[:, None] * s_ph + i_s * s_ps
                 + offs_d[None, :], o, mask=m_out)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(pl_ptr + b * s_lb + t_of * s_lt + head * s_lh + i_s, lse, mask=m_row)


@triton.jit(do_not_specialize=["T", "splits", "len_add", "s_lb", "s_lt", "s_lh"])
def _paged_attn_merge_kernel(
    out_ptr, po_ptr, pl_ptr, len_ptr, T, s_len, len_add,
    s_ob, s_ot, s_oh, s_pb, s_pt, s_ph, s_ps, s_lb, s_lt, s_lh,
    D: tl.constexpr, BDM: tl.constexpr, splits, BS: tl.constexpr,
    BN: tl.constexpr, SKIP: tl.constexpr, EARLY_LEN: tl.constexpr, PDL: tl.constexpr,
):
    pdl.launch_dependents(PDL)
    i_bt, h, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, t = i_bt // T, i_bt % T
    offs_s = tl.arange(0, BS)
    offs_d = i_d * BDM + tl.arange(0, BDM)
    m_s, m_d = offs_s < splits, offs_d < D
    if EARLY_LEN:  # the host's input (a decode step's positions): before the wait
        seq_len = tl.load(len_ptr + b * s_len).to(tl.int32) + len_add
    pdl.wait(PDL)
    if SKIP:  # only the splits that worked wrote their parts
        if not EARLY_LEN:
            seq_len = tl.load(len_ptr + b * s_len).to(tl.int32) + len_add
        m_s = m_s & (offs_s < worked_splits(seq_len, BN, splits))
    lse = tl.load(pl_ptr + b * s_lb + t * s_lt + h * s_lh + offs_s, mask=m_s,
                  other=float("-inf"))  # lse: [BS], log2 units
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: all weights zero
    w = tl.exp2(lse - top)
    den = tl.sum(w, axis=0)
    parts = tl.load(po_ptr + b * s_pb + t * s_pt + h * s_ph + offs_s[:, None] * s_ps
                    + offs_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)  # o: [BDM]
    tl.store(out_ptr + b * s_ob + t * s_ot + h * s_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=m_d)


MAX_SPLITS = 128


def _default_splits(programs: int, capacity: int, bn: int) -> int:
    # enough programs for ~2 per SM of an H200 (132 SMs), as many as one tile each: at
    # batch 1 and 1K positions the decode graph's replay takes 595 us, against 609 us with
    # at least two tiles a split and 985 us unsplit
    return max(1, min(triton.cdiv(264, programs), triton.cdiv(capacity, bn), MAX_SPLITS))


def paged_attention_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    scale: float | None = None, causal_tail: bool = True, num_splits: int | None = None,
    BN: int | None = None, num_warps: int | None = None, num_stages: int = 2,
) -> Tensor:
    """Attention of T new query positions per lane over a paged KV cache, on the GPU.

    q: [B, T, Hq, D] (last axis contiguous); k_cache, v_cache: [num_blocks, block_size,
    Hkv, D] (last axis contiguous; GQA: query head h reads KV head h // (Hq // Hkv));
    block_tables: [B, max_blocks] int, lane b's position p lives in block
    block_tables[b, p // block_size] at offset p % block_size; seq_lens: [B] int, the KV
    positions valid for the lane's LAST query, including its T new ones (already written
    to the cache). With `causal_tail` query t sees positions [0, seq_len - T + t]; without,
    every query sees [0, seq_len). A query that sees no position (e.g. a padding lane with
    seq_len 0) gets zeros. scale defaults to D ** -0.5. Returns [B, T, Hq, D] in q's dtype;
    softmax and accumulation in float32 (float32 inputs: exact float32 dots, no TF32).
    Matches `paged_attention_reference`.

    Grid (B * Hkv, cdiv(T * G, BM), num_splits) with G = Hq // Hkv and BM = T * G rounded
    up to a power of two in [16, 32] (16 for float32); then, if num_splits > 1, a merge
    over (B * T, Hq, D tiles). Tunables: num_splits (default: ~264 programs, at most one
    per BN positions of the table's capacity, at most 128), BN (KV positions per tile:
    64 for D <= 128 in 16-bit dtypes, else 32), num_warps (default 4; 8 for float32 or
    when BM * D > 4096), num_stages."""
    B, T, Hq, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    if v_cache.shape != k_cache.shape or Dk != D or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                         f"{tuple(v_cache.shape)} do not fit")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not fit batch {B}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last axis")
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    BD = triton.next_power_of_2(D)
    # register budgets measured for sm_90 (D 256: BM 64 spills; an exact fp32 dot, BM 32)
    f32 = q.dtype == torch.float32
    BM = 16 if f32 else max(16, min(32, triton.next_power_of_2(T * G)))
    BN = BN or (64 if D <= 128 and not f32 else 32)
    n_m = triton.cdiv(T * G, BM)
    splits = num_splits or _default_splits(B * Hkv * n_m, block_tables.shape[1] * block_size,
                                           BN)
    num_warps = num_warps or (8 if f32 or BM * BD > 4096 else 4)
    out = q.new_empty(B, T, Hq, D)
    if splits > 1:
        part_o = torch.empty(B, T, Hq, splits, D, dtype=torch.float32, device=q.device)
        part_l = torch.empty(B, T, Hq, splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_l = out  # unused
    p_strides = part_o.stride()[:4] if splits > 1 else (0, 0, 0, 0)
    l_strides = part_l.stride()[:3] if splits > 1 else (0, 0, 0)
    _paged_attn_split_kernel[(B * Hkv, n_m, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_l,
        T, scale * LOG2E,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        *out.stride()[:3], *p_strides, *l_strides,
        HKV=Hkv, G=G, D=D, BD=BD, BLOCK=block_size, BM=BM, BN=BN, splits=splits,
        SPLIT=splits > 1,
        CAUSAL=causal_tail, F32_DOT=f32 or _interpreting(), SKIP=FLAGS.skip_empty_splits,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch(q),
    )
    if splits > 1:
        merge_splits(out, part_o, part_l, p_strides, l_strides, splits, BN, seq_lens,
                     bs=max(MAX_SPLITS, triton.next_power_of_2(splits)))  # one kernel
    return out


def merge_splits(out: Tensor, part_o: Tensor, part_l: Tensor, p_strides, l_strides,
                 splits: int, BN: int, lengths: Tensor, add: int = 0,
                 early: bool = False, bs: int | None = None) -> None:
    """out [B, T, Hq, D] from the splits' parts: part_o [B, T, Hq, splits, D] (each split's
    output, normalised by its own sum) and part_l [B, T, Hq, splits] (their log-sum-exp in
    log2 units), weighted by exp2(lse - max); p_strides / l_strides: their first 4 / 3.
    Lane b's seq_len is lengths[b] (+ add; a 1-D view of any stride): only its first
    `worked_splits` of tiles of BN wrote parts. `early`: the lengths were written before
    this forward's chain began (the host's positions), so they are read before the wait.
    `bs` (a power of two, at least `splits`): the splits one program reads, default the
    fewest that hold them (a constexpr: each value its own kernel)."""
    B, T, Hq, D = out.shape
    BS = bs or triton.next_power_of_2(splits)
    BDM = max(16, min(triton.next_power_of_2(D), 8192 // BS))  # [BS, BDM] fp32: <= 64 regs
    _paged_attn_merge_kernel[(B * T, Hq, triton.cdiv(D, BDM))](
        out, part_o, part_l, lengths, T, lengths.stride(0), add,
        *out.stride()[:3], *p_strides, *l_strides,
        D=D, BDM=BDM, splits=splits, BS=BS, BN=BN, SKIP=FLAGS.skip_empty_splits,
        EARLY_LEN=early,
        num_warps=4, **pdl.launch(out),
    )


def paged_attention_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    scale: float | None = None, causal_tail: bool = True,
) -> Tensor:
    """The contract of `paged_attention_decode` in torch: per lane, gather its seq_len
    positions through the block table, softmax in float32 (float64 stays float64).
    Queries that see no position get zeros. Inputs are not modified."""
    B, T, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    scale = D ** -0.5 if scale is None else scale
    out = torch.zeros(B, T, Hq, D, dtype=wide, device=q.device)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        blocks = block_tables[b, :-(-L // block_size)].long()
        k = k_cache[blocks].reshape(-1, Hkv, D)[:L].to(wide)  # [L, Hkv, D]
        v = v_cache[blocks].reshape(-1, Hkv, D)[:L].to(wide)
        k, v = (x.repeat_interleave(Hq // Hkv, dim=1) for x in (k, v))  # [L, Hq, D]
        scores = torch.einsum("thd,lhd->htl", q[b].to(wide), k) * scale  # [Hq, T, L]
        pos = torch.arange(L, device=q.device)
        last = (L - T + torch.arange(T, device=q.device)) if causal_tail else \
            torch.full((T,), L - 1, device=q.device)
        visible = pos[None, :] <= last[:, None]  # [T, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows seeing nothing: zeros
        out[b] = torch.einsum("htl,lhd->thd", probs, v)
    return out.to(q.dtype)
