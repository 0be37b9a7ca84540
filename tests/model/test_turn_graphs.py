"""A next turn's delta as a turn graph computes it (`ninfer.model.turn_graphs`), checked on
the CPU: the forward padded to `TOKENS` tokens, its padding's KV in the scratch block, gives
the unpadded forward's logits, hidden states and kept states; only the states asked for
are kept; and which forwards a graph takes. The replay itself is checked on CUDA
(tests/model/test_cuda_engine.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from ninfer.model.gdn import GDNState
from ninfer.model.graphs import WIDTHS
from ninfer.model.protocol import KeptOnly, Lane, MissingStatePart
from ninfer.model.spec_graphs import MAX_TOKENS
from ninfer.model.torch_model import PagedKV, TorchModel
from ninfer.model.turn_graphs import PICKS, TOKENS, TurnGraphs, turn_forward

from .nets import tiny_net

BS = 16


def _model() -> TorchModel:
    return TorchModel(copy.deepcopy(tiny_net(torch.float64)), num_blocks=32, block_size=BS,
                      num_slots=4, identity="tiny", device="cpu")


def test_the_padded_forward_gives_the_unpadded_ones_outputs_at_its_positions():
    model = _model()
    lane = Lane(slot=1, attn_blocks=[5, 6, 7])  # positions 0 .. 47
    model.init_slot(lane)
    prefix = [(i * 11 + 2) % 50 for i in range(30)]
    model.accept(lane, model.forward(lane, prefix, 0).states[-1])
    delta = [(i * 5 + 1) % 50 for i in range(13)]  # positions 30 .. 42; padding to 61
    eager = model.forward(lane, delta, 30, per_position=True)
    before = {i: (model.kv_k[i].clone(), model.kv_v[i].clone()) for i in model.kv_k}

    ids = torch.zeros(1, TOKENS, dtype=torch.long)
    ids[0, :len(delta)] = torch.tensor(delta)
    tables = torch.full((1, 8), model.scratch_block)
    tables[0, :3] = torch.tensor(lane.attn_blocks)
    at = torch.tensor([model._at(lane.slot)])
    gdn = {i: GDNState(model.conv[i][at], model.recurrent[i][at]) for i in model.conv}
    picks = torch.tensor([12, 3, 7, 12])
    logits, hidden, kept = turn_forward(model.net, ids, 30 + torch.arange(TOKENS)[None], gdn,
                                        PagedKV(model.kv_k, model.kv_v, BS, tables), picks)

    torch.testing.assert_close(logits, eager.logits[12])
    torch.testing.assert_close(hidden[0, :13], eager.hidden)
    for column, position in enumerate(picks.tolist()):
        out, row, index = eager.states[position]
        for layer, states in kept.items():
            torch.testing.assert_close(states.conv[0, column], out.states[layer].conv[row, index])
            torch.testing.assert_close(states.recurrent[0, column],
                                       out.states[layer].recurrent[row, index])
    # the padding's KV: past the delta in the lane's last block, then in the scratch block;
    # the lane's positions up to the delta's end are as the eager forward left them
    for layer, (k, _) in before.items():
        lane_k = model.kv_k[layer][lane.attn_blocks].reshape(48, *k.shape[2:])
        torch.testing.assert_close(lane_k[:43], k[lane.attn_blocks].reshape(48, *k.shape[2:])[:43])
        assert not torch.equal(model.kv_k[layer][model.scratch_block], k[model.scratch_block])
        assert torch.equal(model.kv_k[layer][8:model.scratch_block], k[8:model.scratch_block])


def test_only_the_kept_states_can_be_picked():
    # what a turn graph returns for a forward of 21 positions that kept 20 (its end), 9, 15
    entries = [None] * 21
    for column, position in enumerate((20, 9, 15)):
        entries[position] = ("holder", 0, column)
    kept = KeptOnly(entries, {20, 9, 15})
    assert kept[-1] == ("holder", 0, 0) and len(kept) == 21
    assert kept[9][2] == 1 and kept[15][2] == 2
    with pytest.raises(MissingStatePart, match="position 10"):
        kept[10]
    with pytest.raises(IndexError):
        kept[21]


def test_a_graph_takes_one_lanes_delta_longer_than_a_verify_with_few_reads():
    graphs = TurnGraphs(_model(), pool=None)
    lane = Lane(slot=0, attn_blocks=list(range(3)))
    assert graphs.fits([lane], MAX_TOKENS + 1, 30, [2])
    assert graphs.fits([lane], TOKENS, 30, list(range(PICKS - 1)) + [TOKENS - 1])
    assert not graphs.fits([lane], MAX_TOKENS, 30, [2])           # a verify graph's
    assert not graphs.fits([lane], TOKENS + 1, 30, [2])           # longer than a graph
    assert not graphs.fits([lane], 20, 30, None)                  # any state may be read
    assert not graphs.fits([lane], 20, 30, list(range(PICKS)))    # more than it keeps
    assert not graphs.fits([lane, lane], 20, 30, [2])             # two lanes
    assert not graphs.fits([lane], 20, WIDTHS[-1] * BS - TOKENS + 1, [2])  # past the widest
    assert graphs.width(lane, 30) == 4 and graphs.width(Lane(slot=0, attn_blocks=[0] * 9), 30) == 9


class _Spy(TurnGraphs):
    """Records the forwards a turn graph is asked to replay; answers with a greedy token
    no eager forward of the tiny net gives (its vocabulary is 50 tokens)."""

    def __init__(self, model) -> None:
        super().__init__(model, pool=None)
        self.replayed: list[tuple[int, int]] = []

    def run(self, lane, tokens, start, reads):
        n = len(tokens)
        self.replayed.append((n, start))
        states: list = [None] * n
        states[n - 1] = ("holder", 0, 0)
        return 999, torch.zeros(50), torch.zeros(n, 8), KeptOnly(states, {n - 1})


@pytest.mark.parametrize("n, replayed", [(MAX_TOKENS, False), (MAX_TOKENS + 1, True),
                                         (TOKENS, True), (TOKENS + 1, False)])
def test_a_prompts_short_last_piece_replays_a_turn_graph(n, replayed):
    """A prefill's piece of MAX_TOKENS + 1 .. TOKENS tokens with nothing to keep inside (a
    chat prompt's last: the generation prompt after its message's end, 9 tokens with
    thinking off) is a turn graph's replay, as a next turn's delta is: eager, those few
    tokens cost ~20 ms of launches on anchor-1b. Longer pieces, and shorter ones (the
    verify graphs' lengths), stay eager, as does a forward whose reads are not said."""
    model = _model()
    model.turn_graphs = spy = _Spy(model)
    lane = Lane(slot=1, attn_blocks=[5, 6, 7, 8])
    model.init_slot(lane)
    model.accept(lane, model.forward(lane, [3] * 20, 0).states[-1])
    out = model.forward(lane, [(i * 7 + 1) % 50 for i in range(n)], 20, reads=[])
    assert spy.replayed == ([(n, 20)] if replayed else [])
    assert (out.greedy[-1] == 999) is replayed
    spy.replayed.clear()
    model.forward(lane, [1] * n, 20)   # reads not said: any state may be read
    assert spy.replayed == []


def test_a_prefill_chunk_in_parts_is_the_forward_and_leaves_the_slot_until_accept():
    """`forward_steps` of an eager prefill chunk: a part a layer, the same greedy token,
    logits and state as `forward`; the slot is not written until `accept`, so a forward
    closed after a few parts leaves the lane where it was."""
    model = _model()
    lane = Lane(slot=1, attn_blocks=[5, 6, 7, 8])
    model.init_slot(lane)
    tokens = list(range(3, 43))   # 40 tokens: past a turn graph's, an eager chunk
    slot = [t.clone() for d in (model.conv, model.recurrent) for t in d.values()]
    whole = model.forward(lane, tokens, 0)
    steps = model.forward_steps(lane, tokens, 0)
    parts = 0
    while True:
        try:
            next(steps)
            parts += 1
        except StopIteration as done:
            out = done.value
            break
    assert parts == model.net.config.num_hidden_layers
    assert out.greedy[-1] == whole.greedy[-1] and out.greedy[:-1] == [None] * 39
    torch.testing.assert_close(out.logits, whole.logits, rtol=0, atol=0)
    unchanged = [t for d in (model.conv, model.recurrent) for t in d.values()]
    assert all(torch.equal(a, b) for a, b in zip(slot, unchanged, strict=True))
    cut = model.forward_steps(lane, tokens, 0)
    next(cut), next(cut)
    cut.close()
    assert all(torch.equal(a, b) for a, b in zip(
        slot, [t for d in (model.conv, model.recurrent) for t in d.values()], strict=True))
    model.accept(lane, out.states[-1])
    other = Lane(slot=2, attn_blocks=[5, 6, 7, 8])
    model.init_slot(other)
    model.accept(other, whole.states[-1])
    assert model.parts_match(model.read_parts(lane, 40, 0), model.read_parts(other, 40, 0)) \
        is None
    # a per-position forward (a verify, a piece with stops kept) and one token are one part
    for per_position, n in ((True, 20), (False, 1)):
        steps = model.forward_steps(lane, tokens[:n], 40, per_position)
        with pytest.raises(StopIteration):
            next(steps)
