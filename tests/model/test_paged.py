"""PagedKV: a lane whose blocks are consecutive reads a slice; any other table gathers. Both
must give the same keys and values."""

import torch

from ninfer.model.torch_model import PagedKV


def test_a_consecutive_run_reads_what_a_gather_reads():
    torch.manual_seed(0)
    k = {3: torch.randn(12, 4, 2, 8)}
    v = {3: torch.randn(12, 4, 2, 8)}
    run = PagedKV(k, v, 4, [[5, 6, 7, 8]])
    assert run.run == 5
    gathered = PagedKV(k, v, 4, [[5, 6, 7, 8], [0]])  # two lanes: the gather path
    assert gathered.run is None
    for length in (1, 4, 9, 16):
        a, b = run.read(3, length), gathered.read(3, length)
        assert torch.equal(a[0], b[0][:1]) and torch.equal(a[1], b[1][:1])
    assert PagedKV(k, v, 4, [[5, 7, 8]]).run is None  # a hole: gather


def test_writes_land_in_the_lane_blocks():
    k = {0: torch.zeros(6, 2, 1, 1)}
    v = {0: torch.zeros(6, 2, 1, 1)}
    kv = PagedKV(k, v, 2, [[4, 1]])
    kv.write(0, torch.tensor([[0, 1, 2]]), torch.ones(1, 3, 1, 1), 2 * torch.ones(1, 3, 1, 1))
    assert k[0][4].flatten().tolist() == [1, 1] and k[0][1].flatten().tolist() == [1, 0]
    keys, values = kv.read(0, 3)
    assert keys.flatten().tolist() == [1, 1, 1] and values.flatten().tolist() == [2, 2, 2]


def test_a_forward_takes_the_kv_length_from_the_host():
    """The model's forwards tell the store one past their last position (`PagedKV.length`),
    so attention reading the KV back does not take it from the positions on the device (a
    sync per attention layer on a GPU): a prefill, a short forward, a batch of two lanes at
    different positions and the MTP layer's forwards run with Tensor.max unusable, and give
    the logits they give when the length comes from the positions."""
    from unittest import mock

    from ninfer.model.protocol import Lane

    from .nets import torch_factory
    plain_init = PagedKV.__init__

    def without_length(self, *args, **kwargs):
        plain_init(self, *args, **kwargs)
        self.length = None

    outs = []
    for patch in (mock.patch.object(PagedKV, "__init__", without_length),
                  mock.patch.object(torch.Tensor, "max", side_effect=AssertionError("a sync"))):
        model = torch_factory(16, 4, 4)
        a = Lane(slot=0, attn_blocks=[0, 1, 2, 3], mtp_blocks=[8, 9, 10])
        b = Lane(slot=1, attn_blocks=[4, 5, 6, 7])
        with patch:
            first = model.forward(a, list(range(1, 10)), 0)
            model.accept(a, first.states[-1])
            second = model.forward(b, [5, 6, 7], 0)
            model.accept(b, second.states[-1])
            both = model.forward_batch([(a, [11, 12], 9), (b, [13, 14], 3)])
            # the MTP layer's attention: a catch-up over positions 0..8, then one more
            span = model.mtp_span(a, 0, first.hidden[:9], list(range(2, 11)))
            one = model.mtp(a, 9, both[0].hidden[0], 12)
        outs.append([first.logits, second.logits, both[0].logits, both[1].logits,
                     span.logits, one.logits])
    for x, y in zip(*outs, strict=True):
        assert torch.equal(x, y)


def test_a_prefill_makes_only_its_last_positions_logits():
    """A prefill (`forward` without per_position) runs the LM head on its last position
    alone: its logits are the full forward's last row, its greedy tokens None but the last;
    a verify-style forward (per position) still makes every position's."""
    from ninfer.model.protocol import Lane

    from .nets import torch_factory
    model = torch_factory(16, 4, 4)
    lane = Lane(slot=0, attn_blocks=[0, 1, 2, 3])
    prefill = model.forward(lane, list(range(1, 10)), 0)
    every = model.forward(lane, list(range(1, 10)), 0, per_position=True)
    assert every.logits.shape[0] == 9 and None not in every.greedy
    assert prefill.logits.shape == (1, every.logits.shape[1])
    torch.testing.assert_close(prefill.logits[0], every.logits[-1], rtol=0, atol=1e-12)
    assert prefill.greedy == [None] * 8 + [every.greedy[-1]]
    assert len(prefill.hidden) == 9  # the MTP layer still gets every hidden state
