"""The L2 prefetcher's plan (`kernels.prefetch`): which bytes it asks for, and when. The
prefetches themselves change no value (the CUDA engine tests run the decode graphs with
and without them); what can go wrong is the plan: a byte fetched twice or never, a chunk
released before the step is within `ahead` bytes of it (it would be evicted before use),
or a forward whose GEMMs are not the recorded ones (the prefetcher would wait for a count
that never comes)."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels import prefetch
from kernels.prefetch import L2Plan

sizes = st.lists(st.integers(1, 64).map(lambda n: 16 * n), min_size=1, max_size=12)


@given(sizes, st.integers(1, 40).map(lambda n: 16 * n), st.sampled_from([1, 3, 8]),
       st.sets(st.integers(0, 11), max_size=3))
def test_pieces_cover_the_stream_once_and_release_within_ahead(calls, ahead, per_piece, out):
    """Scaled down: LARGEST of 512 bytes, pieces of THREADS chunks of 16 bytes; weights in
    `out` are left out of the stream (too large, or not where a bulk prefetch can name)."""
    chunk = per_piece * 16 // prefetch.THREADS or 1
    plan = L2Plan(ahead, chunk=chunk)
    plan.calls = [((1 << 20) * (i + 1) + (8 if i in out and n <= 512 else 0), n)
                  for i, n in enumerate(calls)]
    with patch.object(prefetch, "LARGEST", 512):
        pieces = plan.pieces()
        kept = [prefetch.streamed(a, n) for a, n in plan.calls]
    assert kept == [n <= 512 and i not in out for i, n in enumerate(calls)]
    want = [addr + off for (addr, n), k in zip(plan.calls, kept, strict=True) if k
            for off in range(0, n, 16)]
    got = [a + off for a, n, _ in pieces for off in range(0, n, 16)]
    assert got == want  # every streamed byte once, in the order the step reads them
    assert all(0 < n <= prefetch.THREADS * chunk for _, n, _ in pieces)
    starts, pos, owner = [], 0, {}  # each call's start in the stream, each byte's GEMM
    for i, ((addr, n), k) in enumerate(zip(plan.calls, kept, strict=True)):
        starts.append(pos)
        owner.update({addr + off: i for off in range(0, n, 16)} if k else {})
        pos += n if k else 0
    releases = [r for *_, r in pieces]
    assert releases == sorted(releases)
    offset = 0
    for (addr, n, release) in pieces:
        # released once GEMM `release - 1` has begun: the first within ahead of the piece,
        # else the piece's own; never after its own GEMM has begun
        own = owner[addr]
        assert release <= own + 1
        if release:
            assert starts[release - 1] + ahead >= offset or release == own + 1
            assert release == 1 or starts[release - 2] + ahead < offset
        else:  # at once: within ahead of the step's start, or the first GEMM's own
            assert offset <= starts[0] + ahead or own == 0
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
