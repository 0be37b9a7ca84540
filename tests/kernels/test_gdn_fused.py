"""The fused CUDA GDN mixer (`kernels.gdn_fused`) against the Triton chain it replaces.

The CUDA library builds wherever nvcc is (CI's machine too): that is checked on the CPU.
Running it needs a Hopper GPU: the output, the gate's projection, the conv tail and the
recurrent state after one step, in place and to another slot, as the in-projection with
its conv epilogue (`kernels.skinny`) and the step kernel (`kernels.gdn_decode`) give them."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kernels import gdn_fused

HK, HV, D, K = 8, 16, 128, gdn_fused.HIDDEN
C = 2 * HK * D + HV * D
N = C + HV * D + 2 * HV


@pytest.mark.skipif(gdn_fused.nvcc() is None, reason="needs nvcc")
def test_the_library_builds_for_hopper_once(tmp_path):
    lib = gdn_fused.build(tmp_path)
    assert gdn_fused.build(tmp_path) == lib  # cached: the same source is not built twice
    loaded = gdn_fused.load(lib)  # its entry points exported, its Params laid out as ours
    assert loaded.ninfer_gdn_in_step_params_size() == ctypes.sizeof(gdn_fused._Params)


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale)

    t = dict(
        x=rand(1, 1, K, scale=2.0).bfloat16(),
        norm_weight=rand(K, scale=0.1).bfloat16(),
        w=rand(N, K, scale=K ** -0.5).bfloat16(),
        conv_weight=rand(C, 4, scale=0.5).bfloat16(),
        conv_pool=rand(6, C, 3).bfloat16(),
        rec_pool=rand(6, HV, D, D, scale=0.1),
        A_log=rand(HV, scale=0.5).bfloat16(),
        dt_bias=rand(HV, scale=0.5).bfloat16(),
    )
    return {k: v.cuda() for k, v in t.items()}


def _chain(t, slots, dests):
    """The Triton chain: in-projection with the conv, then the step (pools updated)."""
    from kernels import skinny
    from kernels.gdn_decode import fused_recurrent_gated_delta_rule
    y = skinny.norm_linear(t["x"], t["norm_weight"], 1e-6, t["w"],
                           conv=(t["conv_pool"], slots, t["conv_weight"], dests))
    q, k, v = y[..., :HK * D], y[..., HK * D:2 * HK * D], y[..., 2 * HK * D:C]
    z = y[..., C:C + HV * D].view(1, 1, HV, D)
    b, a = y[..., C + HV * D:C + HV * D + HV], y[..., C + HV * D + HV:]
    o = fused_recurrent_gated_delta_rule(
        q.reshape(1, 1, HK, D), k.reshape(1, 1, HK, D), v.reshape(1, 1, HV, D), None, None,
        t["rec_pool"], state_indices=slots, use_qk_l2norm=True,
        gates=(a, b, t["A_log"], t["dt_bias"]), out_indices=dests)
    return o, z


needs_fused = pytest.mark.skipif(
    not (torch.cuda.is_available() and gdn_fused.available(torch.zeros(1, device="cuda"))),
    reason="needs a Hopper GPU and nvcc")


@needs_fused
@pytest.mark.parametrize("dest", [2, 4])  # in place, and to another slot
def test_one_step_matches_the_triton_chain(dest):
    t = _inputs(0)
    slots = torch.tensor([2], device="cuda")
    dests = torch.tensor([dest], device="cuda")
    ref = {k: v.clone() for k, v in t.items()}
    o_ref, z_ref = _chain(ref, slots, dests)
    assert gdn_fused.fits(t["x"], t["w"], t["conv_pool"], t["rec_pool"], slots, HK, HV, D, D)
    o, z = gdn_fused.in_step(t["x"], t["norm_weight"], 1e-6, t["w"], t["conv_weight"],
                             t["conv_pool"], slots, dests, t["rec_pool"], t["A_log"],
                             t["dt_bias"], HK, HV)
    torch.cuda.synchronize()
    # bf16 outputs: the same float32 sums in another order, then rounded
    torch.testing.assert_close(z, z_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o, o_ref, rtol=2e-2, atol=2e-2)
    assert (o.float() - o_ref.float()).abs().max() < 0.05 * o_ref.float().abs().max()
    # the conv tails: two entries shifted (exact), the new input (a bf16 rounding apart)
    torch.testing.assert_close(t["conv_pool"][dest], ref["conv_pool"][dest], rtol=2e-2,
                               atol=2e-2)
    assert torch.equal(t["conv_pool"][dest][:, :2], ref["conv_pool"][dest][:, :2])
    torch.testing.assert_close(t["rec_pool"][dest], ref["rec_pool"][dest], rtol=1e-2,
                               atol=1e-3)
    others = [s for s in range(6) if s != dest]
    assert torch.equal(t["rec_pool"][others], ref["rec_pool"][others])  # nothing else written
    assert torch.equal(t["conv_pool"][others], ref["conv_pool"][others])
    # the data tells a wrong head mapping apart: another head's output is far off
    error = (o.float() - o_ref.float()).abs().max()
    assert (o[0, 0, 1:].float() - o_ref[0, 0, :-1].float()).abs().max() > 20 * error


@needs_fused
def test_a_padding_lane_writes_nothing():
    t = _inputs(1)
    before = {k: v.clone() for k, v in t.items()}
    slots = torch.tensor([-1], device="cuda")
    gdn_fused.in_step(t["x"], t["norm_weight"], 1e-6, t["w"], t["conv_weight"], t["conv_pool"],
                      slots, slots, t["rec_pool"], t["A_log"], t["dt_bias"], HK, HV)
    torch.cuda.synchronize()
    assert torch.equal(t["rec_pool"], before["rec_pool"])
    assert torch.equal(t["conv_pool"], before["conv_pool"])
