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


@pytest.mark.parametrize("lanes", [1, 3])
def test_decode_start_fetches_its_turns_row_of_the_hosts_ring(lanes):
    """Zero-copy staging: the inputs come from the ring's row turn % RING (the other rows
    hold other turns' inputs), are copied whole into the device's buffer, and feed the step
    as staged inputs do; publish_keys puts the keys in the same row with the turn whose
    inputs were used, and moves the turn on. A row staged for another turn is not used:
    the neutral last row is, and the host is told (-2 where the turn would be)."""
    torch.manual_seed(3)
    V, D, R, RING, W = 50, 40, 16, 4, 70
    N = 4 * lanes + lanes * W
    emb = torch.randn(V, D, device=DEVICE)
    inv = _inv_freq(R, 1e6, torch.float32, torch.device(DEVICE))
    ring = torch.randint(0, 1000, (RING + 1, 1 + N), device=DEVICE)
    ring[:, 1:1 + lanes] = torch.randint(0, V, (RING + 1, lanes))  # ids
    ring[2, 1] = -1  # turn 6's first lane takes the key's token
    ring[:RING, 0] = torch.tensor([4, 9, 6, 3])  # the turn each row was staged for
    ring[RING, 0] = -1
    keys_ring = torch.full((RING, 1 + lanes), -9, dtype=torch.int64, device=DEVICE)
    inputs = torch.full((N,), -7, dtype=torch.int64, device=DEVICE)
    ids, positions = inputs[:lanes].view(lanes, 1), inputs[lanes:2 * lanes].view(lanes, 1)
    turn = torch.tensor([6, 0], device=DEVICE)  # row 2
    for row, echo in ((2, 6), (RING, -2)):  # turn 6's row; then turn 7's, staged for 3
        keys = greedy.greedy_keys_reference(torch.randn(lanes, V, device=DEVICE))
        src = ring[row, 1:]
        want = greedy.decode_start_reference(src[:lanes, None], src[lanes:2 * lanes, None],
                                             keys.clone(), emb, inv)
        got = greedy.decode_start(ids, positions, keys, emb, inv, fetch=(ring, turn, inputs))
        assert torch.equal(inputs, src), "the whole row reaches the device's buffer"
        assert torch.equal(got[0], want[0])
        for g, w in zip(got[1:], want[1:], strict=True):
            assert (g - w).abs().max() <= (0.0 if DEVICE == "cuda" else 1e-6)
        assert (keys == greedy.KEY_NONE).all()
        keys = greedy.greedy_keys_reference(torch.randn(lanes, V, device=DEVICE))
        greedy.publish_keys(keys, keys_ring, turn)
        at = int(turn[0]) - 1
        assert torch.equal(keys_ring[at % RING, 1:], keys)
        assert int(keys_ring[at % RING, 0]) == echo
    assert torch.equal(turn, torch.tensor([8, -2], device=DEVICE))
    assert (keys_ring[:2] == -9).all()
    with pytest.raises(ValueError, match="fetches"):
        greedy.decode_start(ids, inputs[:lanes].view(lanes, 1), keys, emb, inv,
                            fetch=(ring, turn, inputs))
    with pytest.raises(ValueError, match="fetches"):  # ids not inputs' first B
        greedy.decode_start(inputs[N - lanes:].view(lanes, 1), positions, keys, emb, inv,
                            fetch=(ring, turn, inputs))
    with pytest.raises(ValueError, match="fetches"):  # RING a power of two: 3 is not
        greedy.decode_start(ids, positions, keys, emb, inv, fetch=(ring[1:], turn, inputs))
    with pytest.raises(ValueError, match="publish_keys"):
        greedy.publish_keys(keys, keys_ring.view(-1), turn)
    with pytest.raises(ValueError, match="publish_keys"):
        greedy.publish_keys(keys, keys_ring[1:], turn)


def test_the_kernels_after_a_fetching_decode_start_start_once_it_has_finished(monkeypatch):
    """The kernels of a step read the staged inputs before their PDL wait (a GDN step its
    slots, the attention its block table): with zero-copy staging decode_start writes
    them, so it fences (`kernels.pdl`). The next launch keeps the fence: a kernel that
    takes FENCE (the skinny GEMMs: dependents launched after its wait) is given it, any
    other is preceded by a barrier launched without PDL. Once kept, a fence is gone; and
    without PDL (copies before the graph) there is none."""
    from kernels import pdl
    launched = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((self.name, kw.get("launch_pdl", False)))

    monkeypatch.setattr(greedy, "_decode_start_kernel", Recorder("start"))
    monkeypatch.setattr(pdl, "_barrier_kernel", Recorder("barrier"))
    monkeypatch.setattr(pdl, "enabled", lambda x: True)
    lanes, N = 2, 8 + 2 * 4
    inputs = torch.zeros(N, dtype=torch.int64)
    ring = torch.zeros(5, 1 + N, dtype=torch.int64)
    args = (inputs[:lanes].view(lanes, 1), inputs[lanes:2 * lanes].view(lanes, 1),
            torch.zeros(lanes, dtype=torch.int64), torch.randn(10, 8),
            torch.ones(4, dtype=torch.float32))
    greedy.decode_start(*args)
    assert launched == [("start", True)]
    assert pdl.launch(inputs, fenced=True) == {"PDL": True, "launch_pdl": True, "FENCE": False}
    fetch = (ring, torch.zeros(2, dtype=torch.int64), inputs)
    for fenced, want in ((True, []), (False, [("barrier", False)])):
        launched.clear()
        greedy.decode_start(*args, fetch=fetch)
        assert launched == [("start", True)]
        keywords = pdl.launch(inputs, fenced=fenced)
        assert launched[1:] == want and keywords["launch_pdl"]
        assert keywords.get("FENCE", False) == fenced
        assert pdl.launch(inputs) == {"PDL": True, "launch_pdl": True}  # kept: gone
        assert launched[1:] == want
    monkeypatch.setattr(pdl, "enabled", lambda x: False)
    launched.clear()
    greedy.decode_start(*args, fetch=fetch)
    assert pdl.launch(inputs) == {"PDL": False} and launched == [("start", False)]
