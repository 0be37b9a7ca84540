"""The model's GPU path (Triton kernels: conv and gated delta rule in the slot pools, paged
attention over the blocks) computes what the torch path computes. Run here on CPU tensors
in Triton's interpreter; on a GPU the same code runs for real (tests/kernels has the
kernels' own tests on real shapes)."""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from ninfer.engine.engine import EngineConfig
from ninfer.flags import override
from ninfer.model.gdn import SlotGDNState
from ninfer.model.torch_model import TorchModel
from ninfer.sim.harness import Harness

from .nets import tiny_net

# the kernel path on CPU tensors, through Triton's interpreter: a GPU host compiles the
# kernels instead (its own tests are tests/model/test_cuda_engine.py)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors through Triton's interpreter")

PROMPT = tuple((i * 11 + 2) % 97 for i in range(37))


def _factory(num_blocks, block_size, num_slots):
    return TorchModel(tiny_net(torch.float32), num_blocks=num_blocks, block_size=block_size,
                      num_slots=num_slots, identity="tiny-test-f32")


def _model_with_random_states(seed: int) -> TorchModel:
    """A model whose GDN slot pools hold random states (a step must read them)."""
    model = _factory(16, 4, 6)
    torch.manual_seed(seed)
    for layer in model.conv:
        model.conv[layer].normal_()
        model.recurrent[layer].normal_(std=0.1)
    return model


def _conversation(spec: str):
    h = Harness(EngineConfig(spec=spec, prefill_chunk=16, draft_tokens=2, check_reuse=True),
                model_factory=_factory)
    first = h.submit(PROMPT, "s", max_tokens=6)
    h.run()
    turn2 = PROMPT + tuple(h.request(first).outputs) + (4, 5, 6)
    second = h.submit(turn2, "s", max_tokens=5)
    h.run()
    h.check()
    return h, [h.request(first).outputs, h.request(second).outputs]


@pytest.fixture
def on_cpu():
    with override(interpret_on_cpu=True):
        assert kernels.device_kernels() is not None
        yield


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_the_kernel_path_gives_the_torch_paths_tokens(spec):
    _, want = _conversation(spec)
    with override(interpret_on_cpu=True):
        h, got = _conversation(spec)
        # the lanes' GDN state stayed in the pools: one-token steps updated the slots in place
        state = h.engine.model._state([0], [[0]])
    assert got == want
    assert all(isinstance(s, SlotGDNState) for s in state.gdn.values())


def _anchored(spec: str):
    """Turn 1, then a next turn with a served one's boundaries (the reply's end, the
    message's end): one forward keeping its states, its anchors picked from them; then a
    branch restored from the message's anchor. (check_reuse: every restored part equals a
    recomputation.)"""
    h = Harness(EngineConfig(spec=spec, prefill_chunk=16, draft_tokens=2, check_reuse=True,
                             auto_anchors=2), model_factory=_factory)
    first = h.submit(PROMPT, "s", max_tokens=3, boundaries=(len(PROMPT),))
    h.run()
    head = PROMPT + tuple(h.request(first).outputs)
    turn2 = head + (4, 5, 6, 7, 8, 9, 10, 11)
    bounds = (len(PROMPT), len(head), len(turn2) - 3)
    second = h.submit(turn2, "s", max_tokens=3, boundaries=bounds)
    h.run()
    branch = h.submit(turn2[:bounds[-1]] + (20, 21), "s", max_tokens=3, boundaries=bounds)
    h.run()
    h.check()
    assert h.request(branch).plan.kind == "PrivateAnchor"
    return [h.request(r).outputs for r in (first, second, branch)]


def test_an_anchored_next_turn_in_one_forward_gives_the_torch_paths_tokens():
    want = _anchored("mtp")   # (the hidden states kept too; the interpreter is slow)
    with override(interpret_on_cpu=True):
        got = _anchored("mtp")
    assert got == want


