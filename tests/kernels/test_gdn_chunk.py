"""The Triton chunked gated delta rule (`kernels.gdn_chunk`) equals the torch reference.

On a CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
so those shapes are small; the CUDA-only tests run the real shapes. Ground truth is the
token-by-token reference in float64 on the same (already rounded) inputs. Errors are
measured as max |x - ref| / max |ref|, per dtype (TOL): float32 keeps float32 matmul
operands; bfloat16 / float16 round them to the input dtype, and the output is stored in it.
"""

import dataclasses
import os
import time

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn_chunk import DEFAULT_CONFIG, chunk_gated_delta_rule
from kernels.gdn_reference import chunk_gated_delta_rule as reference_chunk
from kernels.gdn_reference import recurrent_gated_delta_rule

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter")

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# g = -softplus(x) * factor: weak keeps most of a chunk, strong underflows within a chunk
DECAY = {"weak": 0.05, "normal": 1.0, "strong": 30.0}


def _inputs(seed, B, T, Hk, Hv, Dk, Dv, dtype, decay="normal", device=DEVICE):
    """q, k L2-normalised [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; a state
    [B, Hv, Dk, Dv] float32; all in `dtype` except the state."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = F.normalize(rand(B, T, Hk, Dk), dim=-1)
    k = F.normalize(rand(B, T, Hk, Dk), dim=-1)
    v = rand(B, T, Hv, Dv)
    g = -F.softplus(rand(B, T, Hv)) * DECAY[decay]
    beta = torch.sigmoid(rand(B, T, Hv))
    state = rand(B, Hv, Dk, Dv)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta)], state.to(device)


def _truth(inputs, state):
    """The token-by-token rule in float64 on the given (rounded) inputs."""
    wide = [x.double() for x in inputs]
    return recurrent_gated_delta_rule(
        *wide, initial_state=None if state is None else state.double())


def _err(x, ref):
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _check(o, s, o_ref, s_ref, dtype):
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert _err(o, o_ref) < TOL[dtype], f"output error {_err(o, o_ref):.2e}"
    assert _err(s, s_ref) < TOL[dtype], f"state error {_err(s, s_ref):.2e}"


@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv,dtype,with_state,decay", [
    (1, 1, 1, 2, 16, 16, torch.float32, True, "weak"),
    (1, 5, 2, 4, 32, 32, torch.bfloat16, False, "normal"),
    (1, 64, 1, 2, 32, 16, torch.float32, True, "strong"),
    (2, 37, 1, 2, 16, 16, torch.float32, True, "normal"),
    (1, 100, 2, 4, 16, 32, torch.bfloat16, True, "weak"),
    (1, 130, 1, 2, 16, 16, torch.float32, False, "normal"),
    (1, 130, 1, 2, 32, 32, torch.bfloat16, True, "strong"),
    (1, 64, 1, 2, 16, 16, torch.float16, True, "normal"),
    (1, 70, 1, 2, 24, 20, torch.float32, True, "weak"),  # head dims padded to 32
])
def test_matches_reference(B, T, Hk, Hv, Dk, Dv, dtype, with_state, decay):
    inputs, state = _inputs(T + Hv, B, T, Hk, Hv, Dk, Dv, dtype, decay)
    init = state if with_state else None
    o, s = chunk_gated_delta_rule(*inputs, initial_state=init)
    assert o.shape == (B, T, Hv, Dv) and o.dtype == dtype
    assert s.shape == (B, Hv, Dk, Dv) and s.dtype == torch.float32
    _check(o, s, *_truth(inputs, init), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_sequences_in_one_launch(dtype):
    lengths = [1, 70, 33]
    cu = torch.tensor([0, 1, 71, 104], dtype=torch.int32, device=DEVICE)
    inputs, _ = _inputs(3, 1, sum(lengths), 1, 2, 16, 16, dtype)
    states = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    o, s = chunk_gated_delta_rule(*inputs, initial_state=states, cu_seqlens=cu)
    assert o.shape == (1, 104, 2, 16) and s.shape == (3, 2, 16, 16)
    for n in range(3):
        a, b = cu[n].item(), cu[n + 1].item()
        o_ref, s_ref = _truth([x[:, a:b] for x in inputs], states[n:n + 1])
        _check(o[:, a:b], s[n:n + 1], o_ref, s_ref, dtype)


@pytest.mark.parametrize("decay", ["weak", "strong"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_first_stage_equals_the_fused_one(dtype, decay):
    """`wy_split` builds A by blocks from 16-row key tiles (here over two Dk tiles), writes
    X and reads it back for W and U: the same answer as the fused stage 1, for whole
    chunks, a ragged last one and packed sequences (whose unused chunk slots write
    nothing)."""
    split = dataclasses.replace(DEFAULT_CONFIG, wy_split=True, solve_block_k=16,
                                corrections_from_x=False)
    inputs, state = _inputs(11, 1, 150, 2, 4, 32, 32, dtype, decay)
    o, s = chunk_gated_delta_rule(*inputs, initial_state=state, config=split)
    o_one, s_one = chunk_gated_delta_rule(*inputs, initial_state=state,
                                          config=dataclasses.replace(split, wy_split=False))
    _check(o, s, *_truth(inputs, state), dtype)
    # float32: the same sums in another order; bfloat16: X rounded the same way, so within
    # an output rounding
    same = 1e-5 if dtype == torch.float32 else 1e-2
    assert _err(o, o_one) < same and _err(s, s_one) < same
    cu = torch.tensor([0, 64, 65, 150], dtype=torch.int32, device=DEVICE)
    states = state.expand(3, -1, -1, -1).contiguous()
    o, s = chunk_gated_delta_rule(*inputs, initial_state=states, cu_seqlens=cu, config=split)
    o_one, s_one = chunk_gated_delta_rule(*inputs, initial_state=states, cu_seqlens=cu,
                                          config=dataclasses.replace(split, wy_split=False))
    assert _err(o, o_one) < same and _err(s, s_one) < same
    for n in range(3):
        a, b = cu[n].item(), cu[n + 1].item()
        _check(o[:, a:b], s[n:n + 1], *_truth([x[:, a:b] for x in inputs], states[n:n + 1]),
               dtype)


@pytest.mark.parametrize("decay", ["weak", "strong"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_corrections_made_in_the_state_loop_equal_those_from_w_and_u(dtype, decay):
    """`corrections_from_x` makes V' = X beta (V - exp(G) K S) in stage 2 from the solve's
    X instead of U - W S from stage 1's W and U: the same answer (float32: the same sums in
    another order; bfloat16: other roundings, within the output's), for whole chunks, a
    ragged last one, and packed sequences with their own initial states."""
    base = dataclasses.replace(DEFAULT_CONFIG, solve_block_k=16)
    from_x = dataclasses.replace(base, corrections_from_x=True)
    w_u = dataclasses.replace(base, corrections_from_x=False)
    inputs, state = _inputs(12, 1, 150, 2, 4, 32, 32, dtype, decay)
    o, s = chunk_gated_delta_rule(*inputs, initial_state=state, config=from_x)
    o_wu, s_wu = chunk_gated_delta_rule(*inputs, initial_state=state, config=w_u)
    _check(o, s, *_truth(inputs, state), dtype)
    same = 1e-5 if dtype == torch.float32 else 1e-2
    assert _err(o, o_wu) < same and _err(s, s_wu) < same
    cu = torch.tensor([0, 63, 64, 150], dtype=torch.int32, device=DEVICE)
    states = torch.randn(3, 4, 32, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    o, s = chunk_gated_delta_rule(*inputs, initial_state=states, cu_seqlens=cu, config=from_x)
    o_wu, s_wu = chunk_gated_delta_rule(*inputs, initial_state=states, cu_seqlens=cu,
                                        config=w_u)
    assert _err(o, o_wu) < same and _err(s, s_wu) < same
    for n in range(3):
        a, b = cu[n].item(), cu[n + 1].item()
        _check(o[:, a:b], s[n:n + 1], *_truth([x[:, a:b] for x in inputs], states[n:n + 1]),
               dtype)


def test_varlen_int64_offsets_empty_sequence_and_zero_state():
    # a chunk-aligned sequence, an empty one (its final state is its initial state), one
    # just past a chunk boundary; no initial state means zeros
    cu = torch.tensor([0, 64, 64, 129], dtype=torch.int64, device=DEVICE)
    inputs, _ = _inputs(5, 1, 129, 1, 2, 16, 16, torch.float32)
    o, s = chunk_gated_delta_rule(*inputs, cu_seqlens=cu)
    assert (s[1] == 0).all()
    for n in (0, 2):
        a, b = cu[n].item(), cu[n + 1].item()
        o_ref, s_ref = _truth([x[:, a:b] for x in inputs], None)
        _check(o[:, a:b], s[n:n + 1], o_ref, s_ref, torch.float32)


def test_grouped_heads_read_key_head_h_over_r():
    # Hv = 4 value heads over Hk = 2 key heads: value head h reads key head h // 2
    inputs, state = _inputs(6, 1, 70, 2, 4, 16, 16, torch.float32)
    o, s = chunk_gated_delta_rule(*inputs, initial_state=state)
    _check(o, s, *_truth(inputs, state), torch.float32)
    # the test would catch the other plausible mapping, h % Hk
    q, k, v, g, beta = inputs
    wrong = [q[:, :, [0, 1, 0, 1]], k[:, :, [0, 1, 0, 1]], v, g, beta]
    o_wrong, _ = _truth(wrong, state)
    assert _err(o, o_wrong) > 100 * TOL[torch.float32]


def test_model_dtypes_strided_inputs_scale_and_no_final_state():
    # as ninfer.model.gdn calls it: q, k (and g, beta) float32, v bfloat16; v a strided view
    (q, k, v, g, beta), state = _inputs(7, 1, 70, 1, 2, 16, 16, torch.float32)
    v = torch.cat([v, v], dim=-1).to(torch.bfloat16)[..., 16:]  # last axis contiguous
    g_t = g.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, Hv] with stride(1) == 1
    inputs = [q, k, v, g_t, beta]
    before = [x.clone() for x in inputs] + [state.clone()]
    o, s = chunk_gated_delta_rule(*inputs, initial_state=state, scale=0.5,
                                  output_final_state=False)
    assert s is None and o.dtype == torch.bfloat16
    for x, x0 in zip(inputs + [state], before, strict=True):
        assert torch.equal(x, x0)
    wide = [x.double() for x in inputs]
    o_ref, _ = recurrent_gated_delta_rule(*wide, initial_state=state.double(), scale=0.5)
    assert _err(o, o_ref) < TOL[torch.bfloat16]


def test_rejects_bad_shapes():
    inputs, state = _inputs(8, 2, 5, 1, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(*inputs, initial_state=state[:1])
    with pytest.raises(ValueError, match="B == 1"):
        chunk_gated_delta_rule(*inputs, cu_seqlens=torch.tensor([0, 5], device=DEVICE))
    q, k, v, g, beta = inputs  # Hk = 1, Hv = 2: repeat the key heads to make Hk = 2
    q2, k2 = q.repeat(1, 1, 2, 1), k.repeat(1, 1, 2, 1)
    three = [v[:, :, [0, 1, 0]], g[..., [0, 1, 0]], beta[..., [0, 1, 0]]]
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(q2, k2, *three)
    with pytest.raises(TypeError, match="float32"):
        chunk_gated_delta_rule(q.double(), k, v, g, beta)


# -- on a GPU, the real shapes (Qwen3-Next / Qwen3.5 GDN layers) -----------------------

def _real_inputs(T, seed=0):
    return _inputs(seed, 1, T, 16, 32, 128, 128, torch.bfloat16, "normal", device="cuda")


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_real_shapes_match_reference_chunk_float32():
    inputs, state = _real_inputs(4096)
    state = state[:1]
    o, s = chunk_gated_delta_rule(*inputs, initial_state=state)
    wide = [x.float() for x in inputs]
    o_ref, s_ref = reference_chunk(*wide, initial_state=state)
    _check(o, s, o_ref, s_ref, torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_gpu_varlen_real_shapes_match_reference_chunk_float32():
    lengths = [1, 1000, 63, 3032]
    cu = torch.tensor([0, 1, 1001, 1064, 4096], dtype=torch.int32, device="cuda")
    inputs, _ = _real_inputs(sum(lengths), seed=1)
    states = torch.randn(4, 32, 128, 128, device="cuda")
    o, s = chunk_gated_delta_rule(*inputs, initial_state=states, cu_seqlens=cu)
    for n in range(len(lengths)):
        a, b = cu[n].item(), cu[n + 1].item()
        wide = [x[:, a:b].float() for x in inputs]
        o_ref, s_ref = reference_chunk(*wide, initial_state=states[n:n + 1])
        _check(o[:, a:b], s[n:n + 1], o_ref, s_ref, torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("T", [4096, 16384])
def test_gpu_timing_report(T):
    """Prints the mean time per call (run with -s); the target is fla-core 0.6's
    chunk_gated_delta_rule on an H200 (0.67 ms at 4096, 1.10 ms at 16384)."""
    inputs, _ = _real_inputs(T)
    for _ in range(3):  # compile and warm up
        o, s = chunk_gated_delta_rule(*inputs)
    torch.cuda.synchronize()
    n = 20
    start = time.perf_counter()
    for _ in range(n):
        o, s = chunk_gated_delta_rule(*inputs)
    torch.cuda.synchronize()
    print(f"\nchunk_gated_delta_rule T={T} Hk=16 Hv=32 D=128 bf16: "
          f"{(time.perf_counter() - start) / n * 1e3:.3f} ms")
    assert torch.isfinite(o).all() and torch.isfinite(s).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_state_programs_tile_of_16_equals_one_of_32(dtype):
    """The state kernel's Dv tile only splits the value columns between programs: a tile of
    16 (two programs a head here) gives what one of 32 gives, to the bit."""
    inputs, state = _inputs(13, 1, 150, 2, 4, 32, 32, dtype, "weak")
    o16, s16 = chunk_gated_delta_rule(*inputs, initial_state=state,
                                      config=dataclasses.replace(DEFAULT_CONFIG,
                                                                 state_block_v=16))
    o32, s32 = chunk_gated_delta_rule(*inputs, initial_state=state,
                                      config=dataclasses.replace(DEFAULT_CONFIG,
                                                                 state_block_v=32))
    assert torch.equal(o16, o32) and torch.equal(s16, s32)
    _check(o16, s16, *_truth(inputs, state), dtype)
