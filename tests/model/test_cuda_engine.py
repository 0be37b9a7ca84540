"""The engine on a CUDA device (skipped without one): the Triton kernel path and the CUDA
graphs of decode steps give the CPU float64 reference's tokens (up to near-ties) and keep
every state part exact across reuse (check_reuse)."""

from __future__ import annotations

import copy

import pytest
import torch

from ninfer.engine.engine import EngineConfig
from ninfer.model.torch_model import TorchModel
from ninfer.testing.harness import Harness

from .nets import agree_until_tie, reference, tiny_net

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPT = tuple((i * 7 + 3) % 97 for i in range(29))


def _factory(graphs: bool):
    def make(num_blocks, block_size, num_slots):
        net = copy.deepcopy(tiny_net(torch.float32)).to("cuda")  # the cached one stays put
        model = TorchModel(net, num_blocks=num_blocks, block_size=block_size,
                           num_slots=num_slots, identity="tiny-cuda", device="cuda")
        if not graphs:
            model.graphs = None
        return model
    return make


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_decode_on_cuda_equals_the_reference(spec, graphs):
    h = Harness(EngineConfig(spec=spec, prefill_chunk=8, max_concurrency=3, check_reuse=True),
                model_factory=_factory(graphs))
    ids = [h.submit(PROMPT[i:], f"s{i}", max_tokens=10) for i in range(3)]
    h.run()
    h.check()
    for i, rid in enumerate(ids):  # the same float32 weights, run in float64 on the CPU
        ref, gaps = reference(PROMPT[i:], 10, tiny_net(torch.float32))
        assert agree_until_tie(h.request(rid).outputs, ref, gaps, tie=1e-3)
    if graphs:
        assert h.engine.model.graphs.graphs, "no decode step went through a graph"
    turn2 = PROMPT + tuple(h.request(ids[0]).outputs) + (5, 6)
    again = h.submit(turn2, "s0", max_tokens=6)
    h.run()
    h.check()
    assert h.request(again).plan.kind == "PrivateEndpoint"
