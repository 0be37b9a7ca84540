"""The engine on a CUDA device (skipped without one): the Triton kernel path and the CUDA
graphs of decode steps give the CPU float64 reference's tokens (up to near-ties) and keep
every state part exact across reuse (check_reuse)."""

from __future__ import annotations

import copy

import pytest
import torch

from ninfer.engine.engine import EngineConfig
from ninfer.flags import override
from ninfer.model.torch_model import TorchModel
from ninfer.sim.harness import Harness

from .nets import agree_until_tie, attention_chunk_case, reference, tiny_net

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPT = tuple((i * 7 + 3) % 97 for i in range(29))


@pytest.fixture(autouse=True)
def copies():
    """The decode graphs these tests capture copy their inputs between replays, unless a test
    asks for zero-copy staging through the host's ring (`zero_copy`, `ninfer.model.graphs`)."""
    with override(zero_copy=False):
        yield


@pytest.fixture
def zero_copy(request):
    """Zero-copy staging on or off (the test's parameter) for the graphs it captures."""
    with override(zero_copy=request.param):
        yield request.param


def _factory(graphs: bool):
    """graphs: CUDA graphs of decode steps and speculative rounds, or none."""
    def make(num_blocks, block_size, num_slots):
        net = copy.deepcopy(tiny_net(torch.float32)).to("cuda")  # the cached one stays put
        model = TorchModel(net, num_blocks=num_blocks, block_size=block_size,
                           num_slots=num_slots, identity="tiny-cuda", device="cuda")
        if not graphs:
            model.graphs = model.verify_graphs = model.mtp_graphs = model.turn_graphs = None
        return model
    return make


@pytest.mark.parametrize("graphs, zero_copy", [(True, False), (False, False), (True, True)],
                         indirect=["zero_copy"])
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_decode_on_cuda_equals_the_reference(spec, graphs, zero_copy):
    h = Harness(EngineConfig(spec=spec, prefill_chunk=8, max_concurrency=3, check_reuse=True),
                model_factory=_factory(graphs))
    ids = [h.submit(PROMPT[i:], f"s{i}", max_tokens=10) for i in range(3)]
    h.run()
    h.check()
    for i, rid in enumerate(ids):  # the same float32 weights, run in float64 on the CPU
        ref, gaps = reference(PROMPT[i:], 10, tiny_net(torch.float32))
        assert agree_until_tie(h.request(rid).outputs, ref, gaps, tie=1e-3)
    if graphs:
        model = h.engine.model
        assert model.graphs.graphs, "no decode step went through a graph"
        assert all((cap.turn is not None) == zero_copy for cap in model.graphs.graphs.values())
        if spec == "mtp":
            assert model.verify_graphs.graphs, "no verify went through a graph"
            assert model.mtp_graphs.graphs, "no MTP step went through a graph"
    turn2 = PROMPT + tuple(h.request(ids[0]).outputs) + (5, 6)
    again = h.submit(turn2, "s0", max_tokens=6)
    h.run()
    h.check()
    assert h.request(again).plan.kind == "PrivateEndpoint"



@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_an_anchored_next_turn_on_cuda_is_one_forward_and_its_anchors_exact(spec):
    """A served next turn's short delta (the reply's end and the message's end inside it)
    in one forward keeping its states; a branch restored from the message's anchor equals
    the reference (check_reuse: every restored part equals a recomputation)."""
    h = Harness(EngineConfig(spec=spec, prefill_chunk=64, auto_anchors=2, check_reuse=True),
                model_factory=_factory(True))
    first = h.submit(PROMPT, "s", max_tokens=6, boundaries=(len(PROMPT),))
    h.run()
    head = PROMPT + tuple(h.request(first).outputs)
    turn2 = head + tuple(range(40, 60)) + (7, 8, 9)
    bounds = (len(PROMPT), len(head), len(turn2) - 3)
    second = h.submit(turn2, "s", max_tokens=4, boundaries=bounds)
    h.run()
    branch = turn2[:bounds[-1]] + (61, 62)
    third = h.submit(branch, "s", max_tokens=6, boundaries=bounds)
    h.run()
    h.check()
    assert h.request(second).plan.kind == "PrivateEndpoint"
    assert h.engine.model.turn_graphs.graphs, "the delta did not go through a turn graph"
    assert (h.request(third).plan.kind, h.request(third).plan.reuse_base) == (
        "PrivateAnchor", bounds[-1])
    ref, gaps = reference(branch, 6, tiny_net(torch.float32))
    assert agree_until_tie(h.request(third).outputs, ref, gaps, tie=1e-3)


