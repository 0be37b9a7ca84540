"""The L2 prefetcher's plan (`kernels.prefetch`): which bytes it asks for, and when. The
prefetches themselves change no value (the CUDA engine tests run the decode graphs with
and without them); what can go wrong is the plan: a byte fetched twice or never, a chunk
released before the step is within `ahead` bytes of it (it would be evicted before use),
or a forward whose GEMMs are not the recorded ones (the prefetcher would wait for a count
that never comes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels.prefetch import L2Plan

sizes = st.lists(st.integers(1, 64).map(lambda n: 16 * n), min_size=1, max_size=12)


@given(sizes, st.integers(1, 40).map(lambda n: 16 * n), st.sampled_from([16, 48, 256]))
def test_chunks_cover_the_stream_once_and_release_within_ahead(calls, ahead, chunk):
    plan = L2Plan(ahead, chunk=chunk)
    plan.calls = [(1 << 20) * (i + 1) for i in range(len(calls))]
    plan.calls = [(addr, n) for addr, n in zip(plan.calls, calls, strict=True)]
    chunks = plan.chunks()
    streamed = [(a, n) for a, n in plan.calls if n <= ahead]  # the big ones are left out
    want = [addr + off for addr, n in streamed for off in range(0, n, 16)]
    got = [a + off for a, n, _ in chunks for off in range(0, n, 16)]
    assert got == want  # every streamed byte once, in the order the step reads them
    assert all(0 < n <= chunk for _, n, _ in chunks)
    starts, pos = [], 0  # each call's start in the stream
    for _, n in plan.calls:
        starts.append(pos)
        pos += n if n <= ahead else 0
    releases = [r for *_, r in chunks]
    assert releases == sorted(releases)
    offset = 0
    for (_, n, release) in chunks:
        # released once the GEMM `release - 1` has begun: the first within ahead of it
        if release:
            assert starts[release - 1] + ahead >= offset
            assert release == 1 or starts[release - 2] + ahead < offset
        else:
            assert offset <= starts[0] + ahead
        offset += n


def test_a_forward_that_is_not_the_recorded_one_is_refused():
    plan = L2Plan(1 << 20)
    a, b = torch.zeros(4, 4), torch.zeros(4, 4)
    with plan.recording():
        assert plan.take(a) is None and plan.take(b) is None
    assert plan.calls == [(a.data_ptr(), 64), (b.data_ptr(), 64)]
    plan.progress, plan._mode = torch.zeros(1, dtype=torch.int32), "apply"
    assert plan.take(a) is plan.progress
    with pytest.raises(RuntimeError, match="not the recorded one"):
        plan.take(a)
