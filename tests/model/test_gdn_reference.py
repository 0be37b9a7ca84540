"""The chunked gated delta rule equals the token-by-token one; the conv update equals a
plain causal conv over the whole sequence."""

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn_reference import (
    causal_conv1d_update,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)


def _inputs(seed, B, T, Hk, Hv, Dk, Dv, dtype=torch.float64, strong_decay=False):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = rand(B, T, Hk, Dk), rand(B, T, Hk, Dk)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = rand(B, T, Hv, Dv)
    # g <= 0; strong decay drives exp(cumsum) far below float underflow within a chunk
    g = -F.softplus(rand(B, T, Hv)) * (30.0 if strong_decay else 1.0)
    beta = torch.sigmoid(rand(B, T, Hv))
    state = rand(B, Hv, Dk, Dv)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seed,B,T,Hk,Hv,Dk,Dv", [
    (0, 1, 1, 1, 1, 4, 4),
    (1, 2, 37, 2, 4, 8, 16),
    (2, 1, 64, 1, 3, 16, 8),
    (3, 3, 100, 2, 2, 5, 7),
])
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent_float64(seed, B, T, Hk, Hv, Dk, Dv, chunk_size, with_state):
    q, k, v, g, beta, state = _inputs(seed, B, T, Hk, Hv, Dk, Dv)
    init = state if with_state else None
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=init)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init, chunk_size=chunk_size)
    assert o.dtype == s.dtype == torch.float64
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-10)


def test_strong_decay_stays_finite_and_exact():
    q, k, v, g, beta, state = _inputs(7, 2, 50, 1, 2, 8, 8, strong_decay=True)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, chunk_size=32)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-10)


def test_splitting_the_sequence_threads_the_state():
    q, k, v, g, beta, state = _inputs(11, 2, 30, 2, 4, 8, 8)
    o_all, s_all = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, chunk_size=8)
    cut = 13
    first = [x[:, :cut] for x in (q, k, v, g, beta)]
    rest = [x[:, cut:] for x in (q, k, v, g, beta)]
    o1, s1 = chunk_gated_delta_rule(*first, initial_state=state, chunk_size=8)
    o2, s2 = recurrent_gated_delta_rule(*rest, initial_state=s1)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_all, rtol=0, atol=1e-10)
    torch.testing.assert_close(s2, s_all, rtol=0, atol=1e-10)


def test_all_states_are_the_states_after_each_position():
    q, k, v, g, beta, state = _inputs(5, 2, 6, 1, 2, 4, 4)
    o, states = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, all_states=True)
    assert states.shape == (2, 6, 2, 4, 4)
    for t in range(6):
        prefix = [x[:, : t + 1] for x in (q, k, v, g, beta)]
        _, s_t = recurrent_gated_delta_rule(*prefix, initial_state=state)
        torch.testing.assert_close(states[:, t], s_t, rtol=0, atol=0)


def test_inputs_are_not_modified_and_bf16_returns_float32_state():
    q, k, v, g, beta, state = _inputs(3, 1, 9, 1, 1, 4, 4, dtype=torch.bfloat16)
    before = state.clone()
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, chunk_size=4)
    assert torch.equal(state, before)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_shape_errors_are_reported():
    q, k, v, g, beta, state = _inputs(3, 1, 4, 2, 3, 4, 4)
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta, state = _inputs(3, 1, 4, 1, 2, 4, 4)
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state[:, :1])


@pytest.mark.parametrize("K", [2, 4])
def test_conv_update_in_pieces_equals_full_causal_conv(K):
    gen = torch.Generator().manual_seed(K)
    B, C, T = 2, 6, 11
    x = torch.randn(B, C, T, generator=gen, dtype=torch.float64)
    w = torch.randn(C, K, generator=gen, dtype=torch.float64)
    full = F.silu(F.conv1d(F.pad(x, (K - 1, 0)), w.unsqueeze(1), groups=C))
    tail = x.new_zeros(B, C, K - 1)
    pieces = []
    for a, b in [(0, 4), (4, 5), (5, 11)]:
        y, tail = causal_conv1d_update(x[..., a:b], tail, w)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, dim=-1), full, rtol=0, atol=1e-12)
    torch.testing.assert_close(tail, x[..., T - (K - 1):], rtol=0, atol=0)


def test_conv_all_states_are_tails_after_each_position():
    gen = torch.Generator().manual_seed(0)
    B, C, T, K = 2, 3, 5, 4
    x = torch.randn(B, C, T, generator=gen)
    w = torch.randn(C, K, generator=gen)
    start = torch.randn(B, C, K - 1, generator=gen)
    y, tails = causal_conv1d_update(x, start, w, all_states=True)
    assert tails.shape == (B, T, C, K - 1)
    for t in range(T):
        _, tail_t = causal_conv1d_update(x[..., : t + 1], start, w)
        torch.testing.assert_close(tails[:, t], tail_t, rtol=0, atol=0)
