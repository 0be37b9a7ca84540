"""The CPU path's dtype shortcuts decide what torch would (the float64 reference runs and
the float32 CPU model rely on it)."""

import torch

from ninfer.model.layers import cast, compute_dtype


def test_cast_and_compute_dtype_agree_with_torch():
    x = torch.ones(2, dtype=torch.float32)
    assert cast(x, torch.float32) is x
    assert cast(x, torch.float64).dtype == torch.float64
    assert torch.equal(cast(x, torch.float64), x.to(torch.float64))
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64):
        assert compute_dtype(torch.ones(1, dtype=dtype)) == torch.promote_types(
            dtype, torch.float32)
