"""The skinny GEMMs against the torch chains they replace, float32 and bfloat16, on small
shapes whose N and K are not multiples of the tiles, through each way of cutting a call:
the default tiles, one row's multiply-adds with K split over programs, and the dot with K
split (the workspace must be left zero for the next call)."""

from __future__ import annotations

import pytest
import torch

from kernels import skinny
from kernels.skinny import Tiles
from ninfer.flags import override

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32: summation order only. bf16: the outputs are rounded to bf16, and a sum that lands
# on the other side of a rounding boundary moves one ulp (~0.8%); the interpreter truncates
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.4e-2}
# silu(g) * u multiplies a one-ulp move of g or u by the other factor (|u| ~ 3 here)
GLU_TOL = {torch.float32: 2e-5, torch.bfloat16: 8e-2}
TILES = [None, Tiles(16, 32), Tiles(16, 32, split=3), Tiles(16, 32, split=2, dot=True)]
N, K, HEAD = 40, 96, 16


def _close(got, want, dtype, tol=TOL):
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().clamp(min=1.0)
    err = (got.float() - want.float()).abs().max() / scale
    assert err <= tol[dtype], (float(err), float(scale))


def _randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def _workspace_is_clean():
    for ws, cnt in [*skinny._workspaces.values(), *skinny._outgrown]:
        assert ws.abs().max() == 0 and cnt.abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("rows", [1, 5])
def test_linear_and_its_residual(rows, tiles, dtype):
    packed = _randn(rows, 1, K + 24, dtype=dtype)
    x = packed[..., 8:8 + K]  # a strided view, as a slice of a projection
    w = _randn(N, K, dtype=dtype, scale=K ** -0.5)
    r = _randn(rows, 1, N, dtype=dtype)
    _close(skinny.linear(x, w, tiles=tiles), skinny.linear_reference(x, w), dtype)
    _close(skinny.linear(x, w, r, tiles=tiles), skinny.linear_reference(x, w, r), dtype)
    w2 = _randn(2 * N, K, dtype=dtype, scale=K ** -0.5)
    _close(skinny.linear(x, w2, glu=True, tiles=tiles),
           skinny.linear_reference(x, w2, glu=True), dtype, GLU_TOL)
    _workspace_is_clean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("rows", [1, 3])
def test_norm_prologue_with_gate_up_pairs_and_the_normed_rows(rows, tiles, dtype):
    x = _randn(rows, K, dtype=dtype, scale=3.0)
    nw = _randn(K, dtype=dtype, scale=0.1)
    w = _randn(2 * N, K, dtype=dtype, scale=K ** -0.5)
    _close(skinny.norm_linear(x, nw, 1e-6, w, tiles=tiles),
           skinny.norm_linear_reference(x, nw, 1e-6, w), dtype)
    _close(skinny.norm_linear(x, nw, 1e-6, w, glu=True, tiles=tiles),
           skinny.norm_linear_reference(x, nw, 1e-6, w, glu=True), dtype, GLU_TOL)
    y, xn = skinny.norm_linear(x, nw, 1e-6, w, normed=True, tiles=tiles)
    want_y, want_xn = skinny.norm_linear_reference(x, nw, 1e-6, w, normed=True)
    _close(y, want_y, dtype)
    _close(xn, want_xn, dtype)
    _workspace_is_clean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("rows", [1, 4])
def test_gated_norm_and_sigmoid_gate_prologues(rows, tiles, dtype):
    H = K // HEAD
    x = _randn(rows, 1, H, HEAD, dtype=dtype)
    # the gates as views: z inside a packed projection row, g interleaved with q per head
    packed = _randn(rows, 1, K + 8, dtype=dtype)
    z = packed[..., 4:4 + K].view(rows, 1, H, HEAD)
    g = _randn(rows, 1, H, 2 * HEAD, dtype=dtype)[..., HEAD:]
    nw = 1 + _randn(HEAD, dtype=dtype, scale=0.1)
    w = _randn(N, K, dtype=dtype, scale=K ** -0.5)
    r = _randn(rows, 1, N, dtype=dtype)
    _close(skinny.gated_norm_linear(x, z, nw, 1e-6, w, r, tiles=tiles),
           skinny.gated_norm_linear_reference(x, z, nw, 1e-6, w, r), dtype)
    _close(skinny.gate_linear(x, g, w, tiles=tiles), skinny.gate_linear_reference(x, g, w),
           dtype)
    _close(skinny.gate_linear(x, g, w, r, tiles=tiles),
           skinny.gate_linear_reference(x, g, w, r), dtype)
    _workspace_is_clean()


