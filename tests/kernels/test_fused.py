"""The fused decode-path kernels against their torch references (the model's own ops),
float32 and bfloat16, on views with row strides like the model's."""

from __future__ import annotations

import pytest
import torch

from kernels import fused
from ninfer.model.layers import apply_rope, rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.4e-2}  # bf16: ~3 ulps (the interpreter truncates)


def _close(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().clamp(min=1.0)
    assert ((got.float() - want.float()).abs().max() / scale) <= TOL[dtype]


def _randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [1.0, 0.0])
def test_rms_norm_and_its_residual_form(dtype, offset):
    packed = _randn(3, 2, 160, dtype=dtype)
    x = packed[..., :96]  # a strided view, as a slice of a projection
    w = _randn(96, dtype=dtype) * 0.1
    _close(fused.rms_norm(x, w, 1e-6, offset), fused.rms_norm_reference(x, w, 1e-6, offset),
           dtype)
    r = _randn(3, 2, 96, dtype=dtype)
    y, h = fused.rms_norm(x, w, 1e-6, offset, residual=r)
    want_y, want_h = fused.rms_norm_reference(x, w, 1e-6, offset, residual=r)
    _close(h, want_h, dtype)
    _close(y, want_y, dtype)
    # the weight's offset is applied: a zero weight with offset 0 gives zeros
    assert fused.rms_norm(x, torch.zeros_like(w), 1e-6, 0.0).abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 37])   # a decode step's rows; a prefill's, in blocks
def test_gated_rms_norm(dtype, tokens, monkeypatch):
    """Rows of a head each normed alone, several rows a program (a last block of rows
    part-filled), on strided views as the GDN layer's output and gate are."""
    monkeypatch.setattr(fused, "GATED_NORM_ELEMENTS", 4 * 32)   # 4 rows a program here
    xz = _randn(2, tokens, 4, 2 * 32, dtype=dtype)
    x, z = xz[..., :32], xz[..., 32:]
    w = 1 + _randn(32, dtype=dtype) * 0.1
    got = fused.gated_rms_norm(x, z, w, 1e-6)
    _close(got, fused.gated_rms_norm_reference(x, z, w, 1e-6), dtype)
    # each row its own norm: scaling one row's x leaves the others' outputs as they were
    x2 = x.clone()
    x2[0, 0, 1] *= 3
    again = fused.gated_rms_norm(x2, z, w, 1e-6)
    assert torch.equal(again[1], got[1]) and torch.equal(again[0, 0, 0], got[0, 0, 0])
    _close(again, fused.gated_rms_norm_reference(x2, z, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_sigmoid_mul(dtype):
    gu = _randn(3, 1, 2 * 200, dtype=dtype)
    g, u = gu[..., :200], gu[..., 200:]
    _close(fused.silu_mul(g, u), fused.silu_mul_reference(g, u), dtype)
    _close(fused.sigmoid_mul(g, u), fused.sigmoid_mul_reference(g, u), dtype)
    assert not torch.allclose(fused.silu_mul(g, u).float(), fused.silu_mul(u, g).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [16, 64])
def test_rope_equals_apply_rope(dtype, rotary):
    B, T, H, D = 2, 3, 4, 64
    x = _randn(B, T, H, D, dtype=dtype)
    positions = torch.tensor([[5, 6, 7], [100, 101, 102]], device=DEVICE)
    cos, sin = rope_cos_sin(positions, rotary, 10_000.0, dtype)
    got = fused.rope(x, cos, sin)
    _close(got, apply_rope(x, cos, sin), dtype)
    if rotary < D:
        assert torch.equal(got[..., rotary:], x[..., rotary:])  # the rest passes through


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_gates_of_a_conv_output_view(dtype):
    """The GDN chunk's inputs from views like the model's: q and k heads out of a conv
    output [B, C, T] seen as [B, T, C] (channel stride T), gates out of a projection's
    columns; a's range covers both sides of softplus's threshold (20)."""
    B, T, Hk, Dk, Hv = 2, 5, 3, 24, 6
    conv = _randn(B, 2 * Hk * Dk + 8, T, dtype=dtype).transpose(1, 2)
    q = conv[..., :Hk * Dk].reshape(B, T, Hk, Dk)
    k = conv[..., Hk * Dk:2 * Hk * Dk].reshape(B, T, Hk, Dk)
    proj = _randn(B, T, 3 * Hv, dtype=dtype)
    b, a = proj[..., :Hv], proj[..., Hv:2 * Hv] * 15
    A_log, dt_bias = _randn(Hv, dtype=dtype) * 0.5, _randn(Hv, dtype=dtype) * 5
    a[0, 0, 0] = 30 - dt_bias[0]  # one gate each side of the threshold, whatever the draw
    a[1, 0, 1] = -30 - dt_bias[1]
    got = fused.qk_norm_gates(q, k, b, a, A_log, dt_bias)
    want = fused.qk_norm_gates_reference(q, k, b, a, A_log, dt_bias)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.is_contiguous()
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert torch.allclose(got[0].norm(dim=-1), torch.ones(B, T, Hk, device=DEVICE), atol=1e-4)
    above = a.float() + dt_bias.float() > 20
    assert above.any() and not above.all() and (got[3] <= 0).all()
