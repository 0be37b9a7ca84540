"""`ninfer.bench.gpu_engine`'s removal_bounds_b1 row: each variant decodes with exactly the
kernels it names left out, and the real kernels are back afterwards (the rows after it in
the same run must time the whole step), also when a variant fails. No GPU: the bench's
decode is a stand-in that records which kernels it would have captured."""

from types import SimpleNamespace

import pytest
import torch

import kernels
from kernels import decode_attention
from ninfer.bench import gpu_engine

dev = kernels.device_kernels()
pytestmark = pytest.mark.skipif(dev is None, reason="needs Triton")


class _Graphs:
    graphs: dict = {}

    def drop_ahead(self):
        pass


def _bench(decode):
    model = SimpleNamespace(graphs=_Graphs(), verify_graphs=None)
    return SimpleNamespace(om=SimpleNamespace(model=model), decode=decode)


FULL = (dev.step, decode_attention.merge_splits, dev.decode_attention) if dev else None


def _left_out() -> tuple[bool, bool, bool]:
    """Which of the GDN step, the merge and the attention are stand-ins now; a stand-in
    hands the GEMM after it the projection's own channels (v, q) without a launch."""
    left = (dev.step is not FULL[0], decode_attention.merge_splits is not FULL[1],
            dev.decode_attention is not FULL[2])
    if left[0]:
        v = torch.zeros(1, 1, 2, 4)
        assert dev.step(None, None, v) is v
    if left[2]:  # o_proj reads q: the first heads * head_dim channels
        y = torch.arange(32, dtype=torch.float32).view(1, 1, -1)
        assert torch.equal(dev.decode_attention(y, 2, 1, 4).flatten(), y[0, 0, :8])
    return left


def test_each_variant_leaves_out_what_it_names_and_the_kernels_come_back():
    seen: list[tuple[bool, bool, bool]] = []
    pace = {(False, False, False): 1000.0, (True, False, False): 1100.0,
            (False, True, False): 1010.0, (False, False, True): 1050.0,
            (True, False, True): 1200.0}

    def decode(batch, tokens):
        state = _left_out()
        seen.append(state)
        return {"tok_s": pace[state]}

    out = gpu_engine.removal_bounds_row(_bench(decode), rounds=1)
    assert set(seen) == set(pace)  # every variant ran, each as it names
    assert out["no_gdn_step"]["tok_s"] == 1100.0 and out["full"]["tok_s"] == 1000.0
    assert out["no_gdn_step_no_attention"]["saves_us_a_token"] == pytest.approx(
        1e6 / 1000 - 1e6 / 1200)
    assert (dev.step, decode_attention.merge_splits, dev.decode_attention) == FULL


def test_the_kernels_come_back_when_a_variant_fails():
    def decode(batch, tokens):
        if dev.step is not FULL[0]:
            raise RuntimeError("a capture failed")
        return {"tok_s": 1000.0}

    with pytest.raises(RuntimeError):
        gpu_engine.removal_bounds_row(_bench(decode), rounds=1)
    assert (dev.step, decode_attention.merge_splits, dev.decode_attention) == FULL