def test_verify_rounds_through_the_skinny_kernels_give_the_torch_paths_tokens(monkeypatch):
    # the flag `skinny_rows` 4 (the GPU bench's `skinny_rows` row): a verify of 3 positions
    # (and a prefill of up to 4) takes the folded path (norms and residuals inside the
    # GEMMs) too
    from kernels import skinny
    _, want = _conversation("mtp")
    rows, launch = [], skinny._launch

    def counting(x, w, **kw):
        rows.append(x.numel() // x.shape[-1])
        return launch(x, w, **kw)
    monkeypatch.setattr(skinny, "_launch", counting)
    with override(interpret_on_cpu=True, skinny_rows=4):
        _, got = _conversation("mtp")
    assert got == want
    assert 3 in rows  # the verifies of 2 drafts (3 positions) went through them


@pytest.mark.parametrize("slots", [[4, 1], [4]])  # one lane: the conv folds into the GEMM
def test_a_one_token_step_updates_only_its_lanes_slots(on_cpu, slots):
    model = _model_with_random_states(1)
    net, c = model.net, model.config
    before = {i: (model.conv[i].clone(), model.recurrent[i].clone()) for i in model.conv}
    n = len(slots)
    ids, pos = torch.tensor([[5], [7]][:n]), torch.tensor([[3], [3]][:n])
    tables = [[0, 1], [2, 3]][:n]
    # the torch path on copies of slots 4 and 1
    from ninfer.model.gdn import GDNState
    from ninfer.model.hybrid import HybridState
    from ninfer.model.torch_model import PagedKV
    idx = torch.tensor(slots)
    copies = {i: GDNState(before[i][0][idx], before[i][1][idx]) for i in model.conv}
    with override(interpret_on_cpu=False):
        ref = net.forward(ids, pos, HybridState(copies, PagedKV(model.kv_k, model.kv_v, 4,
                                                                tables)))
    got = net.forward(ids, pos, model._state(slots, tables))
    assert torch.allclose(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
    for i in model.conv:
        for pool, new, old in ((model.conv[i], ref.state.gdn[i].conv, before[i][0]),
                               (model.recurrent[i], ref.state.gdn[i].recurrent, before[i][1])):
            assert torch.allclose(pool[idx], new.to(pool.dtype), atol=1e-4, rtol=1e-4)
            untouched = [s for s in range(6) if s not in slots]
            assert torch.equal(pool[untouched], old[untouched])
    assert c.linear_layers


def test_a_conv_that_cannot_fold_into_the_projection_is_refused(on_cpu):
    """Two rows take no skinny GEMM: the conv must not be dropped on the floor."""
    model = _factory(16, 4, 6)
    layer = model.net.model.layers[model.config.linear_layers[0]]
    gdn = layer.linear_attn
    conv = (model.conv[model.config.linear_layers[0]], torch.tensor([0, 1]),
            gdn.conv1d.weight.squeeze(1))
    x = torch.randn(2, 1, model.config.hidden_size)
    with pytest.raises(ValueError, match="conv folds only"):
        gdn._project(x, layer.input_layernorm, conv=conv)
    with pytest.raises(ValueError, match="conv folds only"):
        gdn._project(x[:1], None, conv=conv)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_packed_projections_equal_the_checkpoints_layout(family):
    """The device path's one GEMM into [q | k | v | z | b | a] gives what the checkpoint's
    projections give, in either family's packing; a weight changed in place is repacked."""
    from ninfer.model.gdn import GatedDeltaNet
    from ninfer.model.tiny import tiny_config
    torch.manual_seed(0)
    layer = GatedDeltaNet(tiny_config(family))
    for p in layer.parameters():
        p.data.normal_()
    x = torch.randn(2, 3, layer.in_proj_ba.in_features if family == "qwen3_next"
                    else layer.in_proj_a.in_features)
    want = layer._project(x)
    with override(interpret_on_cpu=True):
        got = layer._project(x)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    proj = layer.in_proj_ba if family == "qwen3_next" else layer.in_proj_b
    with torch.no_grad():
        proj.weight.mul_(2)
    want = layer._project(x)
    with override(interpret_on_cpu=True):
        assert torch.allclose(layer._project(x)[2], want[2], atol=1e-5)  # repacked


@pytest.mark.parametrize("rows", [1, 2])  # one row: the LM head's GEMM folds the keys in
def test_a_forward_fed_by_decode_start_gives_the_same_logits_and_their_greedy_keys(on_cpu,
                                                                                    rows):
    """What a decode graph runs (its first kernel's embedding rows and rotary angles, the
    greedy keys made on the device) gives the plain forward's logits, and the keys name
    their argmax."""
    from kernels import greedy
    from ninfer.model.gdn import GDNState
    from ninfer.model.hybrid import HybridState
    from ninfer.model.layers import _inv_freq
    from ninfer.model.torch_model import PagedKV
    model = _model_with_random_states(3)
    net, c = model.net, model.config
    ids, pos = torch.tensor([[5], [9]])[:rows], torch.tensor([[6], [2]])[:rows]
    tables = [[0, 1], [2, 3]][:rows]

    def state():
        gdn = {i: GDNState(model.conv[i][:rows].clone(), model.recurrent[i][:rows].clone())
               for i in model.conv}
        return HybridState(gdn, PagedKV(model.kv_k, model.kv_v, 4, tables))

    want = net.forward(ids, pos, state())
    keys = torch.full((rows,), greedy.KEY_NONE)
    keys[0] = greedy.greedy_keys_reference(torch.randn(1, 9))[0]  # left by a replay before
    inv = _inv_freq(c.rotary_dim, float(c.rope_theta), torch.float32, torch.device("cpu"))
    h, cos, sin = greedy.decode_start(ids, pos, keys, net.model.embed_tokens.weight, inv)
    got = net.forward(ids, pos, state(), embedded=(h, (cos, sin)), greedy=keys)
    assert torch.allclose(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert greedy.token_of(keys).tolist() == got.logits[:, -1].argmax(-1).tolist()


def test_a_verify_reads_the_lanes_slots_in_place_as_their_gathered_copy(on_cpu):
    # the flag `verify_in_place`: the conv and step kernels read the slot pools by index;
    # the same logits and per-position states as from a gathered copy, and the pools
    # untouched
    from ninfer.model.protocol import Lane
    got = {}
    for in_place in (False, True):
        model = _model_with_random_states(3)
        model.init_slot(Lane(slot=1, attn_blocks=[3]))  # another lane's slot, zeroed
        pools = [t.clone() for d in (model.conv, model.recurrent) for t in d.values()]
        lane = Lane(slot=4, attn_blocks=[0, 1, 2])
        with override(verify_in_place=in_place):
            out = model.forward_batch([(lane, [5, 6, 7], 4)], per_position=True)[0]
        states, row, _ = out.states[0]
        got[in_place] = (out.logits, [(states.states[j].conv[row],
                                       states.states[j].recurrent[row]) for j in model.conv])
        assert all(torch.equal(a, b) for a, b in zip(
            pools, [t for d in (model.conv, model.recurrent) for t in d.values()], strict=True))
    torch.testing.assert_close(got[True], got[False], rtol=0, atol=0)