def test_too_many_rows_is_refused():
    with pytest.raises(ValueError):
        skinny.linear(torch.zeros(9, 32, device=DEVICE), torch.zeros(16, 32, device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic launches need a GPU")
@pytest.mark.parametrize("tiles", [None, Tiles(8, 64), Tiles(16, 32, split=3)])
def test_a_graph_of_dependent_launches_matches_the_chain_run_one_call_at_a_time(tiles):
    """Each call reads what the one before wrote, the norm kernel between them included:
    with programmatic dependent launch (kernels.pdl) a kernel that read its input, or wrote
    its output, before waiting for the previous one would turn this red."""
    from kernels import fused
    torch.manual_seed(0)
    dtype, width = torch.bfloat16, 256
    ws = [_randn(width, width, dtype=dtype, scale=width ** -0.5) for _ in range(12)]
    nw = _randn(width, dtype=dtype, scale=0.1)
    x = _randn(1, width, dtype=dtype)

    def chain():
        h = x
        for i, w in enumerate(ws):
            h = skinny.norm_linear(h, nw, 1e-6, w, tiles=tiles) if i % 2 else \
                fused.rms_norm(skinny.linear(h, w, h, tiles=tiles), nw, 1e-6)
        return h

    with override(pdl=False):  # the same kernels, each waiting for the last
        want = chain().clone()
        torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    for _ in range(20):
        got.zero_()
        graph.replay()
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("rows", [1, 3])
def test_conv_epilogue_equals_the_projection_then_the_conv_kernel_reference(rows, tiles,
                                                                            dtype):
    """The in-projection with the GDN conv folded in: its first C columns are the causal
    conv (SiLU) of each lane's tail in its pool slot ++ the new value, the tails shift in
    place, a padding lane (slot -1) reads zeros and writes nothing, and the columns past C
    and the other slots are left as the plain GEMM / untouched."""
    from kernels.gdn_reference import causal_conv1d_update
    C, KC = 24, 4
    x = _randn(rows, 1, K, dtype=dtype, scale=3.0)
    nw = _randn(K, dtype=dtype, scale=0.1)
    w = _randn(N, K, dtype=dtype, scale=K ** -0.5)
    cw = _randn(C, KC, dtype=dtype, scale=0.5)
    pool = _randn(6, C, KC - 1, dtype=dtype)
    slots = torch.tensor([4, -1, 1][:rows], device=DEVICE)
    before = pool.clone()
    got = skinny.norm_linear(x, nw, 1e-6, w, conv=(pool, slots, cw), tiles=tiles)
    want = skinny.norm_linear_reference(x, nw, 1e-6, w)
    tails = before[slots.clamp(min=0)] * (slots >= 0)[:, None, None]  # padding: zeros
    # the conv in float32 on the rounded projection, as the conv kernel computes it (the
    # torch reference would compute in the inputs' dtype)
    y, _ = causal_conv1d_update(want[:, 0, :C, None].float(), tails.float(), cw.float())
    _close(got[..., C:], want[..., C:], dtype)
    _close(got[:, 0, :C], y[..., 0].to(dtype), dtype)
    for r, slot in enumerate(slots.tolist()):
        if slot >= 0:  # the new tail holds the rounded projection this call returned
            assert torch.equal(pool[slot, :, :-1], before[slot, :, 1:])
            _close(pool[slot, :, -1], want[r, 0, :C], dtype)
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])
    _workspace_is_clean()


@pytest.mark.parametrize("tiles", [None, Tiles(16, 32, split=3)])
def test_conv_epilogue_writes_the_new_tails_to_their_destinations(tiles):
    """conv=(pool, slots, weight, dests): each row's tail is read from its slot and the
    shifted tail written to its destination; the input slots keep their tails."""
    C, KC, dtype = 24, 4, torch.float32
    x = _randn(3, 1, K, dtype=dtype, scale=3.0)
    nw, w = _randn(K, dtype=dtype, scale=0.1), _randn(N, K, dtype=dtype, scale=K ** -0.5)
    cw, pool = _randn(C, KC, dtype=dtype, scale=0.5), _randn(7, C, KC - 1, dtype=dtype)
    slots, dests = (torch.tensor(t, device=DEVICE) for t in ([4, -1, 1], [0, -1, 6]))
    before = pool.clone()
    in_place = pool.clone()
    want = skinny.norm_linear(x, nw, 1e-6, w, conv=(in_place, slots, cw), tiles=tiles)
    got = skinny.norm_linear(x, nw, 1e-6, w, conv=(pool, slots, cw, dests), tiles=tiles)
    _close(got, want, dtype)  # (split-K adds in whatever order the programs arrive)
    _close(pool[[0, 6]], in_place[[4, 1]], dtype)  # what the in-place call wrote
    assert torch.equal(pool[[1, 2, 3, 4, 5]], before[[1, 2, 3, 4, 5]])
    assert not torch.equal(pool[[0, 6]], before[[0, 6]])
    _workspace_is_clean()


def test_conv_epilogue_refuses_what_it_cannot_fold():
    x = _randn(1, K, dtype=torch.float32)
    w = _randn(2 * N, K, dtype=torch.float32)
    conv = (_randn(2, 8, 3, dtype=torch.float32), torch.tensor([0], device=DEVICE),
            _randn(8, 4, dtype=torch.float32))
    with pytest.raises(ValueError, match="conv epilogue"):
        skinny.norm_linear(x, _randn(K, dtype=torch.float32), 1e-6, w, glu=True, conv=conv)
    with pytest.raises(ValueError, match="conv epilogue"):
        skinny.norm_linear(x, _randn(K, dtype=torch.float32), 1e-6, w,
                           conv=(conv[0], torch.tensor([0, 1], device=DEVICE), conv[2]))
    with pytest.raises(ValueError, match="conv epilogue"):  # destinations for every row
        skinny.norm_linear(x, _randn(K, dtype=torch.float32), 1e-6, w[:N],
                           conv=(*conv, torch.tensor([0, 1], device=DEVICE)))
