"""The decode-path Triton kernels against their torch references.

Small shapes run everywhere (on a machine without a GPU, tests/conftest.py selects the
Triton interpreter); the real-shape tests at the end need CUDA. Every comparison is paired
with a check that the data tells a plausible mistake apart (a wrong head mapping, an
ignored tail, a block table read in order), so a passing comparison means something.
"""


import pytest
import torch
import torch.nn.functional as F

from kernels.conv1d import causal_conv1d_update
from kernels.gdn_decode import fused_recurrent_gated_delta_rule
from kernels.gdn_reference import causal_conv1d_update as conv_reference
from kernels.gdn_reference import recurrent_gated_delta_rule
from kernels.paged_attention import paged_attention_decode, paged_attention_reference
from ninfer.flags import override

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# outputs: float32 differs only by summation order; bfloat16 by the final rounding (2^-8
# relative) of values that agree in float32 before it
OUT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
# recurrent states stay float32 whatever the inputs' dtype
STATE_TOL = dict(rtol=1e-5, atol=1e-5)
DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _far(a, b, tol):
    """a and b differ by much more than the tolerance: a check on them could fail."""
    return (a.double() - b.double()).abs().max().item() > 20 * tol["atol"]


# --- gated delta rule -------------------------------------------------------------------

def _gdn_inputs(seed, B, T, Hk, Hv, Dk, Dv, dtype, normalize=True):
    gen = _gen(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = rand(B, T, Hk, Dk), rand(B, T, Hk, Dk)
    if normalize:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = rand(B, T, Hv, Dv)
    g = -F.softplus(rand(B, T, Hv))  # log-decay <= 0
    beta = torch.sigmoid(rand(B, T, Hv))
    return [x.to(dtype).to(DEV) for x in (q, k, v, g, beta)]


def _slot_pool(seed, num_slots, shape, dtype=torch.float32):
    """A pool that is a strided view (every other slot of a larger buffer), and that buffer."""
    buffer = torch.randn(2 * num_slots, *shape, generator=_gen(seed)).to(dtype).to(DEV)
    return buffer[1::2], buffer


def _wrong_heads(q, k, Hv):
    """q, k with each value head given key head h % Hk instead of h // r."""
    r = Hv // k.shape[2]
    return (x.repeat(1, 1, r, 1) for x in (q, k))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4])
def test_gdn_slots_in_place(dtype, T):
    B, Hk, Hv, Dk, Dv = 3, 2, 4, 16, 32
    q, k, v, g, beta = _gdn_inputs(0, B, T, Hk, Hv, Dk, Dv, dtype)
    pool, buffer = _slot_pool(1, 6, (Hv, Dk, Dv))
    before = buffer.clone()
    idx = torch.tensor([4, 0, 2], device=DEV)  # permuted, with gaps
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool[idx])

    o = fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, state_indices=idx, BV=16)
    assert o.dtype == dtype and o.shape == (B, T, Hv, Dv)
    torch.testing.assert_close(o, o_ref, **OUT_TOL[dtype])
    torch.testing.assert_close(pool[idx], s_ref, **STATE_TOL)
    untouched = torch.ones(2 * 6, dtype=torch.bool)
    untouched[1 + 2 * idx.cpu()] = False
    assert torch.equal(buffer[untouched.to(DEV)], before[untouched.to(DEV)])

    # the comparisons above can fail: other slots, or a wrong head mapping, give other results
    assert _far(pool[idx], before[1::2][idx], STATE_TOL)
    wq, wk = _wrong_heads(q, k, Hv)
    o_wrong, _ = recurrent_gated_delta_rule(wq, wk, v, g, beta, initial_state=before[1::2][idx])
    assert _far(o, o_wrong, OUT_TOL[dtype])


