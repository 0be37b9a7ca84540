"""`ninfer bench kernels` (a GPU): our Triton kernels against fla-core and the torch
references at equal shapes, each baseline measured again in this run.

- GDN chunked prefill, T = 4K and 16K, Hk 16 / Hv 32 heads of 128, bf16: ours vs fla's
  `chunk_gated_delta_rule` (native grouped value heads) vs the torch reference.
- GDN decode step, batch 1 and 8, same heads: ours (state updated in place in a slot pool)
  vs fla's `fused_recurrent_gated_delta_rule`, both inside CUDA graphs (STEPS calls per
  graph, time per call), with the bytes each step must move against the copy bandwidth.
- Speculative verify (T = 4 positions, every state kept) vs a plain step.
- Causal conv1d update and paged attention decode (the 0.73B model's shapes) against torch.

Times: CUDA events around graph replays, or triton.testing.do_bench (median, L2 flushed).
"""

from __future__ import annotations

import sys

import torch

from .report import write_line

HK, HV, D = 16, 32, 128
STEPS = 32           # decode calls per captured graph (launch overhead amortised away)
GRAPH_REPLAYS = 50


def _bench(fn) -> float:
    """Median milliseconds of fn() (L2 flushed between calls)."""
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_ms(step, steps: int = STEPS, replays: int = GRAPH_REPLAYS, runs: int = 1) -> float:
    """Milliseconds per call of `step()` replayed `steps` times inside one CUDA graph:
    `replays` replays timed together, the best of `runs` such timings."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()  # compile and warm before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            step()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / (replays * steps))
    return best


def copy_bandwidth() -> float:
    """Device copy rate in bytes/s, counting read + write (the roofline's denominator)."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def _gdn_inputs(B: int, T: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, device="cuda", generator=g)
    q = torch.nn.functional.normalize(r(B, T, HK, D), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(r(B, T, HK, D), dim=-1).to(dtype)
    v = r(B, T, HV, D).to(dtype)
    gate = -torch.nn.functional.softplus(r(B, T, HV)).float() * 0.1
    beta = torch.sigmoid(r(B, T, HV)).float()
    return q, k, v, gate, beta


def _rel(x, ref) -> float:
    """max |x - ref| / max |ref|, in float32."""
    return float((x.float() - ref.float()).abs().max() / ref.float().abs().max())


def bench_prefill(results: dict) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    from kernels.gdn_chunk import chunk_gated_delta_rule as ours
    from kernels.gdn_reference import chunk_gated_delta_rule as reference
    for T in (4096, 16384):
        q, k, v, g, beta = _gdn_inputs(1, T)
        h0 = torch.zeros(1, HV, D, D, device="cuda")
        o_ours, s_ours = ours(q, k, v, g, beta, initial_state=h0)
        o_fla, s_fla = fla_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        err = float((o_ours.float() - o_fla.float()).abs().max() / o_fla.float().abs().max())
        t_ours = _bench(lambda q=q, k=k, v=v, g=g, beta=beta, h0=h0:
                        ours(q, k, v, g, beta, initial_state=h0))
        t_fla = _bench(lambda q=q, k=k, v=v, g=g, beta=beta, h0=h0:
                       fla_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        o_ref, _ = reference(q.float(), k.float(), v.float(), g, beta, initial_state=h0)
        end.record()
        torch.cuda.synchronize()
        t_ref = start.elapsed_time(end)
        key = f"prefill_T{T // 1024}k"
        results[key] = {"ours_ms": t_ours, "fla_ms": t_fla, "torch_reference_ms": t_ref,
                        "ours_over_fla": t_fla / t_ours, "max_rel_diff_vs_fla": err,
                        # both against the float32 torch reference on the same inputs
                        "ours_rel_err": _rel(o_ours, o_ref), "fla_rel_err": _rel(o_fla, o_ref),
                        "state_rel_diff_vs_fla": float((s_ours - s_fla).abs().max()
                                                       / s_fla.abs().max())}


def _decode_case(B: int, bandwidth: float) -> dict:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_step

    from kernels.gdn_decode import fused_recurrent_gated_delta_rule as ours
    q, k, v, g, beta = _gdn_inputs(B, 1)
    pool = torch.randn(B + 3, HV, D, D, device="cuda") * 0.01
    slots = torch.arange(B, device="cuda", dtype=torch.int32) + 2
    state = pool[2:2 + B].clone()
    t_ours = graph_ms(lambda: ours(q, k, v, g, beta, pool, state_indices=slots))
    t_fla = graph_ms(lambda: fla_step(q, k, v, g, beta, initial_state=state,
                                       output_final_state=True))
    state_bytes = 2 * B * HV * D * D * 4  # read + write the fp32 state
    # a verify of k=3 drafts: 4 positions, the state after each kept for the rollback
    q4, k4, v4, g4, b4 = _gdn_inputs(B, 4)
    out = torch.empty(B, 4, HV, D, D, device="cuda")
    t_verify = graph_ms(lambda: ours(q4, k4, v4, g4, b4, pool, state_indices=slots,
                                      all_states=True, out_states=out))
    return {"ours_us": t_ours * 1e3, "fla_us": t_fla * 1e3, "ours_over_fla": t_fla / t_ours,
            "state_bytes": state_bytes, "limit_us": state_bytes / bandwidth * 1e6,
            "ours_bandwidth_TBps": state_bytes / (t_ours / 1e3) / 1e12,
            "verify4_us": t_verify * 1e3, "verify4_over_step": t_verify / t_ours}


def bench_decode(results: dict, bandwidth: float) -> None:
    for B in (1, 8):
        results[f"decode_B{B}"] = _decode_case(B, bandwidth)


def _conv_case(B: int) -> dict:
    from kernels.conv1d import causal_conv1d_update as conv_ours
    from kernels.gdn_reference import causal_conv1d_update as conv_ref
    C, K = 2 * 8 * 128 + 16 * 128, 4  # the 0.73B model's GDN conv channels
    x = torch.randn(B, C, 1, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(B + 2, C, K - 1, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(B, device="cuda", dtype=torch.int32)
    w = torch.randn(C, K, device="cuda", dtype=torch.bfloat16)
    t_ours = graph_ms(lambda: conv_ours(x, pool, w, state_indices=slots))
    tail = pool[:B].clone()
    t_ref = graph_ms(lambda: conv_ref(x, tail, w))
    return {"ours_us": t_ours * 1e3, "torch_us": t_ref * 1e3, "ours_over_torch": t_ref / t_ours}


def _attention_case(B: int, L: int) -> dict:
    from kernels.paged_attention import paged_attention_decode
    Hq, Hkv, Dh, bs = 8, 2, 256, 16  # the 0.73B model's attention
    blocks = B * L // bs + 8
    kc = torch.randn(blocks, bs, Hkv, Dh, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(blocks, device="cuda")[:B * (L // bs)].view(B, -1).int()
    lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    q = torch.randn(B, 1, Hq, Dh, device="cuda", dtype=torch.bfloat16)
    t_ours = graph_ms(lambda: paged_attention_decode(q, kc, vc, tables, lens))
    kk = kc[tables.long()].reshape(B, L, Hkv, Dh).transpose(1, 2)
    vv = vc[tables.long()].reshape(B, L, Hkv, Dh).transpose(1, 2)
    qq = q.transpose(1, 2)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)
    t_sdpa = graph_ms(sdpa)
    got = paged_attention_decode(q, kc, vc, tables, lens)
    return {"ours_us": t_ours * 1e3, "sdpa_contiguous_us": t_sdpa * 1e3,
            "ours_over_sdpa": t_sdpa / t_ours,
            "max_abs_diff": float((got.float() - sdpa().transpose(1, 2).float()).abs().max()),
            "kv_bytes": 2 * B * L * Hkv * Dh * 2}


def bench_conv_and_attention(results: dict) -> None:
    for B in (1, 8):
        results[f"conv1d_B{B}"] = _conv_case(B)
    for B, L in ((1, 4096), (8, 4096)):
        results[f"attention_B{B}_L{L}"] = _attention_case(B, L)


def main(json_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        print("bench kernels: needs a CUDA device", file=sys.stderr)
        return 2
    import triton
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "triton": triton.__version__}
    try:
        import fla
        results["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        print("bench kernels: fla-core is not importable (carry its wheel)", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth()
    results["copy_bandwidth_GBps"] = bandwidth / 1e9
    for name, part in (("prefill", lambda: bench_prefill(results)),
                       ("decode", lambda: bench_decode(results, bandwidth)),
                       ("conv/attention", lambda: bench_conv_and_attention(results))):
        try:
            part()
        except Exception as exc:  # one broken part must not hide the others' figures
            results[f"{name}_error"] = repr(exc)
            print(f"bench kernels: {name} failed: {exc!r}", file=sys.stderr)
    _report(results)
    write_line({"bench": "kernels", "results": results}, json_path)
    return 0


def _report(r: dict) -> None:
    print(f"{r['device']}, torch {r['torch']}, triton {r['triton']}, fla {r.get('fla')}; "
          f"copy {r['copy_bandwidth_GBps']:,.0f} GB/s")
    for key, row in r.items():
        if isinstance(row, dict):
            cells = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in row.items())
            print(f"{key:<22} {cells}")
