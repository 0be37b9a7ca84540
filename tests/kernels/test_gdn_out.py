"""The GDN decode step and out_proj in one launch (`kernels.gdn_out`) against the two
kernels' torch chain: the projection's sum in fixed point, the new state at its
destination slot, nothing else written. Small shapes in the interpreter on a machine
without a GPU; anchor-1b's on a GPU."""

import pytest
import torch

from kernels.gdn_out import SCALE, gdn_step_out, gdn_step_out_reference, pending_value

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


def _inputs(seed, Hk, Hv, D, N, dtype, slots=3):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype).to(DEV)

    proj = rand(1, 1, 2 * Hk * D + 2 * Hv * D + 2 * Hv)  # [q | k | v | z | b | a]
    C, vd = 2 * Hk * D + Hv * D, Hv * D
    qkv, z = proj[..., :C], proj[..., C:C + vd].view(1, 1, Hv, D)
    b, a = proj[..., C + vd:C + vd + Hv], proj[..., C + vd + Hv:]
    A_log, dt_bias = rand(Hv, std=0.5), rand(Hv, std=0.5)
    norm_weight, w_out = rand(D, std=0.5) + 1, rand(N, Hv * D, std=D ** -0.5)
    state = (torch.randn(slots, Hv, D, D, generator=gen) * 0.3).to(DEV)
    return qkv, z, a, b, A_log, dt_bias, norm_weight, w_out, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, BN", [(32, None), (64, 16)])  # one column block, or four
def test_the_sum_and_the_new_state_are_the_two_kernels(dtype, N, BN):
    Hk, Hv, D = 2, 4, 16
    qkv, z, a, b, A_log, dt_bias, nw, w_out, state = _inputs(0, Hk, Hv, D, N, dtype)
    before = state.clone()
    slot, dest = torch.tensor([2], device=DEV), torch.tensor([0], device=DEV)
    earlier = torch.randint(-2 ** 34, 2 ** 34, (N,), generator=torch.Generator().manual_seed(1))
    acc = earlier.clone().to(DEV)
    gdn_step_out(qkv, z, a, b, A_log, dt_bias, nw, 1e-6, w_out, state, slot, dest, acc, BN=BN)
    want, new = gdn_step_out_reference(qkv, z, a, b, A_log, dt_bias, nw, 1e-6, w_out, before,
                                       slot)
    got = (acc.cpu() - earlier).double() / SCALE  # what this call added, exactly
    assert want.abs().max() > 0.3  # a sum that a wrong head or a dropped norm would change
    assert torch.allclose(got.float(), want.cpu(), **TOL[dtype])
    assert torch.allclose(state[0].cpu(), new.cpu(), rtol=1e-5, atol=1e-5)  # at dest
    assert torch.equal(state[1:].cpu(), before[1:].cpu())  # the input slot kept, others too
    assert not torch.allclose(new.cpu(), before[2].cpu(), atol=1e-3)  # the step moved it
    # what the kernel after reads: the sum rounded to the activations' dtype
    assert pending_value(acc - earlier.to(DEV), dtype).dtype == dtype


def test_a_padding_lane_writes_no_state():
    Hk, Hv, D, N = 2, 4, 16, 32
    qkv, z, a, b, A_log, dt_bias, nw, w_out, state = _inputs(2, Hk, Hv, D, N, torch.float32)
    before = state.clone()
    acc = torch.zeros(N, dtype=torch.int64, device=DEV)
    minus = torch.tensor([-1], device=DEV)
    gdn_step_out(qkv, z, a, b, A_log, dt_bias, nw, 1e-6, w_out, state, minus, minus, acc)
    assert torch.equal(state, before)
    want, _ = gdn_step_out_reference(qkv, z, a, b, A_log, dt_bias, nw, 1e-6, w_out, state, minus)
    assert torch.allclose(acc.cpu().double() / SCALE, want.cpu().double(), atol=1e-5)


def test_shapes_it_cannot_take_are_refused():
    Hk, Hv, D, N = 2, 4, 16, 32
    qkv, z, a, b, A_log, dt_bias, nw, w_out, state = _inputs(3, Hk, Hv, D, N, torch.float32)
    slot = torch.tensor([0], device=DEV)
    with pytest.raises(ValueError, match="one lane"):  # a float accumulator
        gdn_step_out(qkv, z, a, b, A_log, dt_bias, nw, 1e-6, w_out, state, slot, slot,
                     torch.zeros(N, device=DEV))
    with pytest.raises(ValueError, match="one lane"):  # two lanes
        gdn_step_out(qkv, z, a, b, A_log, dt_bias, nw, 1e-6, w_out, state,
                     torch.tensor([0, 1], device=DEV), slot,
                     torch.zeros(N, dtype=torch.int64, device=DEV))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_anchor_1b_shapes_on_the_gpu_match_and_repeat_exactly():
    """anchor-1b's GDN layer (8 key / 16 value heads of 128, hidden 1024), bf16: the sum
    matches the chain's, and two runs add exactly the same integers (no float atomics)."""
    Hk, Hv, D, N = 8, 16, 128, 1024
    qkv, z, a, b, A_log, dt_bias, nw, w_out, state = _inputs(4, Hk, Hv, D, N, torch.bfloat16,
                                                             slots=4)
    before = state.clone()
    slot, dest = torch.tensor([1], device=DEV), torch.tensor([3], device=DEV)
    runs = []
    for _ in range(2):
        acc = torch.zeros(N, dtype=torch.int64, device=DEV)
        gdn_step_out(qkv, z, a, b, A_log, dt_bias, nw, 1e-6, w_out, state, slot, dest, acc)
        runs.append(acc.clone())
    assert torch.equal(runs[0], runs[1])
    want, new = gdn_step_out_reference(qkv, z, a, b, A_log, dt_bias, nw, 1e-6, w_out, before,
                                       slot)
    assert torch.allclose(runs[0].double() / SCALE, want.double(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(state[3], new, rtol=1e-4, atol=1e-4)
    assert torch.equal(state[:3], before[:3])
