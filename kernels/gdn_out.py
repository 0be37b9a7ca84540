"""A GDN layer's decode step and its output projection in one launch, for one lane.

In the batch-1 decode step the GDN rule (`kernels.gdn_decode`) and out_proj (the skinny
GEMM with the gated norm folded in) were two kernels of the chain, ~4 and ~2.5 us on the
H200, each mostly the fixed cost of a dependent kernel rather than its bytes. Here a
program of (head h, BN output columns) runs head h's whole step (its [Dk, Dv] state and
the gated norm over its Dv channels need nothing from other heads), then multiplies the
normed, gated head by its [BN, Dv] slice of out_proj: head h's share of those BN outputs.
The Hv shares of an output are summed by integer atomics in fixed point (units of 2^-32,
`SCALE`): integer addition does not depend on the order the programs arrive in, so the
sum, and the greedy token after it, is the same every replay (float atomics would not be).
The kernel after (the MLP's gate/up, `kernels.skinny`'s `pending` prologue) reads the sum,
adds the residual, and writes the layer's hidden state; the one after that (down) sets the
sums back to zero for the next layer.

The state and the weights are read before the PDL wait (`kernels.pdl`: the slot pool is
written only by earlier forwards); the Dv / BN programs of a head each read its state
(from L2 after the first) and each write 1 / (Dv / BN) of its rows. The arithmetic is the
decode kernel's (`kernels.gdn_decode`), o rounded to the activations' dtype as that kernel
stores it, then `kernels.skinny`'s gated-norm prologue, so that only the order of the
out_proj sum differs from the two kernels' (`gdn_step_out_reference`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl
from .gdn_decode import L2_EPS, _add2, _add3

SCALE = 2.0 ** 32  # fixed point: |sum| below 2^31 (hidden states are far smaller)


@triton.jit
def _gdn_out_kernel(
    qkv_ptr, z_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, nw_ptr, w_ptr, state_ptr, slot_ptr,
    dest_ptr, acc_ptr, scale, eps, s_sn, s_sh, s_sk, s_w, N,
    HV: tl.constexpr, HK: tl.constexpr, R: tl.constexpr, DK: tl.constexpr,
    DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr,
    NB: tl.constexpr, EPS_QK: tl.constexpr, PDL: tl.constexpr,
):
    pdl.launch_dependents(PDL)
    i_n, h = tl.program_id(0), tl.program_id(1)
    hk = h // R
    offs_k, offs_v = tl.arange(0, BK), tl.arange(0, BV)
    ns = i_n * BN + tl.arange(0, BN)
    mk, mv, mn = offs_k < DK, offs_v < DV, ns < N
    # before the wait: the lane's slots (the host's inputs), its state (earlier forwards'),
    # this program's out_proj slice, the norm and gate weights
    slot = tl.load(slot_ptr).to(tl.int64)
    dest = tl.load(dest_ptr).to(tl.int64)
    live = mk[:, None] & mv[None, :] & ((slot + offs_v * 0) >= 0)[None, :]
    p_s = state_ptr + slot * s_sn + h * s_sh + offs_k[:, None] * s_sk + offs_v[None, :]
    S = tl.load(p_s, mask=live, other=0.0).to(tl.float32)  # [BK, BV]
    W = tl.load(w_ptr + ns[:, None] * s_w + h * DV + offs_v[None, :],
                mask=mn[:, None] & mv[None, :], other=0.0)  # [BN, BV]
    nw = tl.load(nw_ptr + offs_v, mask=mv, other=0.0).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    a_rate = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    pdl.wait(PDL)

    dt = z_ptr.dtype.element_ty
    q = tl.load(qkv_ptr + hk * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(qkv_ptr + (HK + hk) * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(qkv_ptr + 2 * HK * DK + h * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + h * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    x = tl.load(a_ptr + h).to(tl.float32) + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    decay = tl.exp(a_rate * softplus)
    beta = tl.sigmoid(tl.load(b_ptr + h).to(tl.float32))
    read_k, read_q = tl.reduce((S * k[:, None], S * q[:, None]), 0, _add2)
    qq, kk, qk = tl.reduce((q * q, k * k, q * k), 0, _add3)
    rq = tl.full([1], scale, tl.float32) * tl.rsqrt(qq + EPS_QK)
    rk = tl.rsqrt(kk + EPS_QK)
    u = beta * (v - decay * (read_k * rk))
    o = decay * (read_q * rq) + (qk * (rq * rk)) * u
    S = S * decay + (k * rk)[:, None] * u[None, :]
    rows = BK // NB  # this program writes its share of the new state's rows
    mine = live & ((offs_k // rows) == i_n)[:, None]
    tl.store(p_s + (dest - slot) * s_sn, S, mask=mine)

    # the gated norm as `kernels.skinny`'s prologue computes it on the stored o
    o = tl.where(mv, o.to(dt).to(tl.float32), 0.0)
    hinv = tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)
    normed = (o * hinv).to(dt).to(tl.float32)
    xv = ((nw * normed).to(dt).to(tl.float32) * z * tl.sigmoid(z)).to(dt).to(tl.float32)
    part = tl.sum(W.to(tl.float32) * xv[None, :], axis=1)  # [BN]: head h's share
    fixed = tl.floor(part * 4294967296.0 + 0.5).to(tl.int64)  # round(part * SCALE)
    tl.atomic_add(acc_ptr + ns, fixed, mask=mn, sem="relaxed")


def gdn_step_out(qkv: Tensor, z: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                 norm_weight: Tensor, eps: float, w_out: Tensor, state: Tensor, slot: Tensor,
                 dest: Tensor, acc: Tensor, scale: float | None = None,
                 BN: int | None = None, num_warps: int = 8) -> None:
    """One lane's GDN decode step and out_proj, the projection's sum added into `acc`.

    qkv [1, 1, (2 Hk Dk + Hv Dv)] (the conv's output: q, k, v flat, unit stride); z [1, 1,
    Hv, Dv], a, b [1, 1, Hv] (views into the in-projection's output: each head's channels
    at unit stride, heads at Dv / 1 apart); A_log, dt_bias [Hv]; norm_weight [Dv] (the
    gated norm's); w_out [N, Hv Dv]; state: the float32 slot pool [slots, Hv, Dk, Dv]
    (last axis contiguous), read at slot[0] and written at dest[0] (a negative slot: zeros
    read, nothing written); acc: int64 [N], zero or holding earlier sums, to which
    round(out * 2^32) is added. Returns nothing: the kernel after reads acc
    (`pending_sum`). q and k are L2-normalised here; scale defaults to Dk ** -0.5."""
    Hv, Dv = z.shape[-2], z.shape[-1]
    Dk = state.shape[-2]
    Hk = (qkv.shape[-1] - Hv * Dv) // (2 * Dk)
    N = w_out.shape[0]
    if qkv.numel() != 2 * Hk * Dk + Hv * Dv or qkv.stride(-1) != 1 or Hk == 0 or Hv % Hk \
            or z.stride(-1) != 1 or z.stride(-2) != Dv or a.stride(-1) != 1 \
            or b.stride(-1) != 1 or tuple(w_out.shape) != (N, Hv * Dv) \
            or w_out.stride(1) != 1 or tuple(state.shape[1:]) != (Hv, Dk, Dv) \
            or state.dtype != torch.float32 or state.stride(-1) != 1 \
            or slot.numel() != 1 or dest.numel() != 1 or acc.dtype != torch.int64 \
            or acc.numel() != N or not acc.is_contiguous():
        raise ValueError(
            f"gdn_step_out takes one lane: qkv {tuple(qkv.shape)}, z {tuple(z.shape)}, "
            f"w_out {tuple(w_out.shape)}, state {tuple(state.shape)}, acc {tuple(acc.shape)} "
            f"{acc.dtype}")
    BK, BV = triton.next_power_of_2(Dk), triton.next_power_of_2(Dv)
    BN = BN or min(128, triton.next_power_of_2(N))
    nb = triton.cdiv(N, BN)
    if BK % nb and nb > 1:  # each program writes BK / nb rows of the state
        raise ValueError(f"{nb} column blocks do not share {BK} state rows")
    scale = Dk ** -0.5 if scale is None else float(scale)
    _gdn_out_kernel[(nb, Hv)](
        qkv, z, a, b, A_log, dt_bias, norm_weight, w_out, state, slot, dest, acc, scale, eps,
        *state.stride()[:3], w_out.stride(0), N,
        HV=Hv, HK=Hk, R=Hv // Hk, DK=Dk, DV=Dv, BK=BK, BV=BV, BN=BN, NB=min(nb, BK),
        EPS_QK=L2_EPS, num_warps=num_warps, **pdl.launch(qkv))


_buffers: dict[tuple[torch.device, int], Tensor] = {}


def pending_buffer(device: torch.device, n: int) -> Tensor | None:
    """The zeroed int64 [1, n] sums that one-row steps on `device` share (each layer's
    down GEMM leaves them zero again, `kernels.skinny`'s `zero`). Made only outside a CUDA
    graph capture (None there when missing): a captured graph keeps using it."""
    key = (torch.device(device), n)
    acc = _buffers.get(key)
    if acc is None:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        acc = _buffers[key] = torch.zeros(1, n, dtype=torch.int64, device=device)
    return acc


def pending_value(acc: Tensor, dtype: torch.dtype) -> Tensor:
    """The projection's sum as the kernel after reads it: acc / 2^32 in float32, rounded
    to the activations' dtype (the rounding of out_proj's output)."""
    return (acc.to(torch.float32) / SCALE).to(dtype)


def gdn_step_out_reference(qkv, z, a, b, A_log, dt_bias, norm_weight, eps, w_out, state, slot,
                           scale=None) -> tuple[Tensor, Tensor]:
    """The two kernels this replaces: (out_proj(gated norm(o, z)) [N] in float32 before its
    rounding, the new state [Hv, Dk, Dv]) for the lane in slot[0]."""
    from .gdn_reference import recurrent_gated_delta_rule
    Hv, Dv = z.shape[-2], z.shape[-1]
    Dk = state.shape[-2]
    Hk = (qkv.shape[-1] - Hv * Dv) // (2 * Dk)
    flat = qkv.reshape(-1).float()
    q = flat[:Hk * Dk].view(1, 1, Hk, Dk)
    k = flat[Hk * Dk:2 * Hk * Dk].view(1, 1, Hk, Dk)
    v = flat[2 * Hk * Dk:].view(1, 1, Hv, Dv)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    beta = torch.sigmoid(b.reshape(1, 1, Hv).float())
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.reshape(1, 1, Hv).float()
                                                              + dt_bias.float())
    s = int(slot.reshape(-1)[0])
    init = state[s:s + 1].float() if s >= 0 else torch.zeros(1, Hv, Dk, Dv)
    o, new = recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=init)
    o = o.to(z.dtype).float().reshape(Hv, Dv)
    normed = (o * torch.rsqrt((o * o).mean(-1, keepdim=True) + eps)).to(z.dtype).float()
    zf = z.reshape(Hv, Dv).float()
    xv = ((norm_weight.float() * normed).to(z.dtype).float() * zf * torch.sigmoid(zf)
          ).to(z.dtype).float()
    return w_out.float() @ xv.reshape(-1), new[0]