def test_gdn_step_to_destination_slots_leaves_its_inputs():
    """A step run ahead of the engine writes the new states to other slots (out_indices):
    its input slots keep the old states, the destinations get what the in-place step would
    have written, and every other slot is untouched."""
    B, T, Hk, Hv, Dk, Dv = 2, 1, 2, 4, 16, 32
    q, k, v, g, beta = _gdn_inputs(10, B, T, Hk, Hv, Dk, Dv, torch.float32)
    pool, buffer = _slot_pool(11, 6, (Hv, Dk, Dv))
    before = buffer.clone()
    idx, dests = torch.tensor([4, 1], device=DEV), torch.tensor([0, 5], device=DEV)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool[idx])
    o = fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, state_indices=idx,
                                         out_indices=dests, BV=16)
    torch.testing.assert_close(o, o_ref, **OUT_TOL[torch.float32])
    torch.testing.assert_close(pool[dests], s_ref, **STATE_TOL)
    assert torch.equal(pool[idx], before[1::2][idx])
    assert torch.equal(pool[[2, 3]], before[1::2][[2, 3]])
    assert _far(pool[dests], before[1::2][dests], STATE_TOL)
    with pytest.raises(ValueError, match="out_indices"):
        fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, state_indices=idx,
                                         out_indices=dests[:1])


def test_gdn_tile_setting_cuts_calls_that_name_no_tile(monkeypatch):
    """The flag `gdn_step_tile` (the engine bench's `gdn_tile_b1` row) sets the value tile
    of a call that gives neither BV nor warps, and the result is the same."""
    from kernels import gdn_decode
    grids = []

    class Recording:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(gdn_decode, "_gdn_decode_kernel",
                        Recording(gdn_decode._gdn_decode_kernel))
    B, T, Hk, Hv, Dk, Dv = 1, 1, 2, 4, 16, 32
    q, k, v, g, beta = _gdn_inputs(20, B, T, Hk, Hv, Dk, Dv, torch.float32)
    pool, _ = _slot_pool(21, 2, (Hv, Dk, Dv))
    idx = torch.tensor([1], device=DEV)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool[idx])
    for tile, tiles_along_dv in ((None, 1), ((8, 1), 4)):
        state = pool.clone()
        with override(gdn_step_tile=tile):
            o = fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, state_indices=idx)
        assert grids[-1] == (tiles_along_dv, B * Hv)
        torch.testing.assert_close(o, o_ref, **OUT_TOL[torch.float32])
        torch.testing.assert_close(state[idx], s_ref, **STATE_TOL)
    fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool.clone(), state_indices=idx, BV=16)
    assert grids[-1] == (2, B * Hv)  # a tile named in the call wins over the setting


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [4, 31])  # a verify; a next turn's delta in one forward
def test_gdn_all_states_per_position(dtype, T):
    B, Hk, Hv, Dk, Dv = 2, 1, 2, 16, 32
    q, k, v, g, beta = _gdn_inputs(2, B, T, Hk, Hv, Dk, Dv, dtype)
    pool, buffer = _slot_pool(3, 4, (Hv, Dk, Dv))
    before = buffer.clone()
    idx = torch.tensor([3, 1], dtype=torch.int32, device=DEV)
    o_ref, states_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool[idx],
                                                   all_states=True)
    out = torch.full((B, T, Hv, Dk, Dv), float("nan"), device=DEV)
    o, states = fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, pool, state_indices=idx, all_states=True, out_states=out, BV=16)
    assert states is out
    torch.testing.assert_close(o, o_ref, **OUT_TOL[dtype])
    for t in range(T):  # a rollback after accepting t + 1 positions picks states[:, t]
        torch.testing.assert_close(states[:, t], states_ref[:, t], **STATE_TOL)
    assert torch.equal(buffer, before)  # the input state is not modified
    assert _far(states[:, 0], states[:, 1], STATE_TOL)


