"""The attention prologue (kernels.kv_write: q/k norms, rotary embedding and the paged KV
write in one launch) against the torch chain it replaces, on a projection laid out as the
model's ([q | gate] per head, then k, then v), with lanes whose blocks are scattered and
positions that cross a block boundary."""

from __future__ import annotations

import pytest
import torch

from kernels import kv_write
from ninfer.model.layers import rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HKV, D, BLOCK = 4, 2, 32, 4
# bf16: the interpreter truncates where the GPU rounds: a few ulps
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.4e-2}


def _case(dtype, B, T, rotary, cache_dtype):
    g = torch.Generator().manual_seed(B * 100 + T)
    y = (torch.randn(B, T, (2 * H + 2 * HKV) * D, generator=g) * 3).to(dtype).to(DEVICE)
    qw = (torch.randn(D, generator=g) * 0.1).to(dtype).to(DEVICE)
    kw = (torch.randn(D, generator=g) * 0.1).to(dtype).to(DEVICE)
    blocks = 4 * B + 3  # each lane 4 of them, scattered, no two lanes sharing one (a pool)
    tables = torch.randperm(blocks, generator=g)[:4 * B].view(B, 4)
    starts = torch.tensor([2 + 5 * b for b in range(B)])  # every lane crosses a block edge
    positions = (starts[:, None] + torch.arange(T)).to(DEVICE)
    cos, sin = rope_cos_sin(positions, rotary, 10_000.0, dtype)
    caches = [torch.full((blocks, BLOCK, HKV, D), 7.0, dtype=cache_dtype, device=DEVICE)
              for _ in range(2)]
    return y, qw, kw, cos, sin, caches, tables.to(DEVICE), positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "T", "rotary"), [(1, 1, D), (3, 1, D // 2), (2, 5, D // 4)])
def test_the_prologue_writes_and_returns_what_the_torch_chain_does(dtype, B, T, rotary):
    y, qw, kw, cos, sin, (k, v), tables, positions = _case(dtype, B, T, rotary, dtype)
    k_want, v_want = k.clone(), v.clone()
    q = kv_write.attention_prologue(y, H, HKV, D, qw, kw, 1e-6, cos, sin, k, v, tables,
                                    positions)
    q_want = kv_write.attention_prologue_reference(y, H, HKV, D, qw, kw, 1e-6, cos, sin,
                                                   k_want, v_want, tables, positions)
    for got, want in ((q, q_want), (k, k_want), (v, v_want)):
        assert got.shape == want.shape and got.dtype == want.dtype
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() / scale <= TOL[dtype]
    # only the tokens' slots were written: every other slot keeps its 7
    written = torch.zeros(k.shape[:2], dtype=torch.bool, device=DEVICE)
    written[tables.gather(1, positions // BLOCK), positions % BLOCK] = True
    assert bool((k[~written] == 7).all()) and bool((v[~written] == 7).all())
    assert not bool((k[written] == 7).any())


def test_the_cache_may_hold_another_dtype_and_bad_shapes_are_refused():
    y, qw, kw, cos, sin, (k, v), tables, positions = _case(torch.float32, 2, 1, D,
                                                           torch.bfloat16)
    k_want, v_want = k.clone(), v.clone()
    kv_write.attention_prologue(y, H, HKV, D, qw, kw, 1e-6, cos, sin, k, v, tables, positions)
    kv_write.attention_prologue_reference(y, H, HKV, D, qw, kw, 1e-6, cos, sin, k_want, v_want,
                                          tables, positions)
    for got, want in ((k, k_want), (v, v_want)):  # one bf16 ulp (the interpreter truncates)
        assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    with pytest.raises(ValueError, match="y must be"):
        kv_write.attention_prologue(y[..., :-D], H, HKV, D, qw, kw, 1e-6, cos, sin, k, v,
                                    tables, positions)
    with pytest.raises(ValueError, match="k_cache must be"):
        kv_write.attention_prologue(y, H, HKV, D, qw, kw, 1e-6, cos, sin, k[..., :1, :], v,
                                    tables, positions)
