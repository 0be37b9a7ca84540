"""The gated delta rule's chunked prefill in Triton: the math of
`kernels.gdn_reference.chunk_gated_delta_rule` (chunk size 64, the WY / UT form), with
several sequences of any lengths packed into one launch per stage.

Three stages:

1. One program per (chunk, value head): the chunk-local cumulative decay G, the strictly
   lower [64, 64] system A = beta K K^T * exp(G_i - G_j) and its unit lower-triangular
   inverse X = (I + A)^-1 by 16 x 16 blocks (the four diagonal ones by forward
   substitution, the rest by block substitution). By default (`GDNChunkConfig.wy_split`
   and `corrections_from_x`) that is all: `_solve_kernel` builds A's ten blocks straight
   from 16-row key tiles with one or two warps and writes X. Without `corrections_from_x`
   `_wu_kernel` reads X back for W = X (beta exp(G) K) and U = X (beta V); without
   `wy_split`, `_wy_kernel` does it all in one launch, cutting the blocks out of [64, 64]
   registers (with W and U from stage 1: 1.22 ms against 0.98 split, T = 16K, H200).
2. `_state_kernel`, one program per (sequence, value head, Dv tile): the only sequential
   loop, over the sequence's chunks, carrying the state tile in registers. Per chunk it
   records the state at the chunk's start, makes the corrections
   V' = X beta (V - exp(G) K S) (= U - W S) into u, and moves S to the chunk's end. At
   T = 16K on the H200 that is 0.88 ms in all against 1.02 with W and U from stage 1:
   one product more on the chain through S, 0.5 GB less written and read back.
3. `_output_kernel`, one program per (chunk, value head, Dv tile):
   o = scale * (exp(G) Q S_start + (Q K^T * exp(G_i - G_j), causal) V').

Matmul operands are rounded to v's dtype when it is bfloat16 / float16 (float32
accumulation, the state always float32); float32 v keeps float32 operands, multiplied as
tf32x3 by default (float32-accurate; `GDNChunkConfig.fp32_precision`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 64  # tokens per chunk; the kernels hard-code it (and its 16 x 16 blocks)


@dataclass(frozen=True)
class GDNChunkConfig:
    """Launch tunables (block sizes are powers of two >= 16, clipped to the head dims).
    The defaults are meant for H100 / H200 with Dk = Dv = 128."""

    wy_block_k: int = 64  # Dk tile of W's and U's loops (`_wu_kernel`, `_wy_kernel`)
    wy_block_v: int = 64  # Dv tile of U's loop
    wy_warps: int = 4
    # stage 1 split: `_solve_kernel` builds A by its ten [16, 16] blocks straight from
    # 16-row key tiles and writes X (no [64, 64] relayouts, few warps); W and U, when made
    # (see corrections_from_x), by `_wu_kernel` from X read back. Not split: the
    # one-launch `_wy_kernel`, which always makes W and U. On the H200 at T = 16K:
    # 0.88 ms in all against 1.25 (bench/results/gdn-sweep-h200.json)
    wy_split: bool = True
    # warps of a solve program; None: 1 from 4096 programs up (T = 16K, 32 value heads:
    # 0.88 ms in all against 1.00 with 2 on the H200), else 2 (measured with W and U from
    # stage 1, T = 4K: 0.29 ms against 0.38)
    solve_warps: int | None = None
    solve_block_k: int = 64  # Dk tile of the solve's key loop
    state_block_v: int = 32  # Dv tile of one state program: Dv / 32 * N * Hv programs
    state_warps: int = 4
    # stage 2 makes the corrections V' = X beta (V - exp(G) K S) from the solve's X, K and
    # V (no `_wu_kernel`, no W or U written and read back); else V' = U - W S from stage
    # 1's W and U. Needs wy_split. On the H200 at T = 16K: 0.88 ms in all against 1.02,
    # and as close to the float32 reference as fla (bench/results/gdn-sweep-h200.json)
    corrections_from_x: bool = True
    # software pipelining of the chunk loop's loads (3: 7% faster than 2 at T = 16K on the
    # H200, bench/results/gdn-sweep-h200.json)
    state_stages: int = 3
    out_block_v: int = 128  # Dv tile of one output program (128: 2% faster than 64)
    out_warps: int = 4
    # tl.dot input precision for float32 operands: tf32x3 is float32-accurate on tensor
    # cores; "ieee" (FMA) spills badly at D = 128
    fp32_precision: str = "tf32x3"


DEFAULT_CONFIG = GDNChunkConfig()

_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
               torch.float32: tl.float32}


# a piece's length T and its 64-token chunk count NT follow the request: Triton would
# specialise each on being 1 or a multiple of 16, so each kernel compiled up to five variants
# (the warm-up sent a prompt of each class, stop 42) where one serves them all (T and NT only
# place rows and chunks; the loads' alignment comes from the strides)
_PER_PIECE = ["T", "NT"]


@triton.jit
def _operand(x, DT: tl.constexpr, EMULATE: tl.constexpr):
    """x as a tl.dot operand of dtype DT. EMULATE (the interpreter with a bfloat16 DT,
    whose tl.dot multiplies bfloat16 bit patterns as integers and whose casts truncate):
    the float32 value of x's nearest bfloat16 (ties to even, as the GPU rounds), which a
    float32 IEEE dot multiplies exactly as tensor cores multiply bfloat16."""
    if EMULATE and DT == tl.bfloat16:
        b = x.to(tl.float32).to(tl.uint32, bitcast=True)
        out = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        out = x.to(DT)
    return out


@triton.jit
def _load_tile(base, rows, row_mask, row_stride, cols, col_mask):
    """x[rows, cols] of a view whose rows are `row_stride` apart (columns contiguous),
    zero outside the masks."""
    return tl.load(base + rows[:, None] * row_stride + cols[None, :],
                   mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def _store_tile(base, rows, row_mask, row_stride, cols, col_mask, x, EMULATE: tl.constexpr):
    tl.store(base + rows[:, None] * row_stride + cols[None, :],
             _operand(x, base.dtype.element_ty, EMULATE).to(base.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _chunk_bounds(c, chunk_start, chunk_end, T, NT, VARLEN: tl.constexpr):
    """Global chunk c -> (its first packed row, the end row of its sequence), int64. A
    varlen grid is an upper bound: chunks past the last have start == end (all masked)."""
    if VARLEN:
        start = tl.load(chunk_start + c).to(tl.int64)
        end = tl.load(chunk_end + c).to(tl.int64)
    else:
        n = (c // NT).to(tl.int64)
        start = n * T + (c % NT) * 64
        end = n * T + T
    return start, end


@triton.jit
def _chunk_rows(c, chunk_start, chunk_end, T, NT, VARLEN: tl.constexpr):
    """Chunk c's 64 packed rows (int64), which of them its sequence has, and its bounds."""
    r0, end = _chunk_bounds(c, chunk_start, chunk_end, T, NT, VARLEN)
    rows = r0 + tl.arange(0, 64)
    return rows, rows < end, r0, end


