"""A prefill chunk's attention split over the prefix and over the chunk itself, merged by
log-sum-exps, equals the one bottom-right causal call; only the shapes prepared before ready
take it (a plan built on a request would land on its first request); a backend that refuses
the split is given up once, and the whole call answers."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from ninfer.flags import override
from ninfer.model import chunk_attention as ca


def _inputs(T, L, H, Hkv, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, T, D, generator=g)
    k = torch.randn(1, Hkv, L, D, generator=g) * 2  # sharp softmaxes: the merge's weights matter
    v = torch.randn(1, Hkv, L, D, generator=g)
    return q, k, v


@pytest.fixture(autouse=True)
def _fresh():
    ca._refused.clear()
    ca._prepared.clear()
    yield
    ca._refused.clear()
    ca._prepared.clear()


@pytest.mark.parametrize("T,L,H,Hkv", [(1, 9, 4, 4), (5, 6, 4, 2), (16, 80, 8, 2),
                                       (33, 100, 4, 1)])
def test_the_split_equals_the_whole_call(T, L, H, Hkv):
    q, k, v = _inputs(T, L, H, Hkv)
    scale = q.shape[-1] ** -0.5
    want = ca.whole_attention(q, k, v, scale)
    got = ca.split_attention(q, k, v, scale, ca.cpu_half)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ca._prepared.add(ca._shape(q, k))  # prepared: the chunk's attention is the split
    got = ca.chunk_attention(q, k, v, scale, half=ca.cpu_half)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the whole call itself: query i sees keys up to L - T + i
    i = T - 1 if T == 1 else T // 2
    seen = L - T + i + 1
    kk, vv = (t.repeat_interleave(H // Hkv, dim=1)[:, :, :seen] for t in (k, v))
    row = torch.softmax(q[:, :, i:i + 1] @ kk.transpose(-1, -2) * scale, dim=-1) @ vv
    torch.testing.assert_close(want[:, :, i:i + 1], row, rtol=1e-5, atol=1e-5)


def test_each_half_weighs_in_by_its_log_sum_exp():
    """Halves merged by plain averaging, or with one weight dropped, differ from the whole:
    the merge is what makes the split right."""
    q, k, v = _inputs(8, 40, 4, 2, seed=3)
    scale = q.shape[-1] ** -0.5
    want = ca.whole_attention(q, k, v, scale)
    o1, _ = ca.cpu_half(q, k[:, :, :32], v[:, :, :32], False, scale)
    o2, _ = ca.cpu_half(q, k[:, :, 32:], v[:, :, 32:], True, scale)
    assert (((o1 + o2) / 2) - want).abs().max() > 1e-2
    assert (o2 - want).abs().max() > 1e-2


def _counting(calls):
    def half(q, k, v, causal, scale):
        calls.append((q.shape[2], k.shape[2], causal))
        return ca.cpu_half(q, k, v, causal, scale)
    return half


def test_only_the_prepared_shapes_take_the_split():
    """`prepare` runs a whole chunk over each whole number of chunks (within the context);
    those shapes split, any other chunk (a last partial one, a next turn's delta at any
    offset) is one call."""
    calls = []
    shapes = ca.prepare(heads=4, kv_heads=2, head_dim=8, chunk=4, max_context=20,
                        device="cpu", dtype=torch.float32, half=_counting(calls))
    assert shapes == [(4, 4), (4, 8), (4, 12), (4, 16)]   # prefix + chunk <= 20
    assert calls == [(4, p, False) if i % 2 == 0 else (4, 4, True)
                     for p in (4, 8, 12, 16) for i in (0, 1)]
    calls.clear()
    for T, L, split in ((4, 12, True), (4, 20, True), (4, 11, False), (3, 11, False),
                        (4, 4, False), (4, 24, False)):
        q, k, v = _inputs(T, L, 4, 2, D=8)
        got = ca.chunk_attention(q, k, v, 0.3, half=_counting(calls))
        assert (len(calls) == 2) == split, (T, L, calls)
        torch.testing.assert_close(got, ca.whole_attention(q, k, v, 0.3), rtol=1e-5,
                                   atol=1e-5)
        calls.clear()
    # a plan is for its heads, head size and dtype too
    for q, k in (_inputs(4, 12, 4, 2, D=16)[:2], _inputs(4, 12, 2, 2, D=8)[:2],
                 (_inputs(4, 12, 4, 2, D=8)[0].double(), _inputs(4, 12, 4, 2, D=8)[1].double())):
        ca.chunk_attention(q, k, k, 0.3, half=_counting(calls))
    assert calls == []
    # at most MAX_PREPARED prefixes, however long the context
    assert len(ca.prepare(heads=2, kv_heads=1, head_dim=4, chunk=2, max_context=1000,
                          device="cpu", dtype=torch.float32, half=ca.cpu_half)) \
        == ca.MAX_PREPARED
    # the CPU has no half of its own: nothing prepared, nothing split
    ca._prepared.clear()
    assert ca.prepare(heads=4, kv_heads=2, head_dim=8, chunk=4, max_context=20,
                      device="cpu", dtype=torch.float32) == []
    assert not ca._prepared


def test_a_refused_split_is_given_up_once_and_the_whole_call_answers(caplog):
    calls = []

    def refusing(q, k, v, causal, scale):
        calls.append(causal)
        raise RuntimeError("cuDNN: no engine for this graph")

    q, k, v = _inputs(4, 12, 4, 2)
    scale = q.shape[-1] ** -0.5
    want = ca.whole_attention(q, k, v, scale)
    ca._prepared.add(ca._shape(q, k))
    with caplog.at_level(logging.WARNING, logger="ninfer.model"):
        for _ in range(3):
            torch.testing.assert_close(ca.chunk_attention(q, k, v, scale, half=refusing), want)
        # and a refusal while preparing prepares nothing more
        assert ca.prepare(heads=4, kv_heads=2, head_dim=8, chunk=4, max_context=20,
                          device="cpu", dtype=torch.float32, half=refusing) == []
    assert calls == [False]   # tried once, not per chunk
    warnings = [r for r in caplog.records if "cuDNN halves failed" in r.getMessage()]
    assert len(warnings) == 1 and "no engine" in warnings[0].getMessage()
    ca._refused.clear()
    calls.clear()
    assert ca.prepare(heads=4, kv_heads=2, head_dim=8, chunk=4, max_context=20,
                      device="cpu", dtype=torch.float32, half=refusing) == []
    assert calls == [False]


def test_no_split_with_the_switch_off():
    calls = []
    q, k, v = _inputs(6, 18, 4, 2)
    ca._prepared.add(ca._shape(q, k))
    with override(split_chunk_attention=False):
        ca.chunk_attention(q, k, v, 0.2, half=_counting(calls))
        assert ca.prepare(heads=4, kv_heads=2, head_dim=8, chunk=6, max_context=30,
                          device="cpu", dtype=torch.float32, half=_counting(calls)) == []
    assert calls == []
    ca.chunk_attention(q, k, v, 0.2, half=_counting(calls))
    assert [c[2] for c in calls] == [False, True]
    # on the CPU no half is chosen by default: the whole call
    torch.testing.assert_close(ca.chunk_attention(q, k, v, 0.2),
                               ca.whole_attention(q, k, v, 0.2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_cudnn_split_of_a_prepared_chunk_equals_the_flash_call():
    """anchor-1b's heads (8 of 256 over 2 KV heads), bf16: a prepared shape takes the
    cuDNN halves and agrees with one flash call to bf16's rounding; one not prepared is
    the flash call itself."""
    shapes = ca.prepare(heads=8, kv_heads=2, head_dim=256, chunk=1024, max_context=4096,
                        device="cuda", dtype=torch.bfloat16)
    assert shapes == [(1024, 1024), (1024, 2048), (1024, 3072)] and not ca._refused
    for T, L in ((1024, 2048), (1024, 3072)):
        g = torch.Generator(device="cuda").manual_seed(L)
        q = torch.randn(1, 8, T, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(1, 2, L, 256, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        want = ca.whole_attention(q, k, v, 256 ** -0.5)
        got = ca.chunk_attention(q, k, v, 256 ** -0.5)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    q = torch.randn(1, 8, 1000, 256, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 2000, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(ca.chunk_attention(q, k, k, 0.0625), ca.whole_attention(q, k, k, 0.0625))


def test_the_whole_call_leaves_cudnn_out(monkeypatch):
    """A chunk with no prefix is plain causal, where SDPA would pick cuDNN on an H100 and
    build a plan for each new length on a served request (~45 ms): the whole call, at any
    length and prefix, runs with cuDNN switched off (the split's halves are cuDNN's, on
    the shapes `prepare` built)."""
    seen = []
    sdpa = ca.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(ca, "F", types.SimpleNamespace(scaled_dot_product_attention=recording))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    ca.prepare(heads=4, kv_heads=2, head_dim=8, chunk=4, max_context=8, device="cpu",
               dtype=torch.float32, half=ca.cpu_half)
    assert seen == []   # the halves only
    for T, L in ((4, 4), (5, 5), (3, 3), (3, 7)):
        q, k, v = _inputs(T, L, 4, 2, D=8)
        ca.chunk_attention(q, k, v, 0.3, half=ca.cpu_half)
        assert seen == [False], (T, L)
        seen.clear()
    assert torch.backends.cuda.cudnn_sdp_enabled()   # left as it was
