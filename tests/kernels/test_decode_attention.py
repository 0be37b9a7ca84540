"""The attention layer's mixer in one launch (kernels.decode_attention) against the chain it
replaces (the prologue's and paged attention's torch references): lanes of ragged lengths
over scattered blocks, the new position at a block's first slot, mid-block and last, every
way of splitting the KV; the cache it writes and what it leaves alone."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_attention as da
from ninfer.model.layers import rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HKV, D, BLOCK = 4, 2, 32, 4
OUT_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
# the new k lands rounded as the prologue rounds it (the interpreter truncates bf16)
CACHE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2.4e-2}


def _case(dtype, lengths, rotary=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    y = (torch.randn(B, 1, (2 * H + 2 * HKV) * D, generator=g) * 3).to(dtype)
    qw = (torch.randn(D, generator=g) * 0.1).to(dtype)
    kw = (torch.randn(D, generator=g) * 0.1).to(dtype)
    width = max(-(-n // BLOCK) for n in lengths) + 1
    blocks = B * width + 2
    tables = torch.randperm(blocks, generator=g)[:B * width].view(B, width)
    lens = torch.tensor(lengths)
    cos, sin = rope_cos_sin(lens[:, None] - 1, rotary, 10_000.0, dtype)
    k = torch.randn(blocks, BLOCK, HKV, D, generator=g).to(dtype)
    v = torch.randn(blocks, BLOCK, HKV, D, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (y, qw, kw, cos, sin, k, v, tables, lens)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_one_launch_equals_the_prologue_then_paged_attention(dtype, splits):
    # new positions: a block's first slot (8), mid-block (52), a block's last slot (35), a
    # tile's first (32), and a lane whose only position is the new one
    y, qw, kw, cos, sin, k, v, tables, lens = _case(dtype, [9, 53, 36, 33, 1])
    k_want, v_want = k.clone(), v.clone()
    pos = (lens - 1)[:, None]
    want = da.decode_attention_reference(y, H, HKV, D, qw, kw, 1e-6, cos, sin, k_want, v_want,
                                         tables, pos)
    got = da.decode_attention(y, H, HKV, D, qw, kw, 1e-6, cos, sin, k, v, tables, pos,
                              num_splits=splits, BN=16)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **OUT_TOL[dtype])
    for a, b in ((k, k_want), (v, v_want)):  # the new k, v written; nothing else moved
        assert (a.float() - b.float()).abs().max() / b.float().abs().max() <= CACHE_TOL[dtype]
    changed = (k != k_want).any(-1).any(-1)  # [blocks, BLOCK]: only rounding, at new slots
    new_slots = torch.zeros_like(changed)
    new_slots[tables.gather(1, (lens[:, None] - 1) // BLOCK), (lens[:, None] - 1) % BLOCK] = True
    assert not bool((changed & ~new_slots).any())


def test_the_old_positions_and_the_new_one_both_count():
    """A check that could fail: attending without the new position, or with the cache's
    stale value there, gives another answer."""
    y, qw, kw, cos, sin, k, v, tables, lens = _case(torch.float32, [6, 40], rotary=D // 2)
    got = da.decode_attention(y, H, HKV, D, qw, kw, 1e-6, cos, sin, k.clone(), v.clone(),
                              tables, (lens - 1)[:, None], num_splits=2, BN=16)
    from kernels.kv_write import attention_prologue_reference
    from kernels.paged_attention import paged_attention_reference
    q = attention_prologue_reference(y, H, HKV, D, qw, kw, 1e-6, cos, sin, k.clone(), v.clone(),
                                     tables, (lens - 1)[:, None])
    for other in (paged_attention_reference(q, k, v, tables, lens),  # stale k, v at the new
                  paged_attention_reference(q, k, v, tables, lens - 1)):  # position; without it
        assert (got.double() - other.double()).abs().max() > 1e-3


def test_bad_shapes_are_refused():
    y, qw, kw, cos, sin, k, v, tables, lens = _case(torch.float32, [5, 7])
    with pytest.raises(ValueError, match="one token per lane"):
        da.decode_attention(y, H, HKV, D, qw, kw, 1e-6, cos, sin, k, v, tables, lens[:1, None])