@triton.jit
def _to_blocks(x):
    """[64, 64] -> its 16 blocks [16 (4 a + b), 16, 16]: block (a, b) is rows 16a.., cols
    16b.. (a relayout, no arithmetic)."""
    return tl.reshape(tl.permute(tl.reshape(x, [4, 16, 4, 16]), [0, 2, 1, 3]), [16, 16, 16])


@triton.jit
def _from_blocks(x):
    """The inverse of `_to_blocks`."""
    return tl.reshape(tl.permute(tl.reshape(x, [4, 4, 16, 16]), [0, 2, 1, 3]), [64, 64])


@triton.jit
def _invert_diagonal_blocks(a):
    """(I + a[b])^-1 for each of four strictly lower-triangular [16, 16] blocks
    a: [4, 16, 16], by forward substitution, the four sharing each step."""
    row = tl.arange(0, 16)[None, :, None]
    neg = -a
    # x = inverse - I, row by row: x_i = -a_i - sum_{j<i} a_ij x_j (rows 0, 1 are -a already)
    x = neg
    for i in range(2, 16):
        a_i = tl.sum(tl.where(row == i, neg, 0.0), 1)  # [4, 16]: -a[b, i, :]
        x_i = a_i + tl.sum(a_i[:, :, None] * x, 1)  # only x's rows j < i meet a_ij != 0
        x = tl.where(row == i, x_i[:, None, :], x)
    return x + tl.where(row == tl.arange(0, 16)[None, None, :], 1.0, 0.0)


@triton.jit
def _off_diagonal(x11, x22, x33, x44, a21, a31, a32, a41, a42, a43):
    """X's blocks below the diagonal from its diagonal blocks and A's: X_ab =
    -X_aa sum_{b <= m < a} A_am X_mb (blocks 1-based, as in the module docstring)."""
    x21 = -tl.dot(tl.dot(x22, a21, input_precision="ieee"), x11, input_precision="ieee")
    x32 = -tl.dot(tl.dot(x33, a32, input_precision="ieee"), x22, input_precision="ieee")
    x43 = -tl.dot(tl.dot(x44, a43, input_precision="ieee"), x33, input_precision="ieee")
    y = tl.dot(a31, x11, input_precision="ieee")
    y = tl.dot(a32, x21, y, input_precision="ieee")
    x31 = -tl.dot(x33, y, input_precision="ieee")
    y = tl.dot(a42, x22, input_precision="ieee")
    y = tl.dot(a43, x32, y, input_precision="ieee")
    x42 = -tl.dot(x44, y, input_precision="ieee")
    y = tl.dot(a41, x11, input_precision="ieee")
    y = tl.dot(a42, x21, y, input_precision="ieee")
    y = tl.dot(a43, x31, y, input_precision="ieee")
    x41 = -tl.dot(x44, y, input_precision="ieee")
    return x21, x31, x32, x41, x42, x43


@triton.jit
def _inverse_in_registers(a):
    """(I + a)^-1 of the strictly lower [64, 64] a, its [16, 16] blocks cut out of and put
    back into registers (relayouts and masked sums)."""
    ab = _to_blocks(a)  # [16, 16, 16]: block (a, b) at 4a + b
    pid = tl.arange(0, 16)[:, None, None]
    blk = tl.arange(0, 4)[:, None, None]
    diag = tl.sum(tl.where(blk[:, :, :, None] == tl.arange(0, 4)[None, :, None, None],
                           tl.reshape(ab, [4, 4, 16, 16]), 0.0), 1)  # [4, 16, 16]
    xd = _invert_diagonal_blocks(diag)
    x11 = tl.sum(tl.where(blk == 0, xd, 0.0), 0)
    x22 = tl.sum(tl.where(blk == 1, xd, 0.0), 0)
    x33 = tl.sum(tl.where(blk == 2, xd, 0.0), 0)
    x44 = tl.sum(tl.where(blk == 3, xd, 0.0), 0)
    x21, x31, x32, x41, x42, x43 = _off_diagonal(
        x11, x22, x33, x44, tl.sum(tl.where(pid == 4, ab, 0.0), 0),
        tl.sum(tl.where(pid == 8, ab, 0.0), 0), tl.sum(tl.where(pid == 9, ab, 0.0), 0),
        tl.sum(tl.where(pid == 12, ab, 0.0), 0), tl.sum(tl.where(pid == 13, ab, 0.0), 0),
        tl.sum(tl.where(pid == 14, ab, 0.0), 0))
    xb = (tl.where(pid == 0, x11[None, :, :], 0.0) + tl.where(pid == 4, x21[None, :, :], 0.0)
          + tl.where(pid == 5, x22[None, :, :], 0.0) + tl.where(pid == 8, x31[None, :, :], 0.0)
          + tl.where(pid == 9, x32[None, :, :], 0.0) + tl.where(pid == 10, x33[None, :, :], 0.0)
          + tl.where(pid == 12, x41[None, :, :], 0.0) + tl.where(pid == 13, x42[None, :, :], 0.0)
          + tl.where(pid == 14, x43[None, :, :], 0.0) + tl.where(pid == 15, x44[None, :, :], 0.0))
    return _from_blocks(xb)