def test_gdn_fused_l2norm_dense_state_and_padding_lane():
    B, T, Hk, Hv, Dk, Dv = 2, 2, 2, 4, 16, 16
    q, k, v, g, beta = _gdn_inputs(4, B, T, Hk, Hv, Dk, Dv, torch.float32, normalize=False)
    state = torch.randn(B, Hv, Dk, Dv, generator=_gen(5)).to(DEV)
    before = state.clone()

    def norm(x):
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    o_ref, s_ref = recurrent_gated_delta_rule(norm(q), norm(k), v, g, beta, initial_state=state)
    o = fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, use_qk_l2norm=True)
    torch.testing.assert_close(o, o_ref, **OUT_TOL[torch.float32])
    torch.testing.assert_close(state, s_ref, **STATE_TOL)
    o_raw, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=before)
    assert _far(o, o_raw, OUT_TOL[torch.float32])

    # a negative slot is a padding lane: it starts from zeros and writes nothing
    pool = before.clone()
    o = fused_recurrent_gated_delta_rule(norm(q), norm(k), v, g, beta, pool,
                                         state_indices=torch.tensor([-1, 0], device=DEV))
    o_zero, _ = recurrent_gated_delta_rule(norm(q), norm(k), v, g, beta)
    o_one, s_one = recurrent_gated_delta_rule(*(norm(x[1:]) for x in (q, k)), v[1:], g[1:],
                                              beta[1:], initial_state=before[:1])
    torch.testing.assert_close(o[:1], o_zero[:1], **OUT_TOL[torch.float32])
    torch.testing.assert_close(o[1:], o_one, **OUT_TOL[torch.float32])
    torch.testing.assert_close(pool[:1], s_one, **STATE_TOL)
    assert torch.equal(pool[1], before[1])


# --- causal conv --------------------------------------------------------------------------

def _conv_inputs(seed, B, C, T, K, dtype):
    gen = _gen(seed)
    x = torch.randn(B, T, C, generator=gen).transpose(1, 2)  # [B, C, T] over [B, T, C] memory
    weight, bias = torch.randn(C, K, generator=gen), torch.randn(C, generator=gen)
    return [t.to(dtype).to(DEV) for t in (x, weight, bias)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4])
def test_conv_slots_in_place(dtype, T):
    B, C, K = 3, 40, 4
    x, weight, bias = _conv_inputs(6, B, C, T, K, dtype)
    pool, buffer = _slot_pool(7, 5, (C, K - 1), dtype)
    before = buffer.clone()
    idx = torch.tensor([3, 0, 4], device=DEV)
    y_ref, tail_ref = conv_reference(x, pool[idx], weight, bias)

    y, tail = causal_conv1d_update(x, pool, weight, bias, state_indices=idx, BC=16)
    assert y.dtype == dtype and y.stride() == x.stride()
    torch.testing.assert_close(y, y_ref, **OUT_TOL[dtype])
    assert torch.equal(tail, tail_ref)  # tails are copies of inputs: exact
    assert torch.equal(pool[idx], tail_ref)
    untouched = torch.ones(2 * 5, dtype=torch.bool)
    untouched[1 + 2 * idx.cpu()] = False
    assert torch.equal(buffer[untouched.to(DEV)], before[untouched.to(DEV)])

    y_no_tail, _ = conv_reference(x, torch.zeros_like(pool[idx]), weight, bias)
    assert _far(y, y_no_tail, OUT_TOL[dtype])  # the old tail matters to the check
    assert not torch.equal(pool[idx], before[1::2][idx])


@pytest.mark.parametrize("T", [65, 150])
def test_conv_long_input_in_time_tiles(T):
    """Past TILE_T positions (a prefill chunk) the kernel cuts T into tiles: the reference's
    outputs; the first tile's program reads the old tail (it matters) and writes the new
    one in place, into a state, into destination slots of a pool (the input slots and the
    others untouched), and every position's tail with all_states."""
    from kernels.conv1d import TILE_T
    assert T > TILE_T
    B, C, K = 2, 40, 4
    x, weight, bias = _conv_inputs(13, B, C, T, K, torch.float32)
    state = torch.randn(B, C, K - 1, generator=_gen(14)).to(DEV)
    y_ref, tail_ref = conv_reference(x, state, weight, bias)
    y, tail = causal_conv1d_update(x, state, weight, bias)
    torch.testing.assert_close(y, y_ref, **OUT_TOL[torch.float32])
    assert torch.equal(tail, tail_ref) and torch.equal(state, tail_ref)
    y_no_tail, _ = conv_reference(x, torch.zeros_like(state), weight, bias)
    assert _far(y, y_no_tail, OUT_TOL[torch.float32])

    pool, buffer = _slot_pool(15, 5, (C, K - 1), torch.float32)
    before = buffer.clone()
    idx, dests = torch.tensor([3, 0], device=DEV), torch.tensor([1, 4], device=DEV)
    y_ref, tail_ref = conv_reference(x, pool[idx], weight, bias)
    y, tail = causal_conv1d_update(x, pool, weight, bias, state_indices=idx,
                                   out_indices=dests)
    torch.testing.assert_close(y, y_ref, **OUT_TOL[torch.float32])
    assert torch.equal(pool[dests], tail_ref)
    assert torch.equal(pool[idx], before[1::2][idx])
    assert torch.equal(pool[2], before[1::2][2])

    y_ref, tails_ref = conv_reference(x, pool[idx], weight, activation=None, all_states=True)
    y, tails = causal_conv1d_update(x, pool, weight, activation=None, state_indices=idx,
                                    all_states=True)
    torch.testing.assert_close(y, y_ref, **OUT_TOL[torch.float32])
    assert torch.equal(tails, tails_ref)


