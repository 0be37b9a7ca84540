"""Greedy keys (the argmax folded into the LM head and read back) and the decode graph's
first kernel, against their torch references: under the interpreter here, on real shapes
on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import greedy, skinny
from kernels.skinny import Tiles
from ninfer.model.layers import _inv_freq, rope_cos_sin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reset(n: int) -> torch.Tensor:
    return torch.full((n,), greedy.KEY_NONE, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_order_as_argmax_does_first_column_of_a_tie_and_negative_logits(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 300, device=DEVICE).to(dtype)
    x[1, 40] = x[1, 250] = x[1].max() + 1  # a tie: the first column wins
    x[2] = -x[2].abs() - 1  # every logit negative
    x[3] = 0.0
    x[3, 7], x[3, 9] = -0.0, 0.0  # -0.0 ties with +0.0: column 0 (a zero) wins
    keys = greedy.greedy_keys(x, _reset(4))
    assert torch.equal(keys, greedy.greedy_keys_reference(x))
    assert greedy.token_of(keys).tolist() == x.float().argmax(-1).tolist()
    assert greedy.token_of(keys)[1] == 40 and greedy.token_of(keys)[3] == 0
    # folding the same logits again, or a smaller copy of them, changes nothing
    assert torch.equal(greedy.greedy_keys(x - 1, keys.clone()), keys)


@pytest.mark.parametrize("tiles", [None, Tiles(16, 32), Tiles(16, 32, split=3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lm_head_folds_each_rows_greedy_key_of_the_logits_it_writes(tiles, dtype):
    torch.manual_seed(1)
    x = torch.randn(2, 96, device=DEVICE).to(dtype)
    w = (torch.randn(333, 96, device=DEVICE) * 0.1).to(dtype)
    norm = (torch.randn(96, device=DEVICE) * 0.1).to(dtype)
    keys = _reset(2)
    logits, _ = skinny.norm_linear(x, norm, 1e-6, w, normed=True, argmax=keys, tiles=tiles)
    assert torch.equal(keys, greedy.greedy_keys_reference(logits))
    with pytest.raises(ValueError, match="argmax"):
        skinny.norm_linear(x, norm, 1e-6, w, argmax=_reset(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_start_feeds_staged_tokens_or_the_keys_and_makes_the_rotary_angles(dtype):
    torch.manual_seed(2)
    V, D, R = 50, 40, 16
    emb = torch.randn(V, D, device=DEVICE).to(dtype)
    inv = _inv_freq(R, 1e6, torch.float32, torch.device(DEVICE))
    ids = torch.tensor([[3], [-1], [-1], [0]], device=DEVICE)
    positions = torch.tensor([[5], [70_000], [0], [9]], device=DEVICE)
    keys = greedy.greedy_keys_reference(torch.randn(4, V, device=DEVICE))
    keys[2] = greedy.KEY_NONE  # no key left: token 0
    want_tokens = [3, int(greedy.token_of(keys)[1]), 0, 0]
    h_ref, cos_ref, sin_ref = greedy.decode_start_reference(ids, positions, keys, emb, inv)
    h, cos, sin = greedy.decode_start(ids, positions, keys, emb, inv)
    torch.testing.assert_close(h, emb[want_tokens][:, None], rtol=0, atol=0)
    assert torch.equal(h, h_ref)
    assert (keys == greedy.KEY_NONE).all(), "the keys are reset for the LM head to fold anew"
    want_cos, want_sin = rope_cos_sin(positions, R, 1e6, dtype)
    assert torch.equal(cos_ref, want_cos) and torch.equal(sin_ref, want_sin)
    # libdevice's cosf on a GPU is torch's; the interpreter's numpy may move one bf16 ulp
    tol = 0.0 if DEVICE == "cuda" else 8e-3
    assert (cos.float() - want_cos.float()).abs().max() <= tol
    assert (sin.float() - want_sin.float()).abs().max() <= tol
    with pytest.raises(ValueError, match="decode_start"):
        greedy.decode_start(ids[:, 0], positions, keys, emb, inv)