@triton.jit
def _store_w_u(x, k, v, w, u, rows, rm, G, b_c, h, kh, s_kt, s_kh, s_vt, s_vh,
               HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
               BDV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
               EMULATE: tl.constexpr, PRECISION: tl.constexpr):
    """w = X (beta exp(G) K) and u = X (beta V) for one chunk's rows, X [64, 64] an operand
    of dtype DT: per Dk and Dv tile."""
    kp = k + kh * s_kh + rows[:, None] * s_kt  # [64, 1] row pointers
    e = (b_c * tl.exp(G))[:, None]
    wp = w + h * DK + rows[:, None] * (HV * DK)
    for k0 in tl.static_range(0, BDK, BK):
        cols = (k0 + tl.arange(0, BK))[None, :]
        mask = rm[:, None] & (cols < DK)
        kb = _operand(tl.load(kp + cols, mask=mask, other=0.0).to(tl.float32) * e, DT, EMULATE)
        w_c = tl.dot(x, kb, input_precision=PRECISION)
        tl.store(wp + cols, _operand(w_c, DT, EMULATE).to(DT), mask=mask)
    vp = v + h * s_vh + rows[:, None] * s_vt
    up = u + h * DV + rows[:, None] * (HV * DV)
    for v0 in tl.static_range(0, BDV, BV):
        cols = (v0 + tl.arange(0, BV))[None, :]
        mask = rm[:, None] & (cols < DV)
        vb = _operand(tl.load(vp + cols, mask=mask, other=0.0).to(tl.float32) * b_c[:, None],
                      DT, EMULATE)
        u_c = tl.dot(x, vb, input_precision=PRECISION)
        tl.store(up + cols, _operand(u_c, DT, EMULATE).to(DT), mask=mask)


