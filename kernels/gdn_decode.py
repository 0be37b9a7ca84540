"""Triton kernel for the gated delta rule on the decode path: a few positions per lane.

One program owns one (lane, value head, Dv tile): it loads its [Dk, BV] slice of the
recurrent state once, runs the T positions with the tile in registers, and writes the
state back once (plain decode) or after every position (speculative verify). Reading and
writing the state dominates, so the Dv tile is what spreads a small batch over the SMs.

The math is `kernels.gdn_reference.recurrent_gated_delta_rule`, rearranged so that both
reads of the old state happen in one pass: with S' = exp(g) S + k u^T,

    u = beta * (v - exp(g) S^T k),    o = scale * (exp(g) S^T q + (q . k) u).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ninfer.flags import FLAGS

from . import pdl

L2_EPS = 1e-6  # as ninfer.model.gdn.l2_normalize: x * rsqrt(sum x^2 + eps)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, idx_ptr, out_idx_ptr, states_ptr,
    T, scale,
    s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh,
    s_gb, s_gt, s_gh, s_bb, s_bt, s_bh, s_ob, s_ot, s_oh,
    s_sn, s_sh, s_sk,  # state pool strides (slot, head, Dk); Dv is contiguous
    s_ab, s_at, s_ah, s_ak,  # out_states strides (lane, position, head, Dk)
    ra_ptr, rb_ptr, alog_ptr, dtb_ptr, s_rab, s_rat, s_rah, s_rbb, s_rbt, s_rbh,
    HV: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_INDEX: tl.constexpr, ALL_STATES: tl.constexpr, L2NORM: tl.constexpr,
    EPS: tl.constexpr, RAW_GATES: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
):
    pdl.launch_dependents(PDL)
    if not EARLY:
        pdl.wait(PDL)
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    b, h = i_bh // HV, i_bh % HV
    hk = h // R  # grouped heads: consecutive value heads share a key head
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    mkv = mk[:, None] & mv[None, :]

    if HAS_INDEX:
        slot = tl.load(idx_ptr + b).to(tl.int64)
        dest = tl.load(out_idx_ptr + b).to(tl.int64)  # where the new state goes
    else:
        slot = b.to(tl.int64)
        dest = slot
    # a negative slot is a padding lane: its state reads as zeros and is never written (a
    # vector, not a scalar, in the mask: the interpreter rejects scalar & tensor masks)
    live = mkv & ((slot + offs_v * 0) >= 0)[None, :]
    p_s = state_ptr + slot * s_sn + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :]
    S = tl.load(p_s, mask=live, other=0.0).to(tl.float32)  # S: [BK, BV]
    if RAW_GATES:  # the gates' weights (never written by a kernel)
        dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
        a_rate = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    if EARLY:  # the state's DRAM round trip overlapped the previous kernel
        pdl.wait(PDL)

    p_q = q_ptr + b * s_qb + hk * s_qh + offs_k
    p_k = k_ptr + b * s_kb + hk * s_kh + offs_k
    p_v = v_ptr + b * s_vb + h * s_vh + offs_v
    p_o = o_ptr + b * s_ob + h * s_oh + offs_v
    p_g = g_ptr + b * s_gb + h * s_gh
    p_b = beta_ptr + b * s_bb + h * s_bh
    p_a = states_ptr + b.to(tl.int64) * s_ab + h * s_ah + offs_k[:, None] * s_ak + offs_v[None, :]
    for t in range(T):
        q = tl.load(p_q + t * s_qt, mask=mk, other=0.0).to(tl.float32)  # [BK]
        k = tl.load(p_k + t * s_kt, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(p_v + t * s_vt, mask=mv, other=0.0).to(tl.float32)  # [BV]
        if RAW_GATES:  # beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
            ra = tl.load(ra_ptr + b * s_rab + t * s_rat + h * s_rah).to(tl.float32)
            rb = tl.load(rb_ptr + b * s_rbb + t * s_rbt + h * s_rbh).to(tl.float32)
            x = ra + dt_bias
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            decay = tl.exp(a_rate * softplus)
            beta = tl.sigmoid(rb)
        else:
            decay = tl.exp(tl.load(p_g + t * s_gt).to(tl.float32))
            beta = tl.load(p_b + t * s_bt).to(tl.float32)
        # every sum over Dk in two reductions of the raw q and k (the L2 norms scale the
        # sums after): both reads of the old state, [BV] each, then |q|^2, |k|^2 and q.k
        read_k, read_q = tl.reduce((S * k[:, None], S * q[:, None]), 0, _add2)
        qq, kk, qk = tl.reduce((q * q, k * k, q * k), 0, _add3)
        rq = tl.full([1], scale, tl.float32)  # a compiled caller may pass scale as fp64
        rk = tl.full([1], 1.0, tl.float32)
        if L2NORM:
            rq = rq * tl.rsqrt(qq + EPS)
            rk = rk * tl.rsqrt(kk + EPS)
        k = k * rk
        u = beta * (v - decay * (read_k * rk))
        o = decay * (read_q * rq) + (qk * (rq * rk)) * u
        S = S * decay + k[:, None] * u[None, :]
        tl.store(p_o + t * s_ot, o.to(o_ptr.dtype.element_ty), mask=mv)
        if ALL_STATES:
            tl.store(p_a + t * s_at, S, mask=mkv)
    if not ALL_STATES:
        tl.store(p_s + (dest - slot) * s_sn, S, mask=live)



def _default_bv(lanes_heads: int, Dv: int) -> int:
    # 32 at every batch: in anchor-1b's batch-1 decode graph on the H200, 64 programs of
    # BV 32 beat 128 of BV 16 (569 against 580 us a replay) and 256 of BV 8 (590 us)
    return min(32, triton.next_power_of_2(Dv))


def fused_recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
    state_indices: Tensor | None = None, scale: float | None = None, all_states: bool = False,
    out_states: Tensor | None = None, use_qk_l2norm: bool = False,
    out_indices: Tensor | None = None, early_state: bool = False,
    BV: int | None = None, num_warps: int | None = None, gates: tuple | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The gated delta rule over T positions for each of B lanes, on the GPU.

    q, k: [B, T, Hk, Dk], already L2-normalised unless `use_qk_l2norm` (then normalised
    here as x * rsqrt(sum x^2 + 1e-6)); v: [B, T, Hv, Dv]; g (log-decay), beta: [B, T, Hv];
    Hv = r * Hk and value head h reads key head h // r. The last axis of q, k, v must be
    contiguous (other strides are free, so views of a packed projection need no copy).
    `state` (float32, last axis contiguous) is [B, Hv, Dk, Dv], or with `state_indices` [B]
    (int) a slot pool [num_slots, Hv, Dk, Dv] of which lane b uses slot state_indices[b]; a
    negative index marks a padding lane (state read as zeros, nothing written). Slots of
    live lanes must be distinct. scale defaults to Dk ** -0.5. `out_indices` [B] (with
    `state_indices`): lane b's new state goes to slot out_indices[b] instead of back into
    state_indices[b] (a step whose result may be thrown away leaves its input intact).

    Without `all_states`: returns o [B, T, Hv, Dv] in v's dtype and writes the state after
    the last position IN PLACE into `state` (at the lanes' slots, or `out_indices`; other
    slots untouched).
    With `all_states`: `state` is not modified; the state after every position goes to
    `out_states` [B, T, Hv, Dk, Dv] float32 (allocated if None, last axis contiguous) and
    (o, out_states) is returned, so a rollback to position t is `out_states[:, t]`.
    Matches `kernels.gdn_reference.recurrent_gated_delta_rule` (float32 arithmetic).
    `gates=(a, b, A_log, dt_bias)`: g and beta are computed here from the raw projections
    a, b [B, T, Hv] (any strides) as the model does, beta = sigmoid(b) and g = -exp(A_log)
    * softplus(a + dt_bias) (the `g`, `beta` arguments are then ignored and may be None).
    `early_state`: the state and the indices were written before the kernels that launch
    this one began (a decode step's slot pools: by earlier forwards, or by the host before
    this one), so they are read before the programmatic-dependent-launch wait.

    Grid (cdiv(Dv, BV), B * Hv); tunables BV (a power of two; default 32) and num_warps
    (default 4; 8 for BV >= 64)."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if gates is not None:
        g = beta = gates[0]  # placeholders of the right shape: RAW_GATES reads the gates
    if q.shape != k.shape or v.shape[:2] != (B, T) or g.shape != (B, T, Hv) \
            or beta.shape != (B, T, Hv):
        raise ValueError(f"shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)} do not agree")
    if Hv % Hk:
        raise ValueError(f"value heads {Hv} are not a multiple of key heads {Hk}")
    if state.dtype != torch.float32 or state.stride(-1) != 1:
        raise ValueError("state must be float32 with a contiguous last axis")
    if state_indices is None:
        if tuple(state.shape) != (B, Hv, Dk, Dv):
            raise ValueError(f"state has shape {tuple(state.shape)}, expected {(B, Hv, Dk, Dv)}")
        idx = state  # unused placeholder pointer
    else:
        if tuple(state.shape[1:]) != (Hv, Dk, Dv) or state_indices.shape != (B,):
            raise ValueError(f"state pool {tuple(state.shape)} / indices "
                             f"{tuple(state_indices.shape)} do not fit {(B, Hv, Dk, Dv)}")
        idx = state_indices
        if out_indices is not None and out_indices.shape != (B,):
            raise ValueError(f"out_indices {tuple(out_indices.shape)} do not fit {B} lanes")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    scale = Dk ** -0.5 if scale is None else float(scale)
    o = v.new_empty(B, T, Hv, Dv)
    if all_states:
        if out_states is None:
            out_states = torch.empty(B, T, Hv, Dk, Dv, dtype=torch.float32, device=v.device)
        elif tuple(out_states.shape) != (B, T, Hv, Dk, Dv) or out_states.stride(-1) != 1 \
                or out_states.dtype != torch.float32:
            raise ValueError(f"out_states must be float32 {(B, T, Hv, Dk, Dv)}, last axis "
                             "contiguous")
        a_strides = out_states.stride()[:4]
    else:
        a_strides = (0, 0, 0, 0)
    if BV is None and num_warps is None and FLAGS.gdn_step_tile is not None:
        BV, num_warps = FLAGS.gdn_step_tile
    BV = BV or _default_bv(B * Hv, Dv)
    # sm_90 at Dk 128: BV 16 / 4 warps takes 96 registers, BV 32 / 4 warps 167, BV 64 needs 8
    num_warps = num_warps or (8 if BV >= 64 else 4)
    grid = (triton.cdiv(Dv, BV), B * Hv)
    _gdn_decode_kernel[grid](
        q, k, v, g, beta, o, state, idx, out_indices if out_indices is not None else idx,
        out_states if all_states else state,
        T, scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *g.stride(), *beta.stride(), *o.stride()[:3],
        *state.stride()[:3], *a_strides,
        *(gates if gates is not None else (g, g, g, g)),
        *(gates[0].stride() + gates[1].stride() if gates is not None else (0,) * 6),
        HV=Hv, R=Hv // Hk, DK=Dk, DV=Dv, BK=triton.next_power_of_2(Dk), BV=BV,
        HAS_INDEX=state_indices is not None, ALL_STATES=all_states, L2NORM=use_qk_l2norm,
        EPS=L2_EPS, RAW_GATES=gates is not None, EARLY=early_state and not all_states,
        num_warps=num_warps, **pdl.launch(v),
    )
    return (o, out_states) if all_states else o
