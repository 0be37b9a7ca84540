"""Triton kernel for the depthwise causal conv: a few new inputs per lane on the decode
path, or a prefill chunk's thousands.

One program owns one (lane, channel block) and all T positions, or, past TILE_T
positions, a tile of TILE_T of them. Only the first tile's positions read the saved tail
(a tile is at least K-1 positions), so that tile's program alone reads it and writes the
new one in place, whatever the tiling. With the saved tail
tail[0 .. K-2] and the new inputs x[0 .. T-1], the window is w = tail ++ x and
y[t] = act(bias + sum_j weight[j] * w[t + j]); the tail after position t is
w[t+1 .. t+K-1]. Window entries are read straight from memory (tail or x by index), so
nothing is shifted in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl

# positions a program takes: a prefill chunk's thousands are cut into tiles of this many
# (one [BC, T] tile of thousands of positions spilled: 324 us for a 2048-token chunk of
# anchor-1b's 4096 channels on the H200, a fifth of the whole prefill's GPU time)
TILE_T = 64


@triton.jit
def _window(x_row, tail_row, s_xc, s_xt, s_tc, offs_c, mc, live_c, w, T, KM1: tl.constexpr):
    """Window entries w [BC, N] (indices into tail ++ x; valid where 0 <= w < T + K-1),
    loaded in float32 from the tail (w < K-1, where live_c) or from x (w >= K-1, where mc);
    zeros elsewhere."""
    in_tail = (w < KM1) & (w >= 0)
    in_x = (w >= KM1) & (w < T + KM1)
    from_tail = tl.load(tail_row + offs_c[:, None] * s_tc + w, mask=live_c[:, None] & in_tail,
                        other=0.0)
    from_x = tl.load(x_row + offs_c[:, None] * s_xc + (w - KM1) * s_xt,
                     mask=mc[:, None] & in_x, other=0.0)
    return tl.where(in_tail, from_tail.to(tl.float32), from_x.to(tl.float32))


# T (a step's tokens per row) follows the request, so it is not specialised on being 1 or a
# multiple of 16: a next turn of an odd length met a kernel the warm-up had not compiled
@triton.jit(do_not_specialize=["T"])
def _conv_update_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, idx_ptr, out_idx_ptr, y_ptr, tail_ptr,
    C, T,
    s_xb, s_xc, s_xt, s_sn, s_sc, s_wc, s_wk, s_yb, s_yc, s_yt,
    s_ob, s_ot, s_oc,  # tail output strides: [B, C, K-1] (s_ot = 0) or [B, T, C, K-1]
    K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_INDEX: tl.constexpr,
    ALL_STATES: tl.constexpr, PDL: tl.constexpr,
):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    i_c, b, i_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_c = i_c * BC + tl.arange(0, BC)
    offs_t = i_t * BT + tl.arange(0, BT)
    mc = offs_c < C
    if HAS_INDEX:
        slot = tl.load(idx_ptr + b).to(tl.int64)
        dest = tl.load(out_idx_ptr + b).to(tl.int64)  # where the new tail goes
    else:
        slot = b.to(tl.int64)
        dest = slot
    # a negative slot is a padding lane: its tail reads as zeros and is never written; the
    # condition is a vector because the interpreter rejects scalar & tensor masks
    live_c = mc & ((slot + offs_c * 0) >= 0)
    x_row = x_ptr + b.to(tl.int64) * s_xb
    tail_row = state_ptr + slot * s_sn

    acc = tl.zeros([BC, BT], dtype=tl.float32)  # acc: [BC, BT]
    for j in tl.static_range(K):
        w_j = tl.load(w_ptr + offs_c * s_wc + j * s_wk, mask=mc, other=0.0).to(tl.float32)
        win = _window(x_row, tail_row, s_xc, s_xt, s_sc, offs_c, mc, live_c,
                      offs_t[None, :] + j, T, K - 1)
        acc += w_j[:, None] * win
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[:, None]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    mt = offs_t < T
    tl.store(y_ptr + b.to(tl.int64) * s_yb + offs_c[:, None] * s_yc + offs_t[None, :] * s_yt,
             acc.to(y_ptr.dtype.element_ty), mask=mc[:, None] & mt[None, :])

    out_row = tail_ptr + b.to(tl.int64) * s_ob
    if ALL_STATES:
        # tail after position t, entry i = w[t + 1 + i]: one [BC, BT] tile per entry
        for i in tl.static_range(K - 1):
            tail_i = _window(x_row, tail_row, s_xc, s_xt, s_sc, offs_c, mc, live_c,
                             offs_t[None, :] + 1 + i, T, K - 1)
            tl.store(out_row + offs_t[None, :] * s_ot + offs_c[:, None] * s_oc + i,
                     tail_i.to(tail_ptr.dtype.element_ty), mask=mc[:, None] & mt[None, :])
    elif i_t == 0:  # the new tail, by the first time tile's: the only reader of the old
        cols = tl.arange(0, KP)
        new_tail = _window(x_row, tail_row, s_xc, s_xt, s_sc, offs_c, mc, live_c,
                           T + cols[None, :], T, K - 1)  # [BC, KP]: w[T .. T+K-2]
        mk = cols[None, :] < K - 1
        tl.store(out_row + offs_c[:, None] * s_oc + cols[None, :],
                 new_tail.to(tail_ptr.dtype.element_ty), mask=mc[:, None] & mk)
        # every thread's reads of the old tail must land before any thread overwrites it
        tl.debug_barrier()
        tl.store(tail_row + (dest - slot) * s_sn + offs_c[:, None] * s_sc + cols[None, :],
                 new_tail.to(state_ptr.dtype.element_ty), mask=live_c[:, None] & mk)


def causal_conv1d_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None,
    activation: str | None = "silu", state_indices: Tensor | None = None,
    all_states: bool = False, BC: int | None = None, num_warps: int = 4,
    out_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over T new inputs per lane, continuing from saved tails.

    x: [B, C, T] (any strides; [B, T, C] memory, as a transposed projection, is the
    coalesced case); conv_state: [B, C, K-1], or with `state_indices` [B] (int) a slot pool
    [num_slots, C, K-1] of which lane b uses slot state_indices[b] (last axis contiguous;
    a negative index marks a padding lane: tail read as zeros, nothing written; slots of
    live lanes must be distinct); weight: [C, K]; bias: [C] or None; activation "silu" or
    None. Arithmetic in float32.

    Returns (y, tail): y [B, C, T] in x's dtype with x's memory layout. Without
    `all_states`, tail is the new tail [B, C, K-1] (a fresh tensor in conv_state's dtype),
    which is also written IN PLACE into conv_state at the lanes' slots (or at
    `out_indices` [B], with `state_indices`: the input tails are then left as they were;
    other slots untouched). With `all_states`, conv_state is not modified and tail is the tail after
    every position, [B, T, C, K-1] in conv_state's dtype. Matches
    `kernels.gdn_reference.causal_conv1d_update`.

    Grid (cdiv(C, BC), B, time tiles): up to TILE_T positions one tile (all of T), more
    (a prefill chunk) in tiles of TILE_T (or K-1, if more). Tunables BC (a power of two; default
    1024 // the tile's positions, from 16 to 128) and num_warps."""
    B, C, T = x.shape
    K = weight.shape[-1]
    if weight.shape != (C, K) or K < 2:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({C}, K >= 2)")
    if activation not in ("silu", None):
        raise ValueError(f"unsupported activation {activation!r}")
    if state_indices is None:
        if tuple(conv_state.shape) != (B, C, K - 1):
            raise ValueError(f"conv_state has shape {tuple(conv_state.shape)}, "
                             f"expected {(B, C, K - 1)}")
    elif tuple(conv_state.shape[1:]) != (C, K - 1) or state_indices.shape != (B,):
        raise ValueError(f"conv_state pool {tuple(conv_state.shape)} / indices "
                         f"{tuple(state_indices.shape)} do not fit {(B, C, K - 1)}")
    if out_indices is not None and (state_indices is None or out_indices.shape != (B,)):
        raise ValueError("out_indices [B] go with state_indices")
    if conv_state.stride(-1) != 1:
        raise ValueError("conv_state must have a contiguous last axis")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({C},)")
    y = torch.empty_like(x)
    if all_states:
        tail = conv_state.new_empty(B, T, C, K - 1)
        t_strides = tail.stride()[:3]
    else:
        tail = conv_state.new_empty(B, C, K - 1)
        t_strides = (tail.stride(0), 0, tail.stride(1))
    tile = max(TILE_T, triton.next_power_of_2(K - 1))  # the old tail within the first
    BT = tile if T > tile else max(2, triton.next_power_of_2(T))  # no size-1 blocks
    BC = BC or max(16, min(128, 1024 // BT))  # [BC, BT] float32 tiles without spills
    grid = (triton.cdiv(C, BC), B, max(1, triton.cdiv(T, BT)))  # T = 0: the tail still
    _conv_update_kernel[grid](
        x, conv_state, weight, bias if bias is not None else weight,
        state_indices if state_indices is not None else conv_state,
        out_indices if out_indices is not None else state_indices if state_indices is not None
        else conv_state, y, tail,
        C, T,
        *x.stride(), *conv_state.stride()[:2], *weight.stride(), *y.stride(), *t_strides,
        K=K, KP=max(2, triton.next_power_of_2(K - 1)), BC=BC, BT=BT,
        HAS_BIAS=bias is not None, SILU=activation == "silu",
        HAS_INDEX=state_indices is not None, ALL_STATES=all_states, num_warps=num_warps,
        **pdl.launch(x),
    )
    return y, tail