@triton.jit(do_not_specialize=_PER_PIECE)
def _wy_kernel(k, v, g, beta, chunk_start, chunk_end, g_cum, w, u,
               T, NT, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh,
               HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BDK: tl.constexpr, BDV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               DT: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
               VARLEN: tl.constexpr):
    """Stage 1, program (chunk c, value head h): g_cum = G, w = X beta exp(G) K,
    u = X beta V for the chunk's rows, X = (I + A)^-1 (see the module docstring). A and X
    are [64, 64]; the inverse works on their [16, 16] blocks."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // GROUP
    rows, rm, r0, end = _chunk_rows(c, chunk_start, chunk_end, T, NT, VARLEN)
    t = tl.arange(0, 64)
    g_c = tl.load(g + rows * s_gt + h * s_gh, mask=rm, other=0.0).to(tl.float32)
    b_c = tl.load(beta + rows * s_bt + h * s_bh, mask=rm, other=0.0).to(tl.float32)
    G = tl.cumsum(g_c, 0)  # [64] chunk-local cumulative log-decay (flat past the end)
    tl.store(g_cum + rows * HV + h, G, mask=rm)

    # A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i: [64, 64]
    kp = k + kh * s_kh + rows[:, None] * s_kt  # [64, 1] row pointers
    a = tl.zeros([64, 64], dtype=tl.float32)
    for k0 in tl.static_range(0, BDK, BK):
        cols = (k0 + tl.arange(0, BK))[None, :]
        k_c = _operand(tl.load(kp + cols, mask=rm[:, None] & (cols < DK), other=0.0),
                       DT, EMULATE)  # [64, BK]
        a = tl.dot(k_c, tl.trans(k_c), a, input_precision=PRECISION)
    lower = t[:, None] > t[None, :]
    # masked before exp: above the diagonal the exponent is positive
    a = tl.where(lower, a * tl.exp(tl.where(lower, G[:, None] - G[None, :], 0.0)), 0.0)
    a = a * b_c[:, None]

    # X = (I + A)^-1 by [16, 16] blocks (float32, IEEE products: the inverse is where
    # rounding would compound): X_aa by forward substitution, then below the diagonal
    # X_ab = -X_aa sum_{b <= m < a} A_am X_mb
    x = _operand(_inverse_in_registers(a), DT, EMULATE)  # [64, 64]
    _store_w_u(x, k, v, w, u, rows, rm, G, b_c, h, kh, s_kt, s_kh, s_vt, s_vh,
               HV, DK, DV, BDK, BDV, BK, BV, DT, EMULATE, PRECISION)


@triton.jit
def _invert16(a):
    """(I + a)^-1 of a strictly lower-triangular [16, 16] a, by forward substitution:
    x = inverse - I row by row, x_i = -a_i - sum_{j<i} a_ij x_j (rows 0, 1 are -a)."""
    r = tl.arange(0, 16)[:, None]
    x = -a
    for i in range(2, 16):
        n_i = tl.sum(tl.where(r == i, -a, 0.0), 0)  # [16]: -a[i, :]
        x = tl.where(r == i, (n_i + tl.sum(n_i[:, None] * x, 0))[None, :], x)
    return x + tl.where(r == tl.arange(0, 16)[None, :], 1.0, 0.0)


@triton.jit
def _decayed(a, G_i, G_j, b_i, DIAGONAL: tl.constexpr):
    """Block (i, j) of A from its block of K K^T: times exp(G_i - G_j) and beta_i, strictly
    lower on the diagonal (masked before exp: above it the exponent is positive)."""
    r = tl.arange(0, 16)
    if DIAGONAL:
        lower = r[:, None] > r[None, :]
        a = tl.where(lower, a * tl.exp(tl.where(lower, G_i[:, None] - G_j[None, :], 0.0)), 0.0)
    else:
        a = a * tl.exp(G_i[:, None] - G_j[None, :])
    return a * b_i[:, None]


@triton.jit
def _chunk_kkt(k, r0, end, kh, s_kt, s_kh, DK: tl.constexpr, BDK: tl.constexpr,
               BK: tl.constexpr, DT: tl.constexpr, EMULATE: tl.constexpr,
               PRECISION: tl.constexpr):
    """The ten [16, 16] blocks on and below the diagonal of K K^T for the chunk of rows
    r0.. (end: its sequence's end), from its four 16-row key tiles of key head kh, so no
    block is ever cut out of a [64, 64] tensor (1-based, as in the module docstring)."""
    r = tl.arange(0, 16)
    rows1, rows2, rows3, rows4 = r0 + r, r0 + 16 + r, r0 + 32 + r, r0 + 48 + r
    m1, m2, m3, m4 = rows1 < end, rows2 < end, rows3 < end, rows4 < end
    a11 = tl.zeros([16, 16], dtype=tl.float32)
    a21, a22 = a11, a11
    a31, a32, a33 = a11, a11, a11
    a41, a42, a43, a44 = a11, a11, a11, a11
    kp = k + kh * s_kh
    for k0 in tl.static_range(0, BDK, BK):
        cols = k0 + tl.arange(0, BK)
        cm = cols < DK
        k1 = _operand(_load_tile(kp, rows1, m1, s_kt, cols, cm), DT, EMULATE)
        k2 = _operand(_load_tile(kp, rows2, m2, s_kt, cols, cm), DT, EMULATE)
        k3 = _operand(_load_tile(kp, rows3, m3, s_kt, cols, cm), DT, EMULATE)
        k4 = _operand(_load_tile(kp, rows4, m4, s_kt, cols, cm), DT, EMULATE)
        a11 = tl.dot(k1, tl.trans(k1), a11, input_precision=PRECISION)
        a21 = tl.dot(k2, tl.trans(k1), a21, input_precision=PRECISION)
        a22 = tl.dot(k2, tl.trans(k2), a22, input_precision=PRECISION)
        a31 = tl.dot(k3, tl.trans(k1), a31, input_precision=PRECISION)
        a32 = tl.dot(k3, tl.trans(k2), a32, input_precision=PRECISION)
        a33 = tl.dot(k3, tl.trans(k3), a33, input_precision=PRECISION)
        a41 = tl.dot(k4, tl.trans(k1), a41, input_precision=PRECISION)
        a42 = tl.dot(k4, tl.trans(k2), a42, input_precision=PRECISION)
        a43 = tl.dot(k4, tl.trans(k3), a43, input_precision=PRECISION)
        a44 = tl.dot(k4, tl.trans(k4), a44, input_precision=PRECISION)
    return a11, a21, a22, a31, a32, a33, a41, a42, a43, a44


@triton.jit
def _solve_head(g, beta, g_cum, x_buf, r0, end, h, s_gt, s_gh, s_bt, s_bh,
                a11, a21, a22, a31, a32, a33, a41, a42, a43, a44,
                HV: tl.constexpr, EMULATE: tl.constexpr):
    """Value head h of the chunk of rows r0..: g_cum = G, and X = (I + A)^-1 into x_buf
    from the blocks of K K^T (decayed and scaled by beta here): X's diagonal blocks by
    forward substitution, the others by block substitution (`_off_diagonal`)."""
    r = tl.arange(0, 16)
    rows1, rows2, rows3, rows4 = r0 + r, r0 + 16 + r, r0 + 32 + r, r0 + 48 + r
    m1, m2, m3, m4 = rows1 < end, rows2 < end, rows3 < end, rows4 < end
    g1 = tl.load(g + rows1 * s_gt + h * s_gh, mask=m1, other=0.0).to(tl.float32)
    g2 = tl.load(g + rows2 * s_gt + h * s_gh, mask=m2, other=0.0).to(tl.float32)
    g3 = tl.load(g + rows3 * s_gt + h * s_gh, mask=m3, other=0.0).to(tl.float32)
    g4 = tl.load(g + rows4 * s_gt + h * s_gh, mask=m4, other=0.0).to(tl.float32)
    # the chunk's cumulative log-decay, by 16-row tiles (flat past the end)
    G1 = tl.cumsum(g1, 0)
    G2 = tl.cumsum(g2, 0) + tl.sum(g1, 0)
    G3 = tl.cumsum(g3, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)
    G4 = tl.cumsum(g4, 0) + tl.sum(g1, 0) + tl.sum(g2, 0) + tl.sum(g3, 0)
    tl.store(g_cum + rows1 * HV + h, G1, mask=m1)
    tl.store(g_cum + rows2 * HV + h, G2, mask=m2)
    tl.store(g_cum + rows3 * HV + h, G3, mask=m3)
    tl.store(g_cum + rows4 * HV + h, G4, mask=m4)
    b1 = tl.load(beta + rows1 * s_bt + h * s_bh, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(beta + rows2 * s_bt + h * s_bh, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(beta + rows3 * s_bt + h * s_bh, mask=m3, other=0.0).to(tl.float32)
    b4 = tl.load(beta + rows4 * s_bt + h * s_bh, mask=m4, other=0.0).to(tl.float32)
    a11 = _decayed(a11, G1, G1, b1, True)
    a22 = _decayed(a22, G2, G2, b2, True)
    a33 = _decayed(a33, G3, G3, b3, True)
    a44 = _decayed(a44, G4, G4, b4, True)
    a21 = _decayed(a21, G2, G1, b2, False)
    a31 = _decayed(a31, G3, G1, b3, False)
    a32 = _decayed(a32, G3, G2, b3, False)
    a41 = _decayed(a41, G4, G1, b4, False)
    a42 = _decayed(a42, G4, G2, b4, False)
    a43 = _decayed(a43, G4, G3, b4, False)
    x11, x22, x33, x44 = _invert16(a11), _invert16(a22), _invert16(a33), _invert16(a44)
    x21, x31, x32, x41, x42, x43 = _off_diagonal(x11, x22, x33, x44, a21, a31, a32, a41, a42,
                                                 a43)
    xp = x_buf + h * 64
    _store_tile(xp, rows1, m1, HV * 64, r, r < 16, x11, EMULATE)
    _store_tile(xp, rows2, m2, HV * 64, r, r < 16, x21, EMULATE)
    _store_tile(xp, rows2, m2, HV * 64, 16 + r, r < 16, x22, EMULATE)
    _store_tile(xp, rows3, m3, HV * 64, r, r < 16, x31, EMULATE)
    _store_tile(xp, rows3, m3, HV * 64, 16 + r, r < 16, x32, EMULATE)
    _store_tile(xp, rows3, m3, HV * 64, 32 + r, r < 16, x33, EMULATE)
    _store_tile(xp, rows4, m4, HV * 64, r, r < 16, x41, EMULATE)
    _store_tile(xp, rows4, m4, HV * 64, 16 + r, r < 16, x42, EMULATE)
    _store_tile(xp, rows4, m4, HV * 64, 32 + r, r < 16, x43, EMULATE)
    _store_tile(xp, rows4, m4, HV * 64, 48 + r, r < 16, x44, EMULATE)


@triton.jit(do_not_specialize=_PER_PIECE)
def _solve_kernel(k, g, beta, chunk_start, chunk_end, g_cum, x_buf,
                  T, NT, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh,
                  HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
                  BDK: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                  EMULATE: tl.constexpr, PRECISION: tl.constexpr, VARLEN: tl.constexpr):
    """Stage 1 split, first half, program (chunk c, value head h): g_cum = G and X =
    (I + A)^-1 into x_buf [rows, HV, 64] (its blocks on and below the diagonal, in DT)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    r0, end = _chunk_bounds(c, chunk_start, chunk_end, T, NT, VARLEN)
    a11, a21, a22, a31, a32, a33, a41, a42, a43, a44 = _chunk_kkt(
        k, r0, end, h // GROUP, s_kt, s_kh, DK, BDK, BK, DT, EMULATE, PRECISION)
    _solve_head(g, beta, g_cum, x_buf, r0, end, h, s_gt, s_gh, s_bt, s_bh,
                a11, a21, a22, a31, a32, a33, a41, a42, a43, a44, HV, EMULATE)


@triton.jit(do_not_specialize=_PER_PIECE)
def _wu_kernel(k, v, beta, g_cum, x_buf, chunk_start, chunk_end, w, u,
               T, NT, s_kt, s_kh, s_vt, s_vh, s_bt, s_bh,
               HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BDK: tl.constexpr, BDV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               DT: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
               VARLEN: tl.constexpr):
    """Stage 1 split, second half (unless stage 2 makes the corrections), program (chunk c,
    value head h): w and u as `_wy_kernel` makes them, from the X that `_solve_kernel`
    wrote (zero above its diagonal blocks)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    kh = h // GROUP
    rows, rm, r0, end = _chunk_rows(c, chunk_start, chunk_end, T, NT, VARLEN)
    t = tl.arange(0, 64)
    G = tl.load(g_cum + rows * HV + h, mask=rm, other=0.0)
    b_c = tl.load(beta + rows * s_bt + h * s_bh, mask=rm, other=0.0).to(tl.float32)
    x = tl.load(x_buf + h * 64 + rows[:, None] * (HV * 64) + t[None, :],
                mask=rm[:, None] & ((t[:, None] // 16) >= (t[None, :] // 16)), other=0.0)
    x = _operand(x, DT, EMULATE)
    _store_w_u(x, k, v, w, u, rows, rm, G, b_c, h, kh, s_kt, s_kh, s_vt, s_vh,
               HV, DK, DV, BDK, BDV, BK, BV, DT, EMULATE, PRECISION)


@triton.jit(do_not_specialize=_PER_PIECE)
def _state_kernel(k, v, beta, w, u, x_buf, g_cum, h_buf, h0, ht, cu, chunk_offsets, T, NT,
                  s_kt, s_kh, s_vt, s_vh, s_bt, s_bh,
                  HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  BDK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                  EMULATE: tl.constexpr, PRECISION: tl.constexpr, VARLEN: tl.constexpr,
                  HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, FROM_X: tl.constexpr):
    """Stage 2, program (sequence n * HV + value head h, Dv tile iv): for each chunk in
    order, h_buf[chunk] = S (the state at its start), the corrections V' = U - W S into u,
    then S <- exp(G_last) S + (K exp(G_last - G))^T V'. ht[n, h] = the final S.
    FROM_X (`GDNChunkConfig.corrections_from_x`): V' = X beta (V - exp(G) K S), from the
    X of `_solve_kernel`, K and V; else U - W S from stage 1's W and U."""
    nh = tl.program_id(0)
    iv = tl.program_id(1)
    n = nh // HV
    h = nh % HV
    kh = h // GROUP
    if VARLEN:
        bos = tl.load(cu + n).to(tl.int64)
        end = tl.load(cu + n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + n).to(tl.int64)
    else:
        bos = n.to(tl.int64) * T
        end = bos + T
        c0 = n.to(tl.int64) * NT
    n_chunks = ((end - bos + 63) // 64).to(tl.int32)
    kr = tl.arange(0, BDK)
    km = kr < DK
    vc = iv * BV + tl.arange(0, BV)
    vm = vc < DV
    sm = km[:, None] & vm[None, :]
    s_off = kr[:, None] * DV + vc[None, :]  # [BDK, BV] offsets in one [Dk, Dv] state
    S = tl.zeros([BDK, BV], dtype=tl.float32)  # S: [Dk, Dv tile], float32 throughout
    if HAS_H0:
        S = tl.load(h0 + nh.to(tl.int64) * DK * DV + s_off, mask=sm, other=0.0).to(tl.float32)
    t = tl.arange(0, 64)
    blocks = (t[:, None] // 16) >= (t[None, :] // 16)  # X's blocks on and below the diagonal
    kbase = k + kh * s_kh
    for j in range(0, n_chunks):
        r0 = bos + j * 64
        rows = r0 + t  # [64] packed rows of this chunk
        rm = rows < end
        s_op = _operand(S, DT, EMULATE)
        tl.store(h_buf + ((c0 + j) * HV + h) * DK * DV + s_off,
                 s_op.to(h_buf.dtype.element_ty), mask=sm)
        g_last = tl.load(g_cum + tl.minimum(r0 + 63, end - 1) * HV + h)
        g_c = tl.load(g_cum + rows * HV + h, mask=rm, other=0.0)  # [64]
        if not FROM_X:
            w_c = _operand(_load_tile(w + h * DK, rows, rm, HV * DK, kr, km), DT, EMULATE)
            u_c = _load_tile(u + h * DV, rows, rm, HV * DV, vc, vm)  # [64, BV]
            # v_new = u - w S: [64, BDK] @ [BDK, BV]
            v_new = u_c.to(tl.float32) - tl.dot(w_c, s_op, input_precision=PRECISION)
            k_t = tl.load(kbase + rows[None, :] * s_kt + kr[:, None],
                          mask=km[:, None] & rm[None, :], other=0.0)  # [BDK, 64]: K^T
            k_t = _operand(k_t, DT, EMULATE)
        else:
            k_c = _operand(_load_tile(kbase, rows, rm, s_kt, kr, km), DT, EMULATE)
            x_c = _operand(tl.load(x_buf + h * 64 + rows[:, None] * (HV * 64) + t[None, :],
                                   mask=rm[:, None] & blocks, other=0.0), DT, EMULATE)
            b_c = tl.load(beta + rows * s_bt + h * s_bh, mask=rm, other=0.0).to(tl.float32)
            v_c = _load_tile(v + h * s_vh, rows, rm, s_vt, vc, vm).to(tl.float32)
            ks = tl.dot(k_c, s_op, input_precision=PRECISION)  # [64, BV]: K S
            # V' = U - W S = X beta (V - exp(G) K S): one product more on the chain through
            # S, but no W or U written by stage 1 and read back here
            y = (v_c - ks * tl.exp(g_c)[:, None]) * b_c[:, None]
            v_new = tl.dot(x_c, _operand(y, DT, EMULATE), input_precision=PRECISION)
            k_t = tl.trans(k_c)
        _store_tile(u + h * DV, rows, rm, HV * DV, vc, vm, v_new, EMULATE)
        v_dec = v_new * tl.where(rm, tl.exp(g_last - g_c), 0.0)[:, None]
        S = tl.dot(k_t, _operand(v_dec, DT, EMULATE), S * tl.exp(g_last),
                   input_precision=PRECISION)
    if STORE_HT:
        tl.store(ht + nh.to(tl.int64) * DK * DV + s_off, S, mask=sm)


@triton.jit(do_not_specialize=_PER_PIECE)
def _output_kernel(q, k, u, g_cum, h_buf, o, chunk_start, chunk_end, T, NT,
                   s_qt, s_qh, s_kt, s_kh, scale,
                   HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BDK: tl.constexpr, BV: tl.constexpr, DT: tl.constexpr,
                   EMULATE: tl.constexpr, PRECISION: tl.constexpr, VARLEN: tl.constexpr):
    """Stage 3, program (chunk c, value head h, Dv tile iv):
    o = scale * (exp(G) Q S_start + (Q K^T * exp(G_i - G_j), j <= i) V')."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    kh = h // GROUP
    rows, rm, r0, end = _chunk_rows(c, chunk_start, chunk_end, T, NT, VARLEN)
    t = tl.arange(0, 64)
    kr = tl.arange(0, BDK)
    km = kr < DK
    vc = iv * BV + tl.arange(0, BV)
    vm = vc < DV
    live = (tl.zeros([BDK], dtype=tl.int64) + r0) < end  # an unused slot reads no state
    q_c = _load_tile(q + kh * s_qh, rows, rm, s_qt, kr, km)  # [64, BDK]
    k_t = tl.load(k + kh * s_kh + rows[None, :] * s_kt + kr[:, None],
                  mask=km[:, None] & rm[None, :], other=0.0)  # [BDK, 64]: K^T
    s_c = tl.load(h_buf + (c.to(tl.int64) * HV + h) * DK * DV + kr[:, None] * DV + vc[None, :],
                  mask=(km & live)[:, None] & vm[None, :], other=0.0)  # [BDK, BV]
    v_new = _load_tile(u + h * DV, rows, rm, HV * DV, vc, vm)  # [64, BV]
    g_c = tl.load(g_cum + rows * HV + h, mask=rm, other=0.0)  # [64]
    q_c = _operand(q_c, DT, EMULATE)
    qk = tl.dot(q_c, _operand(k_t, DT, EMULATE), input_precision=PRECISION)  # [64, 64]
    # rows past the end read G = 0: masked too, before exp, as the exponent there is > 0
    causal = (t[:, None] >= t[None, :]) & rm[:, None]
    p = tl.where(causal, qk * tl.exp(tl.where(causal, g_c[:, None] - g_c[None, :], 0.0)), 0.0)
    acc = tl.dot(q_c, _operand(s_c, DT, EMULATE), input_precision=PRECISION)  # [64, BV]
    acc = tl.dot(_operand(p, DT, EMULATE), _operand(v_new, DT, EMULATE),
                 acc * tl.exp(g_c)[:, None], input_precision=PRECISION)
    _store_tile(o + h * DV, rows, rm, HV * DV, vc, vm, acc * scale, EMULATE)


def _block(size: int, cap: int) -> int:
    """A power-of-two tile >= 16 covering min(size, cap)."""
    return max(16, triton.next_power_of_2(min(size, cap)))


def _packable(x: Tensor, B: int, T: int, last_contiguous: bool) -> Tensor:
    """x [B, T, H, ...] with strides that address packed row r = b * T + t as r * stride(1)
    (and a contiguous last axis when asked); otherwise a contiguous copy."""
    ok = (B == 1 or x.stride(0) == T * x.stride(1)) and (
        not last_contiguous or x.stride(-1) == 1)
    return x if ok else x.contiguous()


def _chunk_tables(cu: Tensor, n_slots: int) -> tuple[Tensor, Tensor, Tensor]:
    """Device-side chunk bookkeeping (no host sync): chunk_offsets [N+1] (sequence n owns
    global chunks chunk_offsets[n]:chunk_offsets[n+1]) and, for each of n_slots global
    chunk slots, its first packed row and its sequence's end row (both 0 for unused slots)."""
    N = cu.shape[0] - 1
    counts = (cu[1:] - cu[:-1] + (CHUNK - 1)) // CHUNK
    offsets = torch.zeros(N + 1, dtype=torch.int32, device=cu.device)
    offsets[1:] = counts.cumsum(0)
    c = torch.arange(n_slots, dtype=torch.int32, device=cu.device)
    seq = torch.searchsorted(offsets[1:], c, right=True)  # offsets[seq] <= c < offsets[seq+1]
    used = seq < N
    seq = seq.clamp(max=N - 1)
    start = torch.where(used, cu[seq] + (c - offsets[seq]) * CHUNK, 0).to(torch.int32)
    end = torch.where(used, cu[seq + 1], 0).to(torch.int32)
    return offsets, start, end


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Tensor | None = None, cu_seqlens: Tensor | None = None,
    scale: float | None = None, output_final_state: bool = True,
    *, config: GDNChunkConfig | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule over whole chunks of 64 tokens, on the GPU (or Triton's
    interpreter, with CPU tensors, under TRITON_INTERPRET=1).

    q, k: [B, T, Hk, Dk], already L2-normalised; v: [B, T, Hv, Dv]; g (log-decay <= 0),
    beta: [B, T, Hv]; Hv a multiple of Hk, value head h reading key head h // (Hv // Hk).
    Any of bfloat16 / float16 / float32 (mixed is fine); last axes of q, k, v contiguous
    (other layouts are copied). scale defaults to Dk ** -0.5.

    Without cu_seqlens there are N = B sequences of T tokens. With cu_seqlens (int32 or
    int64 [N+1], cumulative lengths from 0 to T, non-decreasing; not checked, which would
    sync), B must be 1 and sequence n is tokens cu_seqlens[n]:cu_seqlens[n+1].

    initial_state: [N, Hv, Dk, Dv] (float32 or any float dtype, read as float32; None:
    zeros). Returns (o [B, T, Hv, Dv] in v's dtype, final state [N, Hv, Dk, Dv] float32, or
    None when output_final_state is False). Inputs are never modified.

    The math is `kernels.gdn_reference.chunk_gated_delta_rule`'s with chunk_size 64.
    Matmul operands are rounded to v's dtype when that is bfloat16 / float16 (as in other
    fast implementations); compute, the decays and the state are float32."""
    cfg = config or DEFAULT_CONFIG
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(f"g and beta must be {(B, T, Hv)}; got {tuple(g.shape)}, "
                         f"{tuple(beta.shape)}")
    if Hv % Hk != 0:
        raise ValueError(f"value heads {Hv} are not a multiple of key heads {Hk}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.dtype not in _DOT_DTYPES:
            raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if v.device.type != "cuda" and not interpret:
        raise ValueError(f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), "
                         f"got {v.device}")
    if cfg.fp32_precision not in ("ieee", "tf32", "tf32x3"):
        raise ValueError(f"fp32_precision must be ieee, tf32 or tf32x3, got "
                         f"{cfg.fp32_precision!r}")
    if max(Dk, Dv) > 256:
        raise ValueError(f"head dims above 256 are not supported (Dk={Dk}, Dv={Dv})")
    varlen = cu_seqlens is not None
    if varlen:
        if B != 1:
            raise ValueError(f"with cu_seqlens the inputs are packed with B == 1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens must be a 1-d tensor [N+1]")
        N = cu_seqlens.shape[0] - 1
    else:
        N = B
    if initial_state is not None and tuple(initial_state.shape) != (N, Hv, Dk, Dv):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, "
                         f"expected {(N, Hv, Dk, Dv)}")
    scale = Dk ** -0.5 if scale is None else float(scale)
    device = v.device

    dot_torch = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32
    dot_dtype = _DOT_DTYPES[dot_torch]
    emulate = interpret and dot_torch == torch.bfloat16
    if emulate:
        precision = "ieee"  # the operands are float32 holding bfloat16 values
    elif dot_torch == torch.float32:
        precision = cfg.fp32_precision
    else:
        precision = "tf32"  # tl.dot's default; it only concerns float32 operands
    common = dict(HV=Hv, GROUP=Hv // Hk, DK=Dk, DV=Dv, DT=dot_dtype, EMULATE=emulate,
                  PRECISION=precision, VARLEN=varlen)
    BDK, BDV = _block(Dk, 256), _block(Dv, 256)

    o = torch.empty(B, T, Hv, Dv, dtype=v.dtype, device=device)
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    ht = (torch.empty(N, Hv, Dk, Dv, dtype=torch.float32, device=device)
          if output_final_state else None)
    if N == 0:
        return o, ht

    q, k, v = (_packable(x, B, T, True) for x in (q, k, v))
    g, beta = (_packable(x, B, T, False) for x in (g, beta))
    rows = B * T
    if varlen:
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        n_slots = T // CHUNK + N  # >= sum of ceil(len_n / 64), known without a sync
        chunk_offsets, chunk_start, chunk_end = _chunk_tables(cu, n_slots)
        NT = 0
    else:
        cu = chunk_offsets = chunk_start = chunk_end = None
        NT = triton.cdiv(T, CHUNK)
        n_slots = B * NT

    g_cum = torch.empty(rows, Hv, dtype=torch.float32, device=device)  # G per packed row
    from_x = cfg.corrections_from_x and cfg.wy_split
    w = torch.empty(0 if from_x else rows, Hv, Dk, dtype=dot_torch, device=device)
    # V' (on the W / U path: U first, V' written over it)
    u = torch.empty(rows, Hv, Dv, dtype=dot_torch, device=device)
    h_buf = torch.empty(max(n_slots, 1), Hv, Dk, Dv, dtype=dot_torch, device=device)

    x_buf = None
    if rows > 0:
        rows_of = dict(T=T, NT=NT, s_kt=k.stride(1), s_kh=k.stride(2), s_bt=beta.stride(1),
                       s_bh=beta.stride(2), BDK=BDK, chunk_start=chunk_start,
                       chunk_end=chunk_end, k=k, beta=beta, g_cum=g_cum)
        w_u = dict(v=v, w=w, u=u, s_vt=v.stride(1), s_vh=v.stride(2), BDV=BDV,
                   BK=_block(Dk, cfg.wy_block_k), BV=_block(Dv, cfg.wy_block_v),
                   num_warps=cfg.wy_warps, **rows_of, **common)
        gates = dict(g=g, s_gt=g.stride(1), s_gh=g.stride(2))
        if cfg.wy_split:
            warps = cfg.solve_warps or (1 if n_slots * Hv >= 4096 else 2)
            x_buf = torch.empty(rows, Hv, CHUNK, dtype=dot_torch, device=device)
            _solve_kernel[(n_slots, Hv)](
                x_buf=x_buf, BK=_block(Dk, cfg.solve_block_k), num_warps=warps,
                **gates, **rows_of, **{n: x for n, x in common.items() if n != "DV"})
            if not from_x:
                _wu_kernel[(n_slots, Hv)](x_buf=x_buf, **w_u)
        else:
            _wy_kernel[(n_slots, Hv)](**gates, **w_u)
    sbv = _block(Dv, cfg.state_block_v)
    _state_kernel[(N * Hv, triton.cdiv(Dv, sbv))](
        k, v, beta, w, u, x_buf, g_cum, h_buf, h0, ht, cu, chunk_offsets, T, NT,
        k.stride(1), k.stride(2), v.stride(1), v.stride(2), beta.stride(1), beta.stride(2),
        BDK=BDK, BV=sbv, HAS_H0=h0 is not None, STORE_HT=ht is not None,
        FROM_X=from_x and rows > 0,
        num_warps=cfg.state_warps, num_stages=cfg.state_stages, **common)
    if rows > 0:
        obv = _block(Dv, cfg.out_block_v)
        _output_kernel[(n_slots, Hv, triton.cdiv(Dv, obv))](
            q, k, u, g_cum, h_buf, o, chunk_start, chunk_end, T, NT,
            q.stride(1), q.stride(2), k.stride(1), k.stride(2), scale,
            BDK=BDK, BV=obv, num_warps=cfg.out_warps, **common)
    return o, ht