def test_mtp_with_drafting_paused_runs_plain_steps_ahead():
    # the tiny net's random MTP head is nearly always wrong, so drafting pauses; its plain
    # rounds then run the next step ahead (adopted by the next round) and decode the
    # reference's tokens, every part exact across reuse
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=8, max_concurrency=1, check_reuse=True),
                model_factory=_factory(True))
    rid = h.submit(PROMPT, "s", max_tokens=48)
    h.run()
    h.check()
    ref, gaps = reference(PROMPT, 48, tiny_net(torch.float32))
    assert agree_until_tie(h.request(rid).outputs, ref, gaps, tie=1e-3)
    assert h.engine.model.graphs.adopted > 10


@pytest.mark.parametrize("zero_copy", [False, True], indirect=True)
def test_a_step_run_ahead_is_taken_only_when_asked_for_and_leaves_nothing_when_dropped(
        zero_copy):
    """Two models on the same weights, fed the same tokens one step at a time: one runs
    each next step ahead (`ahead=True`), the other does not. Where the next step is the
    greedy one the step run ahead is adopted; where it is not (another token, the lanes in
    another order, the engine writing a lane's slot) it is dropped. Logits and every state
    part agree throughout: a dropped step left nothing behind, an adopted one was the step
    asked for. With zero-copy staging (both models), staging in the first that fails part
    way launches nothing and leaves the graph's turn the host's (the next step runs), and a
    replay the host did not launch through DecodeGraphs puts it out of step: the next step
    raises, touched no lane, and the step after it runs."""
    from ninfer.model.protocol import Lane
    make = _factory(True)
    fast, plain = make(16, 16, 4), make(16, 16, 4)
    lanes = {m: [Lane(slot=s, attn_blocks=[4 * s + j for j in range(4)]) for s in (1, 2)]
             for m in (fast, plain)}
    for m in (fast, plain):
        for lane in lanes[m]:
            m.init_slot(lane)
    tokens, pos = [3, 5], 0
    for step in range(40):
        order = [1, 0] if step % 7 == 3 else [0, 1]  # another batch: the lanes swapped
        outs = {}
        for m in (fast, plain):
            items = [(lanes[m][i], [tokens[i]], pos) for i in order]
            got = m.forward_batch(items, ahead=m is fast)
            outs[m] = [got[order.index(i)] for i in (0, 1)]
            for lane, out in zip(lanes[m], outs[m], strict=True):
                m.accept(lane, out.states[0])
        for a, b in zip(outs[fast], outs[plain], strict=True):
            torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
            assert a.greedy == b.greedy
        # greedy most steps; every fifth step tokens of our own, which no step ahead fed
        tokens = [(o.greedy[0] + (step % 5 == 4)) % 97 for o in outs[plain]]
        pos += 1
        if step == 20:  # the engine writes a lane's slot: a step ahead from it is stale
            for m in (fast, plain):
                m.copy_slot(lanes[m][1].slot, lanes[m][0].slot)
    for lf, lp in zip(lanes[fast], lanes[plain], strict=True):
        assert fast.parts_match(fast.read_parts(lf, pos, 0), plain.read_parts(lp, pos, 0)) \
            is None
    assert (fast.graphs.adopted, fast.graphs.dropped) == (21, 18)  # counted from the loop
    assert plain.graphs.adopted == plain.graphs.dropped == 0
    if not zero_copy:
        return

    def items(m):  # each lane's token of `tokens` at `pos`, as they stand when called
        return [(lane, [t], pos) for lane, t in zip(lanes[m], tokens, strict=True)]

    fast.graphs.drop_ahead()
    scratch, fast.scratch_block = fast.scratch_block, None  # staging fails part way
    with pytest.raises(TypeError):
        fast.forward_batch(items(fast))
    fast.scratch_block = scratch
    outs = {m: m.forward_batch(items(m)) for m in (fast, plain)}
    for a, b in zip(outs[fast], outs[plain], strict=True):
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
    for m in (fast, plain):
        for lane, out in zip(lanes[m], outs[m], strict=True):
            m.accept(lane, out.states[0])
    tokens, pos = [o.greedy[0] for o in outs[plain]], pos + 1
    before = [fast.read_parts(lane, pos, 0) for lane in lanes[fast]]
    fast.graphs.graphs[(2, 64)].graph.replay()  # not counted by the host
    with pytest.raises(RuntimeError, match="out of step"):
        fast.forward_batch(items(fast))
    for lane, parts in zip(lanes[fast], before, strict=True):
        assert fast.parts_match(fast.read_parts(lane, pos, 0), parts) is None
    outs = {m: m.forward_batch(items(m), ahead=m is fast) for m in (fast, plain)}
    for a, b in zip(outs[fast], outs[plain], strict=True):
        torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
        assert a.greedy == b.greedy


