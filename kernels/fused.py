"""Fused elementwise kernels for the decode path, beside their torch references.

A one-token step of a hybrid model is hundreds of tiny kernels when each torch op is its
own: the norms alone are eight each (casts, square, mean, rsqrt, scale, cast back). These
do each chain in one pass over rows of the last axis, rounding where the torch chain rounds
(to the input's dtype after each op that torch computes in it), so they agree with the
references below to the last bit of the arithmetic they share.

- `rms_norm(x, w, eps, offset, residual)`: y = x / rms(x) * (offset + w) in float32, cast
  back (offset 1: the zero-centred norms; 0: a plain weight); with `residual`, first
  h = residual + x in x's dtype, and (y, h) is returned.
- `gated_rms_norm(x, z, w, eps)`: the GDN output norm, (w * rms-normed x) * silu(z).
- `silu_mul(g, u)`: SwiGLU's silu(g) * u.  `sigmoid_mul(x, g)`: x * sigmoid(g).
- `rope(x, cos, sin)`: the half-split rotary embedding on the first cos.shape[-1] channels.
- `qk_norm_gates(q, k, b, a, A_log, dt_bias)`: what a GDN layer's chunked rule takes from
  its conv and projections, in float32: q and k L2-normalised per head, beta = sigmoid(b),
  g = -exp(A_log) * softplus(a + dt_bias) (~20 torch launches a layer: a prefill chunk
  is host-bound on the H200 machine, at ~30 us of host time a launch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from . import pdl


def _rows(x: Tensor) -> Tensor:
    """x as [rows, D] with a unit last stride (a copy only when it cannot be a view)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, D, s_x, s_r, s_y, s_h, eps, offset,
                     BD: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    m = cols < D
    x = tl.load(x_ptr + row * s_x + cols, mask=m, other=0.0)
    if RESIDUAL:  # h = residual + x, rounded to the input dtype as torch's add is
        x = (tl.load(r_ptr + row * s_r + cols, mask=m, other=0.0).to(tl.float32)
             + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * s_h + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y + cols, (xf * inv * (offset + w)).to(y_ptr.dtype.element_ty),
             mask=m)


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 1.0,
             residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    D = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = _rows(residual) if residual is not None else x2
    h = torch.empty_like(y) if residual is not None else y
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, h, D, x2.stride(0), r2.stride(0),
                                     y.stride(0), h.stride(0), eps, offset,
                                     BD=triton.next_power_of_2(D),
                                     RESIDUAL=residual is not None, **pdl.launch(x))
    if residual is None:
        return y.view(x.shape)
    return y.view(x.shape), h.view(x.shape)


def rms_norm_reference(x, weight, eps, offset=1.0, residual=None):
    h = x if residual is None else residual + x
    wide = torch.promote_types(x.dtype, torch.float32)
    hf = h.to(wide)
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
         * (offset + weight.to(wide))).to(x.dtype)
    return y if residual is None else (y, h)


@triton.jit
def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, R, D, s_x, s_z, s_y, eps,
                       BR: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    m = cols < D
    mask = (rows < R)[:, None] & m[None, :]
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * s_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]).to(dt)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    scaled = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(dt).to(tl.float32)
    z = tl.load(z_ptr + rows[:, None] * s_z + cols[None, :], mask=mask, other=0.0)
    z = z.to(tl.float32)
    tl.store(y_ptr + rows[:, None] * s_y + cols[None, :], (scaled * z * tl.sigmoid(z)).to(dt),
             mask=mask)


