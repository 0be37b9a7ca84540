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