def test_conv_to_destination_slots_leaves_its_inputs():
    """out_indices: the new tails go to other slots; the input tails stay as they were."""
    B, C, K = 2, 40, 4
    x, weight, bias = _conv_inputs(12, B, C, 1, K, torch.float32)
    pool, buffer = _slot_pool(13, 5, (C, K - 1))
    before = buffer.clone()
    idx, dests = torch.tensor([3, 0], device=DEV), torch.tensor([1, 4], device=DEV)
    y_ref, tail_ref = conv_reference(x, pool[idx], weight, bias)
    y, tail = causal_conv1d_update(x, pool, weight, bias, state_indices=idx,
                                   out_indices=dests, BC=16)
    torch.testing.assert_close(y, y_ref, **OUT_TOL[torch.float32])
    assert torch.equal(pool[dests], tail_ref) and torch.equal(tail, tail_ref)
    assert torch.equal(pool[idx], before[1::2][idx])
    assert torch.equal(pool[2], before[1::2][2])
    assert not torch.equal(pool[dests], before[1::2][dests])
    with pytest.raises(ValueError, match="out_indices"):
        causal_conv1d_update(x, pool[:2], weight, out_indices=dests)


@pytest.mark.parametrize("T", [2, 4, 31])
def test_conv_all_states_and_padding_lane(T):
    B, C, K = 2, 24, 4
    x, weight, _ = _conv_inputs(8, B, C, T, K, torch.float32)
    pool, buffer = _slot_pool(9, 3, (C, K - 1))
    before = buffer.clone()
    idx = torch.tensor([2, 0], dtype=torch.int32, device=DEV)
    y_ref, tails_ref = conv_reference(x, pool[idx], weight, activation=None, all_states=True)
    y, tails = causal_conv1d_update(x, pool, weight, activation=None, state_indices=idx,
                                    all_states=True)
    assert tails.shape == (B, T, C, K - 1)
    torch.testing.assert_close(y, y_ref, **OUT_TOL[torch.float32])
    for t in range(T):
        assert torch.equal(tails[:, t], tails_ref[:, t])
    assert torch.equal(buffer, before)
    assert not torch.equal(tails[:, 0], tails[:, 1])

    # padding lane: its tail reads as zeros and is not written
    y, tail = causal_conv1d_update(x, pool, weight, activation=None,
                                   state_indices=torch.tensor([-1, 1], device=DEV))
    y_zero, _ = conv_reference(x[:1], torch.zeros_like(pool[:1]), weight, activation=None)
    y_one, tail_one = conv_reference(x[1:], before[1::2][1:2], weight, activation=None)
    torch.testing.assert_close(y[:1], y_zero, **OUT_TOL[torch.float32])
    torch.testing.assert_close(y[1:], y_one, **OUT_TOL[torch.float32])
    assert torch.equal(pool[1], tail_one[0])
    assert torch.equal(pool[[0, 2]], before[1::2][[0, 2]])


# --- paged attention ----------------------------------------------------------------------

