"""Skinny GEMMs for the decode path: y[M, N] = x[M, K] @ W[N, K]^T for a few rows (M <= 8),
with the small kernels on either side folded in, beside their torch references.

A decode step's GEMM reads its whole weight to make one to eight rows: it is bound by the
weight's bytes, and cuBLAS, tiled for many rows, reaches about a third of the bandwidth.
Here a program owns BN output columns (W rows) and streams them once, in BK-wide chunks,
accumulating in float32: with one row as broadcast multiply-adds reduced at the end, with
more rows as a tensor-core dot of the rows padded to 16. When one step covers all of K
(BK >= K, the one-row default: a program's whole weight tile in flight at once) the weights
are loaded before the kernel waits for the one that writes x (programmatic dependent
launch, `kernels.pdl`), so their DRAM round trip overlaps the previous kernel. The K axis
can be split over SPLIT programs too, which add their partial sums into a float32
workspace; the last to arrive (a counter per column block) takes the sum, applies the
epilogue, and leaves the workspace and counter at zero again.

What it folds in, each rounded where the torch chain rounds (to x's dtype after each op
that torch computes in it), so the result is that chain's up to the GEMM's summation order:
- prologue on x, recomputed by each program (x is a few KB and stays in L2):
  `rms` the zero-centred RMSNorm of the row (`fused.rms_norm`), optionally written out
  (the final norm's hidden state); `gated` the GDN output norm per head of HEAD channels,
  with its gate z (`fused.gated_rms_norm`); `sigmoid` x * sigmoid(z), the attention output
  gate (`fused.sigmoid_mul`). z is addressed per head (row stride, head stride), so it can
  be a view into the packed in-projection's output.
- epilogue: `glu` (W holds [gate; up], 2N rows: y = silu(x Wg^T) * (x Wu^T)),
  `residual` (y = r + y), `argmax` (each row's greedy key, `kernels.greedy`), and `conv`:
  the GDN in-projection's depthwise causal conv (SiLU) over its first C columns, each
  lane's saved tail read from and shifted in its slot of the conv pool (`kernels.conv1d`'s
  arithmetic). Every (lane, channel) belongs to one program, so the tail's read and its
  update cannot race, which a separate conv kernel fused into the GDN step could not say.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ninfer.flags import FLAGS

from . import pdl
from .fused import _rows
from .greedy import KEY_NONE_C, key_of

NONE, RMS, GATED, SIGMOID = 0, 1, 2, 3
MAX_ROWS = 8


class Tiles(NamedTuple):
    """How one call is cut: BN output columns and BK of the K axis per step, warps per
    program, SPLIT programs along K, and whether the rows go through a tensor-core dot."""

    bn: int
    bk: int
    warps: int = 4
    split: int = 1
    dot: bool = False



def tiles_for(M: int, N: int, K: int, glu: bool, device: torch.device) -> Tiles:
    """The tiling for an [M, K] x [N, K] call (measured on an H200: `ninfer.bench.skinny`);
    on a GPU a tiling in `FLAGS.skinny_tiles` (the benchmark's sweep) comes first."""
    tuned = FLAGS.skinny_tiles.get((M == 1, N, K, glu))
    if tuned is not None and device.type == "cuda":
        return tuned
    if device.type != "cuda":  # the interpreter: as few programs as fit, each one step
        return Tiles(min(64, triton.next_power_of_2(N)), triton.next_power_of_2(K),
                     dot=M > 1)
    if M == 1:  # the H200 sweep's best for anchor-1b's shapes (bench/results/skinny-h200.json),
        # then each timed in the whole batch-1 decode graph (bench/NOTES.md): 527 -> 513 us
        if N <= 2048 and K <= 2048:  # back to the hidden size from 2K: 4 columns, 8 warps
            # (524 us, against 531 with 4 warps; 1 or 2 warps at 1 to 4 columns: 536..592)
            return Tiles(4, triton.next_power_of_2(K), 8)
        if N <= 2048 and K <= 4096:  # from 3-4K: 2 columns a program, all of K, 4 warps
            return Tiles(2, triton.next_power_of_2(K), 4)
        if K <= 1024:  # the in-projections, gate/up and the LM head: all of K in one step,
            # 2 warps (smaller programs pack the SMs tighter while the kernel before runs)
            return Tiles(8 if N > 65536 else 4, triton.next_power_of_2(K), 2)
        return Tiles(4 if glu else 8, 512, 4)
    if N <= 2048:
        return Tiles(16, 256, 4, split=4 if K >= 3072 else 1, dot=True)
    return Tiles(64 if N > 65536 else 32, 128 if N > 65536 else 256, 4, dot=True)


@triton.jit
def _norm_weights(nw_ptr, ks, km, PROLOGUE: tl.constexpr, HEAD: tl.constexpr):
    """The prologue's norm weights for columns ks, float32 (zeros where it has none)."""
    if PROLOGUE == 1:
        return tl.load(nw_ptr + ks, mask=km, other=0.0).to(tl.float32)
    elif PROLOGUE == 2:
        return tl.load(nw_ptr + ks % HEAD).to(tl.float32)
    else:
        return tl.zeros(ks.shape, dtype=tl.float32)


@triton.jit
def _x_tile(x_ptr, nw, z_ptr, xn_ptr, rows, rm, ks, km, pid_n, s_x, s_z, s_zh, s_xn, eps,
            offset, inv, K, dt: tl.constexpr, PROLOGUE: tl.constexpr, HEAD: tl.constexpr,
            BM: tl.constexpr, BK: tl.constexpr, NORMED: tl.constexpr, WHOLE: tl.constexpr):
    """Columns ks of the GEMM's left operand: x's rows with the prologue applied (nw: its
    norm weights, `_norm_weights`). WHOLE: ks covers all of K, and the rms norm's inverse
    is taken from this very load (else `inv` is given)."""
    xm = rm[:, None] & km[None, :]
    xv = tl.load(x_ptr + rows[:, None] * s_x + ks[None, :], mask=xm, other=0.0)
    if PROLOGUE == 1:  # y = x / rms(x) * (offset + w), cast back
        if WHOLE:
            xf = xv.to(tl.float32)
            inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)
        xv = (xv.to(tl.float32) * inv[:, None] * (offset + nw[None, :])).to(dt)
        if NORMED:
            tl.store(xn_ptr + rows[:, None] * s_xn + ks[None, :], xv,
                     mask=xm & (rows * 0 + pid_n == 0)[:, None])  # (a tensor mask)
    elif PROLOGUE == 2:  # per head: (w * (x / rms(x)).cast) .cast * silu(z)
        xf = tl.reshape(xv.to(tl.float32), [BM, BK // HEAD, HEAD])
        hinv = tl.rsqrt(tl.sum(xf * xf, axis=2) / HEAD + eps)
        normed = tl.reshape((xf * hinv[:, :, None]).to(dt), [BM, BK]).to(tl.float32)
        scaled = (nw[None, :] * normed).to(dt).to(tl.float32)
        zv = tl.load(z_ptr + rows[:, None] * s_z + (ks // HEAD)[None, :] * s_zh
                     + (ks % HEAD)[None, :], mask=xm, other=0.0).to(tl.float32)
        xv = (scaled * zv * tl.sigmoid(zv)).to(dt)
    elif PROLOGUE == 3:  # x * sigmoid(z), the sigmoid rounded first
        zv = tl.load(z_ptr + rows[:, None] * s_z + (ks // HEAD)[None, :] * s_zh
                     + (ks % HEAD)[None, :], mask=xm, other=0.0).to(tl.float32)
        xv = (xv.to(tl.float32) * tl.sigmoid(zv).to(dt).to(tl.float32)).to(dt)
    return xv


@triton.jit
def _accumulate(acc, xv, wv, DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc + x w^T: a tensor-core dot of the padded rows, or one row's multiply-adds."""
    if DOT:
        if IEEE:  # exact float32 products (the interpreter's bf16 dot reads raw bits)
            acc += tl.dot(xv.to(tl.float32), tl.trans(wv.to(tl.float32)),
                          input_precision="ieee")
        else:
            acc += tl.dot(xv, tl.trans(wv))
    else:
        acc += wv.to(tl.float32) * xv.to(tl.float32)
    return acc


@triton.jit
def _conv_tails(conv_ptr, slot_ptr, dest_ptr, cw_ptr, rows, rm, ns, nm, C, s_cn, s_cc, s_cwc,
                s_cwk, KC: tl.constexpr, KP: tl.constexpr):
    """For the conv epilogue, loaded before the PDL wait (EARLY_CONV), so that their two
    dependent round trips (the slot, then its tail) overlap the kernel before: the tails
    of the lanes' slots (pool [slots, C, KC-1], lane r at slot slot_ptr[r], negative: a
    padding lane, zeros) as [BM, BN, KP] entries 0 .. KC-2 and again shifted by one, the
    conv weights [1, BN, KP], where the tails are live, and where the shifted tails go
    (slot dest_ptr[r]: the same slot, or another that leaves the input tail intact)."""
    j = tl.arange(0, KP)[None, None, :]  # [1, 1, KP]
    slot = tl.load(slot_ptr + rows, mask=rm, other=-1).to(tl.int64)
    live = (rm[:, None] & (nm & (ns < C))[None, :] & (slot >= 0)[:, None])[:, :, None]
    tail = conv_ptr + slot[:, None, None] * s_cn + ns[None, :, None] * s_cc + j
    old = tl.load(tail, mask=live & (j < KC - 1), other=0.0)
    after = tl.load(tail + 1, mask=live & (j < KC - 2), other=0.0)  # entry j + 1
    dest = tl.load(dest_ptr + rows, mask=rm, other=-1).to(tl.int64)
    out = tail + (dest - slot)[:, None, None] * s_cn
    wc = tl.load(cw_ptr + ns[None, :, None] * s_cwc + j * s_cwk,
                 mask=(nm & (ns < C))[None, :, None] & (j < KC), other=0.0).to(tl.float32)
    return old, after, wc, live, out


@triton.jit
def _conv_epilogue(y, old, after, wc, live, out, ns, ym, C, KC: tl.constexpr,
                   KP: tl.constexpr):
    """y [BM, BN] (x's dtype) with its columns below C replaced by the causal conv of each
    lane's tail ++ y, SiLU'd, in float32 then rounded (`kernels.conv1d`'s arithmetic), and
    the live tails shifted by y into `out` (where ym: the program that finishes the sum)."""
    j = tl.arange(0, KP)[None, None, :]
    window = tl.where(j == KC - 1, y.to(tl.float32)[:, :, None], old.to(tl.float32))
    acc = tl.sum(wc * window, axis=2)
    new_tail = tl.where(j == KC - 2, y[:, :, None].to(old.dtype), after)
    tl.debug_barrier()  # every thread's reads of the old tail land before any update
    tl.store(out, new_tail, mask=live & ym[:, :, None] & (j < KC - 1))
    return tl.where(ym & (ns < C)[None, :], (acc * tl.sigmoid(acc)).to(y.dtype), y)


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, r_ptr, nw_ptr, z_ptr, xn_ptr, ws_ptr, cnt_ptr,
                   conv_ptr, slot_ptr, dest_ptr, cw_ptr, keys_ptr,
                   M, N, K, s_x, s_w, s_y, s_r, s_z, s_zh, s_xn, eps, offset,
                   C, s_cn, s_cc, s_cwc, s_cwk,
                   PROLOGUE: tl.constexpr, HEAD: tl.constexpr, GLU: tl.constexpr,
                   RESIDUAL: tl.constexpr, NORMED: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                   DOT: tl.constexpr, IEEE: tl.constexpr, SINGLE: tl.constexpr,
                   CONV: tl.constexpr, KC: tl.constexpr, KP: tl.constexpr,
                   ARGMAX: tl.constexpr, EARLY_CONV: tl.constexpr, FENCE: tl.constexpr,
                   PDL: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    if not FENCE:  # (fenced: the kernels after this start once it has waited, `kernels.pdl`)
        pdl.launch_dependents(PDL)
    dt = y_ptr.dtype.element_ty
    rows = tl.arange(0, BM)
    rm = rows < M
    ns = pid_n * BN + tl.arange(0, BN)
    nm = ns < N
    if SINGLE:  # one step covers K: the weights load before the wait for x's producer
        ks1 = tl.arange(0, BK)
        km1 = ks1 < K
        w_ptrs = w_ptr + ns[:, None] * s_w + ks1[None, :]
        wv1 = tl.load(w_ptrs, mask=nm[:, None] & km1[None, :], other=0.0)
        if GLU:  # the up row n sits N rows below the gate row n
            wu1 = tl.load(w_ptrs + N * s_w, mask=nm[:, None] & km1[None, :], other=0.0)
        nw1 = _norm_weights(nw_ptr, ks1, km1, PROLOGUE, HEAD)  # weights too: before the wait
    if CONV and EARLY_CONV and not FENCE:  # a decode step's slot pool: written only by
        # earlier forwards (fenced: the kernel before may have just fetched the slots)
        old, after, wc, live, out = _conv_tails(conv_ptr, slot_ptr, dest_ptr, cw_ptr, rows, rm,
                                                ns, nm, C, s_cn, s_cc, s_cwc, s_cwk, KC, KP)
    pdl.wait(PDL)  # from here on: reads of what earlier kernels wrote, and every write
    if FENCE:
        pdl.launch_dependents(PDL)
    ym = rm[:, None] & nm[None, :]
    if RESIDUAL and SPLIT == 1:  # issued now, its round trip overlaps the GEMM's
        r = tl.load(r_ptr + rows[:, None] * s_r + ns[None, :], mask=ym, other=0.0)
    if CONV and (FENCE or not EARLY_CONV):
        old, after, wc, live, out = _conv_tails(conv_ptr, slot_ptr, dest_ptr, cw_ptr, rows, rm,
                                                ns, nm, C, s_cn, s_cc, s_cwc, s_cwk, KC, KP)
    per = tl.cdiv(tl.cdiv(K, BK), SPLIT) * BK  # this program's share of K
    k_lo = pid_k * per
    k_hi = tl.minimum(k_lo + per, K)
    inv = tl.zeros([BM], dtype=tl.float32)
    if PROLOGUE == 1 and not SINGLE:  # the row's rms over all of K, whichever part is read
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            xv = tl.load(x_ptr + rows[:, None] * s_x + ks[None, :],
                         mask=rm[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(xv * xv, axis=1)
        inv = tl.rsqrt(ss / K + eps)
    if DOT:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if GLU:
            acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    else:  # one row: multiply-adds per element, reduced over K once at the end
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        if GLU:
            acc_u = tl.zeros([BN, BK], dtype=tl.float32)
    if SINGLE:
        xv = _x_tile(x_ptr, nw1, z_ptr, xn_ptr, rows, rm, ks1, km1, pid_n, s_x, s_z, s_zh,
                     s_xn, eps, offset, inv, K, dt, PROLOGUE, HEAD, BM, BK, NORMED, True)
        acc = _accumulate(acc, xv, wv1, DOT, IEEE)
        if GLU:
            acc_u = _accumulate(acc_u, xv, wu1, DOT, IEEE)
    else:
        for k0 in range(k_lo, k_hi, BK):
            ks = k0 + tl.arange(0, BK)
            km = ks < K
            xv = _x_tile(x_ptr, _norm_weights(nw_ptr, ks, km, PROLOGUE, HEAD), z_ptr, xn_ptr,
                         rows, rm, ks, km, pid_n, s_x, s_z, s_zh, s_xn, eps, offset, inv, K,
                         dt, PROLOGUE, HEAD, BM, BK, NORMED, False)
            w_ptrs = w_ptr + ns[:, None] * s_w + ks[None, :]
            wm = nm[:, None] & km[None, :]
            acc = _accumulate(acc, xv, tl.load(w_ptrs, mask=wm, other=0.0), DOT, IEEE)
            if GLU:  # the up row n sits N rows below the gate row n
                acc_u = _accumulate(acc_u, xv, tl.load(w_ptrs + N * s_w, mask=wm, other=0.0),
                                    DOT, IEEE)
    if DOT:
        y = acc
        if GLU:
            y_u = acc_u
    else:
        y = tl.sum(acc, axis=1)[None, :]  # [1, BN]
        if GLU:
            y_u = tl.sum(acc_u, axis=1)[None, :]
    if SPLIT > 1:  # add into the workspace; the last program of this column block goes on
        ws = ws_ptr + rows[:, None] * N + ns[None, :]
        tl.atomic_add(ws, y, mask=ym)
        if GLU:
            tl.atomic_add(ws + BM * N, y_u, mask=ym)
        tl.debug_barrier()  # every thread's partial sums land before the count says so
        count = tl.atomic_add(cnt_ptr + pid_n, 1)
        last = (tl.zeros([BM, BN], dtype=tl.int32) + count) == SPLIT - 1
        ym = ym & last
        zero = tl.zeros([BM, BN], dtype=tl.float32)
        y = tl.atomic_add(ws, zero, mask=ym)  # the sum, read where the adds landed (L2)
        tl.store(ws, zero, mask=ym)  # zeros again for the next call
        if GLU:
            y_u = tl.atomic_add(ws + BM * N, zero, mask=ym)
            tl.store(ws + BM * N, zero, mask=ym)
        tl.atomic_xchg(cnt_ptr + pid_n, 0, mask=count == SPLIT - 1)
    y = y.to(dt)
    if CONV:
        y = _conv_epilogue(y, old, after, wc, live, out, ns, ym, C, KC, KP)
    if GLU:  # silu(g) * u, silu rounded first as torch's is
        g = y.to(tl.float32)
        y = ((g * tl.sigmoid(g)).to(dt).to(tl.float32) * y_u.to(dt).to(tl.float32)).to(dt)
    if RESIDUAL:
        if SPLIT > 1:  # only the program that finishes the sum reads it
            r = tl.load(r_ptr + rows[:, None] * s_r + ns[None, :], mask=ym, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
    tl.store(y_ptr + rows[:, None] * s_y + ns[None, :], y, mask=ym)
    if ARGMAX:  # each row's greedy key over this program's columns, folded into the row's
        key = tl.where(ym, key_of(y.to(tl.float32), ns[None, :] + rows[:, None] * 0),
                       KEY_NONE_C)
        tl.atomic_max(keys_ptr + rows, tl.max(key, axis=1), mask=rm)


_workspaces: dict[torch.device, tuple[Tensor, Tensor]] = {}
_outgrown: list[tuple[Tensor, Tensor]] = []  # graphs captured earlier may still use these


def _workspace(device: torch.device, floats: int, counters: int) -> tuple[Tensor, Tensor] | None:
    """The zeroed float32 workspace and counters that split-K calls (on one stream) share:
    each call leaves them zero. Grown only outside a CUDA graph capture (None there when
    too small); one it outgrows is kept, never freed: a captured graph may hold it."""
    ws, cnt = _workspaces.get(device, (None, None))
    if ws is None or cnt is None or ws.numel() < floats or cnt.numel() < counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if ws is not None and cnt is not None:
            _outgrown.append((ws, cnt))
        # room for 16 rows of N = 8K gate + up at the first call: no growth at the model's
        ws = torch.zeros(max(floats, 2 * 16 * 8192), dtype=torch.float32, device=device)
        cnt = torch.zeros(max(counters, 8192), dtype=torch.int32, device=device)
        _workspaces[device] = (ws, cnt)
    return ws, cnt


def _exact_dots(x: Tensor) -> bool:
    """Whether the dots of rows of x take exact float32 products: float32 inputs, or the
    interpreter (whose bf16 dot reads raw bits); bf16 on the GPU uses the tensor cores."""
    return x.dtype == torch.float32 or x.device.type != "cuda"


def _launch(x: Tensor, w: Tensor, *, prologue: int = NONE, norm_weight: Tensor | None = None,
            eps: float = 0.0, offset: float = 1.0, z: Tensor | None = None, head: int = 1,
            glu: bool = False, residual: Tensor | None = None, normed: bool = False,
            conv: tuple[Tensor, ...] | None = None, argmax: Tensor | None = None,
            tiles: Tiles | None = None) -> Tensor | tuple[Tensor, Tensor]:
    K = x.shape[-1]
    N = w.shape[0] // 2 if glu else w.shape[0]
    x2 = _rows(x)
    M = x2.shape[0]
    if M > MAX_ROWS or w.shape[1] != K or w.stride(1) != 1:
        raise ValueError(f"skinny GEMM takes up to {MAX_ROWS} rows of a unit-stride weight "
                         f"with K={K}, got x {tuple(x.shape)}, w {tuple(w.shape)}")
    t = tiles or tiles_for(M, N, K, glu, x.device)
    if M > 1 or t.dot:  # several rows go through the dot, whose tiles are 16 or more
        t = t._replace(dot=True, bn=max(t.bn, 16), bk=max(t.bk, 16))
    if prologue == GATED:  # whole heads per step
        t = t._replace(bk=max(t.bk, head))
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    xn = torch.empty(M, K, dtype=x.dtype, device=x.device) if normed else y
    r2 = _rows(residual) if residual is not None else y
    z2 = z.reshape(M, -1, head) if z is not None else x2.view(M, -1, 1)
    BM = 16 if t.dot else 1
    grid_n = triton.cdiv(N, t.bn)
    ws = _workspace(x.device, 2 * BM * N, grid_n) if t.split > 1 else None
    if t.split > 1 and ws is None:
        t = t._replace(split=1)
    ws, cnt = ws if ws is not None else (y, y)
    if conv is not None:
        pool, slots, dests, cw = _conv_args(conv, M, N, glu, residual)
    else:
        pool = slots = dests = cw = y
    if argmax is not None and (argmax.shape != (M,) or argmax.dtype != torch.int64):
        raise ValueError(f"the argmax epilogue folds greedy keys into an int64 [{M}], got "
                         f"{tuple(argmax.shape)} {argmax.dtype}")
    _skinny_kernel[(grid_n, t.split)](
        x2, w, y, r2, norm_weight if norm_weight is not None else w, z2, xn, ws, cnt,
        pool, slots, dests, cw, argmax if argmax is not None else y,
        M, N, K, x2.stride(0), w.stride(0), y.stride(0), r2.stride(0), z2.stride(0),
        z2.stride(1), xn.stride(0), eps, offset,
        cw.shape[0] if conv is not None else 0, pool.stride(0), pool.stride(1),
        cw.stride(0), cw.stride(1),
        PROLOGUE=prologue, HEAD=head, GLU=glu, RESIDUAL=residual is not None, NORMED=normed,
        BM=BM, BN=t.bn, BK=t.bk, SPLIT=t.split, DOT=t.dot,
        IEEE=_exact_dots(x),
        SINGLE=t.split == 1 and t.bk >= K, CONV=conv is not None,
        KC=cw.shape[1] if conv is not None else 2,
        KP=triton.next_power_of_2(cw.shape[1]) if conv is not None else 2,
        ARGMAX=argmax is not None, EARLY_CONV=FLAGS.early_conv, num_warps=t.warps,
        **pdl.launch(x, fenced=True))
    y = y.view(*x.shape[:-1], N)
    return (y, xn.view(x.shape)) if normed else y


def _conv_args(conv, M: int, N: int, glu: bool, residual
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The conv epilogue's (pool [slots, C, K-1], slots [M], destination slots [M],
    weight [C, K]), checked; the destinations default to the slots."""
    pool, slots, cw, *rest = conv
    dests = rest[0] if rest else slots
    C, KC = cw.shape
    if glu or residual is not None or C > N or KC < 2 or slots.shape != (M,) \
            or dests.shape != (M,) or len(rest) > 1 \
            or tuple(pool.shape[1:]) != (C, KC - 1) or pool.stride(-1) != 1:
        raise ValueError(f"the conv epilogue takes a pool [slots, C, K-1] (last axis "
                         f"contiguous), {M} slots and a weight [C <= {N}, K], without glu or "
                         f"residual; got pool {tuple(pool.shape)}, slots "
                         f"{tuple(slots.shape)}, weight {tuple(cw.shape)}")
    return pool, slots, dests, cw


def linear(x: Tensor, w: Tensor, residual: Tensor | None = None, *, glu: bool = False,
           tiles: Tiles | None = None) -> Tensor:
    """x [..., K] @ w[N, K]^T (+ residual [..., N]), in x's dtype; `glu`: w is [gate; up]
    (2N rows) and the result silu(gate) * up."""
    return _launch(x, w, residual=residual, glu=glu, tiles=tiles)


def norm_linear(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor, *, glu: bool = False,
                normed: bool = False, offset: float = 1.0,
                conv: tuple[Tensor, ...] | None = None, argmax: Tensor | None = None,
                tiles: Tiles | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """rms_norm(x) @ w^T; `glu`: w is [gate; up] and the result silu(gate) * up; `normed`:
    (y, the normed x) is returned. `conv=(pool, slots, weight [C, K])`: y's first C
    columns go through the causal conv with SiLU of one new input per row, row r
    continuing from the tail in pool[slots[r]] ([slots, C, K-1]), which is updated in place
    (a negative slot: zeros, not written), as `kernels.conv1d.causal_conv1d_update`;
    `conv=(pool, slots, weight, dests)` writes the new tails to pool[dests[r]] instead.
    The pool and the slots are read before the PDL wait (`FLAGS.early_conv`; after it in the
    kernel that keeps a fence, `kernels.pdl`): nothing launched in the same forward may
    write them (a decode step's slot pool).
    `argmax`: int64 [rows], each row's greedy key over y (`kernels.greedy`) folded in by
    atomic max (reset it to KEY_NONE first; the LM head's greedy token on the device)."""
    return _launch(x, w, prologue=RMS, norm_weight=norm_weight, eps=eps, offset=offset,
                   glu=glu, normed=normed, conv=conv, argmax=argmax, tiles=tiles)


def gated_norm_linear(x: Tensor, z: Tensor, norm_weight: Tensor, eps: float, w: Tensor,
                      residual: Tensor | None = None, tiles: Tiles | None = None) -> Tensor:
    """x, z [..., H, D] -> gated_rms_norm(x, z) over each head's D channels, flattened, @ w^T
    (+ residual). z may be a view with any head and row strides."""
    return _launch(x.reshape(*x.shape[:-2], -1), w, prologue=GATED, norm_weight=norm_weight,
                   eps=eps, z=z, head=x.shape[-1], residual=residual, tiles=tiles)


def gate_linear(x: Tensor, g: Tensor, w: Tensor, residual: Tensor | None = None,
                tiles: Tiles | None = None) -> Tensor:
    """x, g [..., H, D] -> (x * sigmoid(g)) flattened @ w^T (+ residual); g may be a view."""
    return _launch(x.reshape(*x.shape[:-2], -1), w, prologue=SIGMOID, z=g, head=x.shape[-1],
                   residual=residual, tiles=tiles)


# --- torch references: the chains these replace, op for op ----------------------------------

def _wide(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _rms_norm_reference(x, weight, eps, offset=1.0):
    xf = x.to(_wide(x))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            * (offset + weight.to(xf.dtype))).to(x.dtype)


def linear_reference(x, w, residual=None, *, glu=False):
    y = F.linear(x, w)
    if glu:
        n = w.shape[0] // 2
        y = F.silu(y[..., :n]) * y[..., n:]
    return y if residual is None else residual + y


def norm_linear_reference(x, norm_weight, eps, w, *, glu=False, normed=False, offset=1.0):
    xn = _rms_norm_reference(x, norm_weight, eps, offset)
    y = linear_reference(xn, w, glu=glu)
    return (y, xn) if normed else y


def gated_norm_linear_reference(x, z, norm_weight, eps, w, residual=None):
    xf = x.to(_wide(x))
    normed = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    o = (normed * F.silu(z.to(xf.dtype))).to(x.dtype)
    return linear_reference(o.reshape(*o.shape[:-2], -1), w, residual)


def gate_linear_reference(x, g, w, residual=None):
    o = x * torch.sigmoid(g)
    return linear_reference(o.reshape(*o.shape[:-2], -1), w, residual)