# elements a gated norm program takes (whole rows): one row of a head (128) a program made
# 131,072 programs of a prefill chunk's 8,192 tokens on anchor-1b, 159 us a layer on the
# H100, ~5x its bytes' time at the copy bandwidth; 32 rows a program: a 32K prefill 205.0 ->
# 196.3 ms (bench/results/prefill-ab-h100-stop46.json)
GATED_NORM_ELEMENTS = 4096


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    D = x.shape[-1]
    x2, z2 = _rows(x), _rows(z)
    R = x2.shape[0]
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    BD = triton.next_power_of_2(D)
    BR = min(max(1, GATED_NORM_ELEMENTS // BD), triton.next_power_of_2(R))
    _gated_norm_kernel[(triton.cdiv(R, BR),)](x2, z2, weight, y, R, D, x2.stride(0),
                                              z2.stride(0), y.stride(0), eps, BR=BR, BD=BD,
                                              **pdl.launch(x))
    return y.view(x.shape)


def gated_rms_norm_reference(x, z, weight, eps):
    wide = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(wide)
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(z.to(wide))).to(x.dtype)


@triton.jit
def _gate_mul_kernel(a_ptr, b_ptr, y_ptr, D, s_a, s_b, s_y, BD: tl.constexpr,
                     SILU: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = blk * BD + tl.arange(0, BD)
    m = cols < D
    dt = a_ptr.dtype.element_ty
    a = tl.load(a_ptr + row * s_a + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * s_b + cols, mask=m, other=0.0).to(tl.float32)
    if SILU:  # silu(a) * b: silu rounds to the dtype first, as torch's does
        y = (a * tl.sigmoid(a)).to(dt).to(tl.float32) * b
    else:     # a * sigmoid(b)
        y = a * tl.sigmoid(b).to(dt).to(tl.float32)
    tl.store(y_ptr + row * s_y + cols, y.to(dt), mask=m)


def _gate_mul(a: Tensor, b: Tensor, silu: bool) -> Tensor:
    D = a.shape[-1]
    a2, b2 = _rows(a), _rows(b)
    y = torch.empty(a2.shape, dtype=a.dtype, device=a.device)
    BD = min(1024, triton.next_power_of_2(D))
    _gate_mul_kernel[(a2.shape[0], triton.cdiv(D, BD))](a2, b2, y, D, a2.stride(0),
                                                         b2.stride(0), y.stride(0), BD=BD,
                                                         SILU=silu, **pdl.launch(a))
    return y.view(a.shape)


def silu_mul(g: Tensor, u: Tensor) -> Tensor:
    return _gate_mul(g, u, silu=True)


def sigmoid_mul(x: Tensor, g: Tensor) -> Tensor:
    return _gate_mul(x, g, silu=False)


def silu_mul_reference(g, u):
    return F.silu(g) * u


def sigmoid_mul_reference(x, g):
    return x * torch.sigmoid(g)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, D, s_x, s_c, s_y,
                 R: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # one (position, head): cos/sin are per position
    pos = row // H
    cols = tl.arange(0, BD)
    m = cols < D
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * s_x + cols, mask=m, other=0.0)
    rot = cols < R
    half: tl.constexpr = R // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    other = tl.load(x_ptr + row * s_x + partner, mask=rot, other=0.0).to(tl.float32)
    other = tl.where(cols < half, -other, other)  # rotate_half: [-x2, x1]
    c = tl.load(cos_ptr + pos * s_c + cols, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * s_c + cols, mask=rot, other=0.0).to(tl.float32)
    a = (x.to(tl.float32) * c).to(dt).to(tl.float32)
    b = (other * s).to(dt).to(tl.float32)
    y = tl.where(rot, (a + b).to(dt), x)
    tl.store(y_ptr + row * s_y + cols, y, mask=m)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, H, D]; cos, sin [B, T, R] (R even, <= D): `apply_rope` in one pass."""
    B, T, H, D = x.shape
    R = cos.shape[-1]
    x2 = _rows(x)
    c2, s2 = _rows(cos), _rows(sin)
    if c2.stride(0) != s2.stride(0):
        s2 = s2.contiguous().view(c2.shape) if c2.is_contiguous() else s2
        c2, s2 = c2.contiguous(), s2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _rope_kernel[(x2.shape[0],)](x2, c2, s2, y, H, D, x2.stride(0), c2.stride(0), y.stride(0),
                                 R=R, BD=triton.next_power_of_2(D), **pdl.launch(x))
    return y.view(x.shape)


@triton.jit
def _l2_heads(src, dst, b, t, h, d, m, out, s_b, s_t, s_h, s_d, eps):
    """One (lane, position)'s heads [BH, BD] read through any strides, each divided by its
    L2 norm (eps inside the root), stored contiguous at `out`, float32."""
    x = tl.load(src + b * s_b + t * s_t + h * s_h + d * s_d, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + out, x * tl.rsqrt(tl.sum(x * x, axis=1) + eps)[:, None], mask=m)


@triton.jit(do_not_specialize=["T"])  # T follows the request (one compile for all)
def _qk_norm_gates_kernel(q_ptr, k_ptr, b_ptr, a_ptr, alog_ptr, dtb_ptr, qn_ptr, kn_ptr,
                          beta_ptr, g_ptr, T, s_qb, s_qt, s_qh, s_qd, s_kb, s_kt, s_kh, s_kd,
                          s_bb, s_bt, s_bh, s_ab, s_at, s_ah, eps, HK: tl.constexpr,
                          DK: tl.constexpr, HV: tl.constexpr, BH: tl.constexpr,
                          BD: tl.constexpr, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (lane, position): every head of it
    b, t = row // T, row % T
    h = tl.arange(0, BH)[:, None]
    d = tl.arange(0, BD)[None, :]
    m = (h < HK) & (d < DK)
    out = row * HK * DK + h * DK + d
    _l2_heads(q_ptr, qn_ptr, b, t, h, d, m, out, s_qb, s_qt, s_qh, s_qd, eps)
    _l2_heads(k_ptr, kn_ptr, b, t, h, d, m, out, s_kb, s_kt, s_kh, s_kd, eps)
    hv = tl.arange(0, BV)
    mv = hv < HV
    bv = tl.load(b_ptr + b * s_bb + t * s_bt + hv * s_bh, mask=mv, other=0.0).to(tl.float32)
    x = tl.load(a_ptr + b * s_ab + t * s_at + hv * s_ah, mask=mv, other=0.0).to(tl.float32) \
        + tl.load(dtb_ptr + hv, mask=mv, other=0.0).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    rate = tl.exp(tl.load(alog_ptr + hv, mask=mv, other=0.0).to(tl.float32))
    tl.store(beta_ptr + row * HV + hv, tl.sigmoid(bv), mask=mv)
    tl.store(g_ptr + row * HV + hv, -rate * softplus, mask=mv)


def qk_norm_gates(q: Tensor, k: Tensor, b: Tensor, a: Tensor, A_log: Tensor, dt_bias: Tensor,
                  eps: float = 1e-6) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k [B, T, Hk, Dk], b, a [B, T, Hv] (any strides) -> q and k L2-normalised per head
    (x * rsqrt(sum x^2 + eps)), beta = sigmoid(b) and g = -exp(A_log) * softplus(a +
    dt_bias), all float32 and contiguous: the GDN chunked rule's inputs, in one launch."""
    B, T, Hk, Dk = q.shape
    Hv = b.shape[-1]
    qn = torch.empty(B, T, Hk, Dk, dtype=torch.float32, device=q.device)
    kn = torch.empty_like(qn)
    beta = torch.empty(B, T, Hv, dtype=torch.float32, device=q.device)
    g = torch.empty_like(beta)
    _qk_norm_gates_kernel[(B * T,)](q, k, b, a, A_log, dt_bias, qn, kn, beta, g, T,
                                    *q.stride(), *k.stride(), *b.stride(), *a.stride(), eps,
                                    HK=Hk, DK=Dk, HV=Hv, BH=triton.next_power_of_2(Hk),
                                    BD=triton.next_power_of_2(Dk),
                                    BV=triton.next_power_of_2(Hv))
    return qn, kn, beta, g


def qk_norm_gates_reference(q, k, b, a, A_log, dt_bias, eps=1e-6):
    """The torch chain of `ninfer.model.gdn` (`l2_normalize`, `GatedDeltaNet._gates`)."""
    def l2(x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
    beta = torch.sigmoid(b.float())
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return l2(q), l2(k), beta, g