def _paged_inputs(seed, B, T, Hq, Hkv, D, block_size, seq_lens, dtype, num_blocks=24):
    gen = _gen(seed)
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen)
    q = torch.randn(B, T, Hq, D, generator=gen)
    width = max(-(-n // block_size) for n in seq_lens) + 1  # one spare column, never read
    tables = torch.randperm(num_blocks, generator=gen)[:B * width].view(B, width)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    # every position no lane has written is NaN: a kernel must not even multiply it by 0
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for b, n in enumerate(seq_lens):
        written.view(-1)[(tables[b, :, None] * block_size + torch.arange(block_size)).view(-1)
                         [:n]] = True
    for cache in (k_cache, v_cache):
        cache[~written] = float("nan")
    return ([t.to(dtype).to(DEV) for t in (q, k_cache, v_cache)]
            + [tables.int().to(DEV), lens.to(DEV)])


def _sdpa_contiguous(q, k_cache, v_cache, tables, lens, causal_tail=True):
    """torch SDPA per lane on a contiguous copy of its KV, float32."""
    B, T, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    outs = []
    for b in range(B):
        L = int(lens[b])
        n = -(-L // bs)
        k = torch.cat([k_cache[int(tables[b, i])] for i in range(n)])[:L]  # [L, Hkv, D]
        v = torch.cat([v_cache[int(tables[b, i])] for i in range(n)])[:L]
        pos = torch.arange(L, device=q.device)
        last = L - T + torch.arange(T, device=q.device) if causal_tail else \
            torch.full((T,), L - 1, device=q.device)
        mask = pos[None, :] <= last[:, None]  # [T, L]
        o = F.scaled_dot_product_attention(
            q[b].transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
            attn_mask=mask, enable_gqa=Hq != Hkv)  # [Hq, T, D]
        outs.append(o.transpose(0, 1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4, 31])
def test_paged_attention_ragged_gqa(dtype, T):
    B, Hq, Hkv, D, bs = 3, 4, 2, 32, 16
    q, k_cache, v_cache, tables, lens = _paged_inputs(
        10, B, T, Hq, Hkv, D, bs, [T + 2, 70, 33], dtype)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, lens)
    torch.testing.assert_close(ref.float(), _sdpa_contiguous(q, k_cache, v_cache, tables, lens),
                               **OUT_TOL[dtype])
    tol = OUT_TOL[dtype]
    for splits in (1, 3, None):  # one program per lane, a few, and the default (many)
        out = paged_attention_decode(q, k_cache, v_cache, tables, lens, num_splits=splits, BN=16)
        assert out.dtype == dtype and out.shape == (B, T, Hq, D)
        torch.testing.assert_close(out, ref, **tol)

    # what these checks tell apart: the GQA mapping, the block order, the causal tail
    wrong_k, wrong_v = (c.repeat_interleave(Hq // Hkv, dim=2) for c in (k_cache, v_cache))
    # with kv heads repeated in place, query head h reading kv head h is the h % Hkv mapping
    wrong = paged_attention_reference(q, wrong_k[:, :, [0, 2, 1, 3]], wrong_v[:, :, [0, 2, 1, 3]],
                                      tables, lens)
    assert _far(out, wrong, tol)
    in_order = paged_attention_reference(q, k_cache.nan_to_num(), v_cache.nan_to_num(),
                                         tables.sort(dim=1).values, lens)
    assert _far(out, in_order, tol)
    if T > 1:
        assert _far(out, paged_attention_reference(q, k_cache, v_cache, tables, lens,
                                                   causal_tail=False), tol)


def test_paged_attention_wide_blocks_full_tail_and_padding_lane():
    B, T, Hq, Hkv, D, bs = 3, 3, 4, 1, 64, 32
    q, k_cache, v_cache, tables, lens = _paged_inputs(
        11, B, T, Hq, Hkv, D, bs, [50, 0, 100], torch.float32, num_blocks=16)
    for causal, splits in ((True, 2), (False, 2), (True, 1)):  # (one split: no merge)
        ref = paged_attention_reference(q, k_cache, v_cache, tables, lens, causal_tail=causal)
        out = paged_attention_decode(q, k_cache, v_cache, tables, lens, causal_tail=causal,
                                     num_splits=splits, BN=32)
        torch.testing.assert_close(out, ref, **OUT_TOL[torch.float32])
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # seq_len 0: a padding lane
        live = lens > 0
        torch.testing.assert_close(
            out[live], _sdpa_contiguous(q[live], k_cache, v_cache, tables[live], lens[live],
                                        causal_tail=causal), **OUT_TOL[torch.float32])
    # 130 splits, most of them empty, merged in two D tiles of 32
    out = paged_attention_decode(q[2:], k_cache, v_cache, tables[2:], lens[2:], num_splits=130)
    ref = paged_attention_reference(q[2:], k_cache, v_cache, tables[2:], lens[2:])
    torch.testing.assert_close(out, ref, **OUT_TOL[torch.float32])


def test_the_merge_reads_only_the_splits_that_worked():
    """Empty splits end without writing (`SKIP_EMPTY`), so their parts hold whatever the
    memory held: the merge must weigh only a lane's first `worked_splits`. Here the rest
    is NaN, so reading one of them would poison the output."""
    from kernels.paged_attention import merge_splits
    B, T, Hq, D, splits, BN = 3, 2, 2, 32, 8, 16
    lens = torch.tensor([40, 1, 0])  # 3, 1 and 0 tiles of 16: 3, 1 and 0 splits worked
    g = _gen(21)
    part_o = torch.randn(B, T, Hq, splits, D, generator=g)
    part_l = torch.randn(B, T, Hq, splits, generator=g) * 4
    worked = torch.tensor([3, 1, 0])
    for b, n in enumerate(worked.tolist()):
        part_o[b, :, :, n:] = float("nan")
        part_l[b, :, :, n:] = float("nan")
    want = torch.zeros(B, T, Hq, D)
    for b, n in enumerate(worked.tolist()):
        if n:
            w = torch.softmax(part_l[b, :, :, :n] * torch.log(torch.tensor(2.0)), dim=-1)
            want[b] = (w[..., None] * part_o[b, :, :, :n]).sum(-2)
    part_o, part_l, out = part_o.to(DEV), part_l.to(DEV), torch.empty(B, T, Hq, D, device=DEV)
    merge_splits(out, part_o, part_l, part_o.stride()[:4], part_l.stride()[:3], splits, BN,
                 lens.to(DEV))
    torch.testing.assert_close(out.cpu(), want, **OUT_TOL[torch.float32])
    # the same lengths given as the new positions (the decode attention's: + 1, read early)
    merge_splits(out, part_o, part_l, part_o.stride()[:4], part_l.stride()[:3], splits, BN,
                 (lens - 1).to(DEV), add=1, early=True)
    torch.testing.assert_close(out.cpu(), want, **OUT_TOL[torch.float32])
    # one program reading up to 128 splits (the short prefill's merge: one kernel whatever
    # its splits), the ones past `splits` masked
    out.zero_()
    merge_splits(out, part_o, part_l, part_o.stride()[:4], part_l.stride()[:3], splits, BN,
                 lens.to(DEV), bs=128)
    torch.testing.assert_close(out.cpu(), want, **OUT_TOL[torch.float32])


# the integer arguments of a kernel that follow the request (its length, its context's
# splits, the block table's width) rather than the model: none may be specialised
_PER_REQUEST_ARGS = {
    "kernels.paged_attention._paged_attn_split_kernel": ["T", "splits", "s_bt", "s_lb", "s_lt",
                                                         "s_lh"],
    "kernels.paged_attention._paged_attn_merge_kernel": ["T", "splits", "len_add", "s_lb",
                                                         "s_lt", "s_lh"],
    "kernels.conv1d._conv_update_kernel": ["T"],
    "kernels.kv_write._prologue_kernel": ["T", "s_bt", "s_pb"],
    "kernels.fused._qk_norm_gates_kernel": ["T"],
    **{f"kernels.gdn_chunk.{name}": ["T", "NT"] for name in (
        "_wy_kernel", "_solve_kernel", "_wu_kernel", "_state_kernel", "_output_kernel")},
}


def test_a_requests_own_integers_are_never_specialised():
    """Triton compiles a kernel per class of each integer argument (1, a multiple of 16,
    neither). Arguments that follow the request met classes the warm-up had not: the splits
    as a constexpr compiled a kernel per context length of a next turn, and stop 43's H100
    run still met four new attention and conv kernels on its first requests (the query
    length, the block table's width and the log-sum-exps' strides), ~0.5 s each; and the
    GDN prefill's kernels compiled a variant per (T, NT) class the warm-up sent, a cold
    start's seconds. Read from the compiled (not interpreted) JIT functions, in a process
    of their own."""
    import json
    import os
    import subprocess
    import sys

    from kernels.paged_attention import MAX_SPLITS
    code = ("import importlib, json, sys\n"
            "out = {}\n"
            "for name in json.loads(sys.argv[1]):\n"
            "    module, kernel = name.rsplit('.', 1)\n"
            "    fn = getattr(importlib.import_module(module), kernel)\n"
            "    out[name] = {p.name: bool(p.do_not_specialize) for p in fn.params}\n"
            "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(list(_PER_REQUEST_ARGS))],
                          capture_output=True, text=True, env=env, timeout=120, check=True)
    params = json.loads(done.stdout)
    for name, args in _PER_REQUEST_ARGS.items():
        unspecialised = {arg for arg, off in params[name].items() if off}
        assert set(args) <= unspecialised, (name, set(args) - unspecialised)
        assert "SPLITS" not in params[name]   # a runtime value, not a constexpr
    # the data's own strides keep their 16-alignment hints (the loads' vectorising)
    assert not params["kernels.paged_attention._paged_attn_split_kernel"]["s_qt"]
    assert MAX_SPLITS == 128


# --- real shapes, on the GPU --------------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("T,all_states", [(1, False), (4, True)])
def test_gpu_gdn_real_shape(B, T, all_states):
    Hk, Hv, D = 16, 32, 128
    q, k, v, g, beta = _gdn_inputs(12, B, T, Hk, Hv, D, D, torch.bfloat16)
    pool, _ = _slot_pool(13, 2 * B + 1, (Hv, D, D))
    pool *= 0.1
    idx = torch.randperm(2 * B + 1, generator=_gen(14))[:B].to(DEV)
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool[idx],
                                              all_states=all_states)
    got = fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool, state_indices=idx,
                                           all_states=all_states)
    o, states = got if all_states else (got, pool[idx])
    torch.testing.assert_close(o, o_ref, **OUT_TOL[torch.bfloat16])
    torch.testing.assert_close(states, s_ref, rtol=1e-4, atol=1e-4)


@gpu_only
@pytest.mark.parametrize("B,T", [(1, 1), (8, 4)])
def test_gpu_conv_real_shape(B, T):
    C, K = 2 * 16 * 128 + 32 * 128, 4
    x, weight, _ = _conv_inputs(15, B, C, T, K, torch.bfloat16)
    pool, _ = _slot_pool(16, B + 2, (C, K - 1), torch.bfloat16)
    idx = torch.arange(B, device=DEV).flip(0) + 1
    y_ref, tail_ref = conv_reference(x, pool[idx], weight)
    y, tail = causal_conv1d_update(x, pool, weight, state_indices=idx)
    torch.testing.assert_close(y, y_ref, **OUT_TOL[torch.bfloat16])
    assert torch.equal(pool[idx], tail_ref)


@gpu_only
def test_gpu_conv_prefill_chunk_in_time_tiles():
    """A 2048-position chunk of the real shape, without slots (the prefill's call): cut
    into time tiles, the reference's outputs, its tail returned and written into the state."""
    C, K, T = 2 * 16 * 128 + 32 * 128, 4, 2048
    x, weight, _ = _conv_inputs(17, 1, C, T, K, torch.bfloat16)
    state = torch.randn(1, C, K - 1, generator=_gen(18)).to(DEV, torch.bfloat16)
    y_ref, tail_ref = conv_reference(x, state, weight)
    y, tail = causal_conv1d_update(x, state, weight)
    torch.testing.assert_close(y, y_ref, **OUT_TOL[torch.bfloat16])
    assert torch.equal(tail, tail_ref) and torch.equal(state, tail_ref)


@gpu_only
@pytest.mark.parametrize("B,T", [(1, 1), (4, 4), (1, 31)])
def test_gpu_paged_attention_real_shape(B, T):
    Hq, Hkv, D, bs, L = 8, 2, 256, 16, 4096  # the 0.73B model's attention at 4K context
    lens = [L - 37 * b for b in range(B)]
    q, k_cache, v_cache, tables, seq = _paged_inputs(
        17, B, T, Hq, Hkv, D, bs, lens, torch.bfloat16, num_blocks=B * (L // bs + 1) + 8)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq)
    out = paged_attention_decode(q, k_cache, v_cache, tables, seq)
    torch.testing.assert_close(out, ref, **OUT_TOL[torch.bfloat16])
    torch.testing.assert_close(out.float(), _sdpa_contiguous(q, k_cache, v_cache, tables, seq),
                               **OUT_TOL[torch.bfloat16])


@gpu_only
def test_gpu_timings(capsys):
    """Not a gate: prints CUDA-graph timings of the real shapes for whoever tunes them."""
    from triton.testing import do_bench_cudagraph

    lines = []
    for B in (1, 8):
        q, k, v, g, beta = _gdn_inputs(18, B, 1, 16, 32, 128, 128, torch.bfloat16)
        pool = torch.zeros(B, 32, 128, 128, device=DEV)
        us = 1e3 * do_bench_cudagraph(
            lambda: fused_recurrent_gated_delta_rule(q, k, v, g, beta, pool))  # noqa: B023
        lines.append(f"gdn decode B={B}: {us:.2f} us")
    q, k_cache, v_cache, tables, seq = _paged_inputs(
        19, 1, 1, 8, 2, 256, 16, [4096], torch.bfloat16, num_blocks=300)
    us = 1e3 * do_bench_cudagraph(
        lambda: paged_attention_decode(q, k_cache, v_cache, tables, seq))
    lines.append(f"paged attention B=1 T=1 L=4096: {us:.2f} us")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_gdn_step_computes_the_gates_from_raw_projections():
    """gates=(a, b, A_log, dt_bias): the model's beta and g, computed in the kernel."""
    import torch.nn.functional as F

    from kernels.gdn_decode import fused_recurrent_gated_delta_rule
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g0 = torch.Generator(device=dev).manual_seed(3)
    B, T, Hk, Hv, D = 2, 3, 1, 2, 16
    q = F.normalize(torch.randn(B, T, Hk, D, device=dev, generator=g0), dim=-1)
    k = F.normalize(torch.randn(B, T, Hk, D, device=dev, generator=g0), dim=-1)
    v = torch.randn(B, T, Hv, D, device=dev, generator=g0)
    ab = torch.randn(B, T, 2 * Hv, device=dev, generator=g0) * 4  # strided views, some > 20
    ab[0, 0, 0] = 25.0
    a, b = ab[..., :Hv], ab[..., Hv:]
    a_log, dt_bias = torch.randn(Hv, device=dev) * 0.5, torch.randn(Hv, device=dev)
    beta = torch.sigmoid(b)
    g = -a_log.exp() * F.softplus(a + dt_bias)
    state = torch.randn(B, Hv, D, D, device=dev) * 0.1
    want_s = state.clone()
    want = fused_recurrent_gated_delta_rule(q, k, v, g, beta, want_s)
    got_s = state.clone()
    got = fused_recurrent_gated_delta_rule(q, k, v, None, None, got_s,
                                           gates=(a, b, a_log, dt_bias))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert torch.allclose(got_s, want_s, atol=1e-5, rtol=1e-4)
    swapped = fused_recurrent_gated_delta_rule(q, k, v, None, None, state.clone(),
                                               gates=(b, a, a_log, dt_bias))
    assert not torch.allclose(swapped, want, atol=1e-3)
    # a verify's form: every position's state kept, q and k normalised in the kernel too
    want, want_all = fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, all_states=True)
    got, got_all = fused_recurrent_gated_delta_rule(q * 3, k * 0.5, v, None, None, state,
                                                    all_states=True, use_qk_l2norm=True,
                                                    gates=(a, b, a_log, dt_bias))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert torch.allclose(got_all, want_all, atol=1e-5, rtol=1e-4)
    assert torch.allclose(got_all[:, -1], want_s, atol=1e-5, rtol=1e-4)