def test_verify_and_mtp_graphs_compute_the_eager_forwards():
    """A verify of 2-4 positions for 1-3 lanes (padding lanes in the 4-lane graph) and an
    MTP step, each replayed from a graph and run eagerly on the same model from the same
    storage: the same greedy tokens, logits, hidden states, per-position GDN states and KV
    written (and nothing else written: the KV is put back between the two). What a replay
    hands out is a copy: it stays put when the graph replays again."""
    from ninfer.model.protocol import Lane
    m = _factory(True)(32, 4, 4)
    lanes = [Lane(slot=s, attn_blocks=[8 * s + j for j in range(8)],
                  mtp_blocks=[24 + 2 * s, 25 + 2 * s]) for s in range(3)]
    for lane, start in zip(lanes, (0, 3, 5), strict=True):
        m.init_slot(lane)
        m.accept(lane, m.forward(lane, PROMPT[start:start + 11], 0).states[-1])
    graphs, mtp_graphs = m.verify_graphs, m.mtp_graphs

    def run(items, graph: bool, before=None):
        if before is not None:
            for i in m.kv_k:
                m.kv_k[i].copy_(before[0][i])
                m.kv_v[i].copy_(before[1][i])
        m.verify_graphs = graphs if graph else None
        outs = m.forward_batch(items, per_position=True)
        kv = ({i: t.clone() for i, t in m.kv_k.items()}, {i: t.clone() for i, t in m.kv_v.items()})
        states = []
        for o in outs:
            out, row, _ = o.states[0]
            states += [(out.states[j].conv[row].clone(), out.states[j].recurrent[row].clone())
                       for j in m.conv]
        return outs, kv, states

    for n, B in ((2, 1), (4, 3), (3, 2)):
        items = [(lane, [7 + b, 9, 11, 13][:n], 11) for b, lane in enumerate(lanes[:B])]
        before = ({i: t.clone() for i, t in m.kv_k.items()},
                  {i: t.clone() for i, t in m.kv_v.items()})
        g, g_kv, g_states = run(items, True)
        e, e_kv, e_states = run(items, False, before)
        for a, b in zip(g, e, strict=True):
            assert a.greedy == b.greedy
            torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.stack(list(a.hidden)), torch.stack(list(b.hidden)),
                                       atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g_states, e_states, atol=1e-5, rtol=1e-5)
        scratch = m.scratch_block  # where padding lanes and captures write: not compared
        torch.testing.assert_close([{i: t[:scratch] for i, t in d.items()} for d in g_kv],
                                   [{i: t[:scratch] for i, t in d.items()} for d in e_kv],
                                   atol=1e-5, rtol=1e-5)
    assert {(S, T) for S, T, _ in graphs.graphs} == {(1, 2), (4, 4), (2, 3)}
    kept = g[0].logits.clone()
    run([(lanes[0], [1, 2, 3], 11), (lanes[1], [4, 5, 6], 11)], True)  # (2, 3) again
    assert torch.equal(g[0].logits, kept), "a replay wrote into logits handed out before"

    lane, hidden = lanes[1], e[1].hidden[0]
    before = {i: t.clone() for i, t in m.mtp_k.items()}
    m.mtp_graphs = mtp_graphs
    got = m.mtp(lane, 5, hidden, 42)
    got_kv = {i: t.clone() for i, t in m.mtp_k.items()}
    chained = m.mtp(lane, 6, got.hidden, got.token)  # the graph replays into its outputs
    m.mtp_graphs = None
    for i in m.mtp_k:
        m.mtp_k[i].copy_(before[i])
    want = m.mtp(lane, 5, hidden, 42)
    assert mtp_graphs.graphs and got.token == want.token
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close({i: t[:scratch] for i, t in got_kv.items()},
                               {i: t[:scratch] for i, t in m.mtp_k.items()}, atol=1e-5, rtol=1e-5)
    again = m.mtp(lane, 6, want.hidden, want.token)
    assert chained.token == again.token
    torch.testing.assert_close(chained.logits, again.logits, atol=1e-5, rtol=1e-5)

    # a catch-up of 4 entries (a round whose 3 drafts were accepted; positions 3-6 of the
    # lane's 8): one replay of a span graph, computing what the eager forward computes
    hs, tokens = [hidden * (1 + i / 4) for i in range(4)], [42, 43, 44, 45]
    for i in m.mtp_k:
        m.mtp_k[i].copy_(before[i])
    m.mtp_graphs = mtp_graphs
    got = m.mtp_span(lane, 3, hs, tokens)
    got_kv = {i: t.clone() for i, t in m.mtp_k.items()}
    m.mtp_graphs = None
    for i in m.mtp_k:
        m.mtp_k[i].copy_(before[i])
    want = m.mtp_span(lane, 3, hs, tokens)
    assert any(T == 4 for T, _ in mtp_graphs.graphs) and got.token == want.token
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close({i: t[:scratch] for i, t in got_kv.items()},
                               {i: t[:scratch] for i, t in m.mtp_k.items()}, atol=1e-5, rtol=1e-5)


def test_a_step_without_outputs_copies_none_and_its_step_ahead_serves_only_its_like():
    """A greedy step that reads only the greedy tokens (`outputs=False`) gets no logits or
    hidden states; the step it runs ahead, also without them, is dropped by a caller that
    wants them (and the step launched again gives the plain model's logits), and adopted by
    one that does not. A step run ahead with them serves either."""
    from ninfer.model.protocol import Lane
    make = _factory(True)
    fast, plain = make(16, 16, 4), make(16, 16, 4)
    lane = {m: Lane(slot=1, attn_blocks=[4, 5, 6, 7]) for m in (fast, plain)}
    for m in (fast, plain):
        m.init_slot(lane[m])
    token = 3
    for pos, outputs in enumerate([False, True, False, False, True, True]):
        got = fast.forward_batch([(lane[fast], [token], pos)], ahead=True, outputs=outputs)[0]
        want = plain.forward_batch([(lane[plain], [token], pos)])[0]
        for m, out in ((fast, got), (plain, want)):
            m.accept(lane[m], out.states[0])
        assert got.greedy == want.greedy
        assert (got.logits is None) == (got.hidden == [None]) == (not outputs)
        if outputs:
            torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got.hidden[0], want.hidden[0], atol=1e-4, rtol=1e-4)
        token = want.greedy[0]
    # steps run ahead without outputs, at 0 and 3, dropped by the callers wanting them at
    # 1 and 4; the others adopted
    assert (fast.graphs.adopted, fast.graphs.dropped) == (3, 2)
    assert fast.parts_match(fast.read_parts(lane[fast], 6, 0),
                            plain.read_parts(lane[plain], 6, 0)) is None


def test_a_bf16_prefill_chunk_attends_as_the_float32_path():
    """On the GPU a bf16 prefill chunk takes `_prefill_chunk` (the flash kernel, the causal
    mask aligned to the chunk's end): what the float32 path makes of the same bf16 inputs,
    within bf16's rounding (tests/model/test_model.py checks the same on the CPU)."""
    attn, q, store, positions = attention_chunk_case("cuda")
    x = torch.zeros(1, q.shape[1], 1, device="cuda", dtype=torch.bfloat16)
    out = attn._attend(x, q, positions, store, 0)
    ref = attn._attend(x.float(), q.float(), positions, store.to(torch.float32), 0)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_a_sampled_request_on_cuda_draws_and_a_seed_repeats(spec):
    """A request's generator lives on the CPU (a seed draws alike on every device); the
    GPU's probabilities are drawn from there: the engine once stopped on the first sampled
    token on CUDA ("Expected a 'cuda' device type for generator")."""
    from ninfer.engine.engine import Submit
    from ninfer.lifecycle.request import SamplingParams
    outputs = []
    for _ in range(2):
        h = Harness(EngineConfig(spec=spec, prefill_chunk=8), model_factory=_factory(True))
        params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, top_k=40, seed=7)
        h.engine.submit(Submit("r", PROMPT, "s", "t", params))
        h.run()
        h.check()
        outputs.append(h.engine.requests["r"].outputs)
    assert len(outputs[0]) == 8 and outputs[0] == outputs[1]


def test_the_allocator_counts_grow_with_a_new_segment():
    """`allocator_counts` (the slow-step log's): a tensor larger than any cached block is
    a new segment."""
    model = _factory(False)(64, 16, 8)
    before = model.allocator_counts()
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")   # 256 MiB
    after = model.allocator_counts()
    assert after[0] > before[0] and after[1] >= before[1]
    del big
