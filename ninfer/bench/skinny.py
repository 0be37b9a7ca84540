"""`python -m ninfer.bench.skinny [out.json]` (a GPU): the skinny GEMMs (kernels/skinny.py)
against F.linear at anchor-1b's decode shapes, and the model's one-token step with them
and without them, in one run.

- kernels: per shape (anchor-1b's N x K, with the fusion the model uses there) and rows
  M = 1 and 8: F.linear (cuBLAS), the tiling `tiles_for` picks, and the candidate tilings,
  each as a CUDA graph of calls over distinct copies of the weight (more bytes than L2
  holds: the model reads each weight once a step), in us per call and TB/s of weight read.
- model: anchor-1b (make_tiny's preset) with random bf16 weights built on the device (no
  files), decode graphs captured with the flag `skinny_rows` 0 (cuBLAS and the fused
  elementwise kernels: before) and 8 (after), through `ninfer.flags.override`: a graph
  replay at batch 1 and 8 by CUDA events, the engine's `forward_batch` as gpu_engine's
  step_b1_us (replay, host copies and argmax), and how far the logits of the two are apart
  on the same inputs.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from kernels import skinny
from kernels.skinny import Tiles

from ..flags import override
from .report import write_line

# (name, N, K, glu, what the model folds in there)
SHAPES = [("gdn_in_proj", 6176, 1024, False, "norm"), ("attn_qkv", 5120, 1024, False, "norm"),
          ("mlp_gate_up", 3072, 1024, True, "norm"), ("gdn_out_proj", 1024, 2048, False,
                                                      "gated+residual"),
          ("attn_o_proj", 1024, 2048, False, "sigmoid+residual"),
          ("mlp_down", 1024, 3072, False, "residual"), ("lm_head", 151_936, 1024, False,
                                                        "norm+normed")]
ONE_ROW = [Tiles(4, 512), Tiles(8, 512), Tiles(16, 512), Tiles(16, 1024, 8),
           Tiles(8, 512, split=2), Tiles(8, 512, split=4), Tiles(16, 256, dot=True),
           # one step over the whole K (K <= BK): the weights load before the PDL wait
           Tiles(4, 1024), Tiles(8, 1024), Tiles(16, 1024), Tiles(8, 1024, 8),
           Tiles(2, 2048), Tiles(4, 2048), Tiles(4, 2048, 8), Tiles(8, 2048, 8),
           Tiles(2, 4096, 8), Tiles(4, 4096, 8), Tiles(8, 4096, 8), Tiles(8, 4096, 16)]
ROWS = [Tiles(16, 256, dot=True), Tiles(32, 256, dot=True), Tiles(64, 128, dot=True),
        Tiles(16, 512, dot=True), Tiles(16, 256, split=2, dot=True),
        Tiles(16, 256, split=4, dot=True)]
L2_FLUSH_BYTES = 256 * 2**20
CALLS = 32


def _graph_us(call, copies: int) -> float:
    """us per call of call(i), i cycling over the weight copies, CALLS+ calls in a graph."""
    n = max(CALLS, copies)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(copies, 3)):
            call(i)  # compile and warm before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            call(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * n)


def _fused_call(fusion: str, glu: bool, x, w, nw, z, r):
    """The model's call at this shape (its prologue and epilogue), default tiles."""
    if fusion == "norm":
        return lambda: skinny.norm_linear(x, nw, 1e-6, w, glu=glu)
    if fusion == "norm+normed":
        return lambda: skinny.norm_linear(x, nw, 1e-6, w, normed=True)
    if fusion == "gated+residual":
        return lambda: skinny.gated_norm_linear(x.view(*x.shape[:-1], -1, 128),
                                                z.view(*z.shape[:-1], -1, 128), nw[:128],
                                                1e-6, w, r)
    if fusion == "sigmoid+residual":
        return lambda: skinny.gate_linear(x.view(*x.shape[:-1], -1, 256),
                                          z.view(*z.shape[:-1], -1, 256), w, r)
    return lambda: skinny.linear(x, w, r)


def _case(name: str, N: int, K: int, glu: bool, fusion: str, M: int, ws: list,
          bandwidth: float, g: torch.Generator) -> dict:
    nbytes, copies = ws[0].numel() * 2, len(ws)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    nw = torch.randn(K, device="cuda", generator=g).to(torch.bfloat16) * 0.1
    z = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    r = torch.randn(M, N, device="cuda", generator=g).to(torch.bfloat16)

    def ours(tiles):
        return lambda i: skinny.linear(x, ws[i], glu=glu, tiles=tiles)
    row: dict = {"fusion": fusion, "weight_MB": nbytes / 1e6,
                 "flinear_us": _graph_us(lambda i: F.linear(x, ws[i]), copies)}
    default = skinny.tiles_for(M, N, K, glu, x.device)
    row["default_tiles"] = tuple(default)
    row["default_us"] = _graph_us(ours(default), copies)
    # with the model's prologue/epilogue (the kernels these replace are not timed)
    calls = [_fused_call(fusion, glu, x, w, nw, z, r) for w in ws]
    row["fused_us"] = _graph_us(lambda i: calls[i](), copies)
    cands = {}
    for t in (ONE_ROW if M == 1 else ROWS):
        if t.split > 1 and (N > 2048 or glu):
            continue
        try:
            cands[str(tuple(t))] = _graph_us(ours(t), copies)
        except Exception as exc:  # a tiling that does not compile: say so, go on
            cands[str(tuple(t))] = repr(exc)[:120]
    timed = {k: v for k, v in cands.items() if isinstance(v, float)}
    best = min(timed, key=timed.__getitem__)
    tried = [t for t in (ONE_ROW if M == 1 else ROWS) if str(tuple(t)) == best]
    row.update(best=best, best_tiles=tuple(tried[0]), best_us=timed[best], candidates=cands,
               flinear_TBps=nbytes / row["flinear_us"] / 1e6,
               default_TBps=nbytes / row["default_us"] / 1e6,
               best_TBps=nbytes / timed[best] / 1e6, roofline_us=nbytes / bandwidth * 1e6)
    got = skinny.linear(x, ws[0], glu=glu).float()  # the answer against cuBLAS's
    want = skinny.linear_reference(x, ws[0], glu=glu).float()
    row["max_rel_diff"] = float((got - want).abs().max() / want.abs().max())
    print(f"  {name} M={M}: F.linear {row['flinear_us']:.1f} us, ours {row['default_us']:.1f} "
          f"(fused {row['fused_us']:.1f}), best {row['best_us']:.1f} {best}, roofline "
          f"{row['roofline_us']:.1f}", file=sys.stderr)
    return row


def bench_kernels(bandwidth: float) -> dict:
    out: dict = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, N, K, glu, fusion in SHAPES:
        rows_w = 2 * N if glu else N
        copies = max(2, -(-L2_FLUSH_BYTES // (rows_w * K * 2)))
        ws = [torch.randn(rows_w, K, device="cuda", generator=g).to(torch.bfloat16) * K ** -0.5
              for _ in range(copies)]
        for M in (1, 8):
            out[f"{name}_M{M}"] = _case(name, N, K, glu, fusion, M, ws, bandwidth, g)
        del ws
        torch.cuda.empty_cache()
    return out


def anchor_model():
    """anchor-1b with random weights, built on the device in bf16 (TorchModel, graphs on)."""
    from ..model.hybrid import HybridModel
    from ..model.tiny import preset_config
    from ..model.torch_model import TorchModel
    config = preset_config("anchor-1b")
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = HybridModel(config, mtp=False)
    with torch.no_grad():  # norms off their init, so their weights count
        for n, p in net.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    net = net.to(torch.bfloat16)
    return TorchModel(net, num_blocks=1024, block_size=16, num_slots=16,
                      identity="anchor-1b-random", device="cuda")


def _events_us(fn, reps: int = 100) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def _wall_us(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def tuned_tiles(sweep: dict) -> dict:
    """The sweep's fastest tiling per shape, as the flag `skinny_tiles` keys it."""
    tuned = {}
    for name, N, K, glu, _ in SHAPES:
        for M in (1, 8):
            row = sweep.get(f"{name}_M{M}", {})
            if "best_tiles" in row and row["best_us"] < row["default_us"]:
                tuned[(M == 1, N, K, glu)] = Tiles(*row["best_tiles"])
    return tuned


def bench_model(tuned: dict) -> dict:
    from ..model.graphs import DecodeGraphs
    from ..model.protocol import Lane
    m = anchor_model()
    out: dict = {}
    logits: dict = {}
    # (label, skinny rows, tiles, programmatic dependent launch): cuBLAS and the fused
    # elementwise kernels; the skinny GEMMs with their default tiles and the sweep's best;
    # that again without PDL (kernels.pdl) to show what the overlapped launches bring
    modes = [("before", 0, {}, True), ("after", 8, {}, True)] + (
        [("tuned", 8, tuned, True), ("tuned_nopdl", 8, tuned, False)] if tuned else [])
    for label, rows, table, with_pdl in modes:
        # zero_copy off: the graphs are replayed here, not staged by DecodeGraphs
        with override(pdl=with_pdl, skinny_rows=rows, skinny_tiles=table, zero_copy=False):
            m.graphs = DecodeGraphs(m)  # captured afresh under these flags
            for B in (1, 8):
                lanes = [Lane(slot=i, attn_blocks=list(range(i * 64, i * 64 + 64)))
                         for i in range(B)]
                items = [(lane, [7 + i], 1000) for i, lane in enumerate(lanes)]
                for i in m.conv:
                    m.conv[i].zero_()
                    m.recurrent[i].zero_()
                first = m.forward_batch(items)  # captures; from the zero state: compared
                logits[(label, B)] = torch.stack([f.logits[0].float() for f in first])
                cap = m.graphs.graphs[(B, 64)]
                out[f"{label}_replay_b{B}_us"] = _events_us(cap.graph.replay)
                out[f"{label}_step_b{B}_us"] = _wall_us(
                    lambda items=items: m.forward_batch(items))
    out["tuned_tiles"] = {str(k): tuple(v) for k, v in tuned.items()}
    for label, *_ in modes[1:]:
        for B in (1, 8):
            a, b = logits[("before", B)], logits[(label, B)]
            out[f"{label}_logits_max_rel_diff_b{B}"] = float((a - b).abs().max()
                                                             / a.abs().max())
            out[f"{label}_argmax_equal_b{B}"] = bool((a.argmax(-1) == b.argmax(-1)).all())
            out[f"{label}_replay_speedup_b{B}"] = (out[f"before_replay_b{B}_us"]
                                                   / out[f"{label}_replay_b{B}_us"])
    return out


def main(json_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        print("bench skinny: needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    from .kernels import copy_bandwidth
    bandwidth = copy_bandwidth()
    r: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "copy_bandwidth_GBps": bandwidth / 1e9}
    parts = (("kernels", lambda: bench_kernels(bandwidth)),
             ("model", lambda: bench_model(tuned_tiles(r.get("kernels", {})))))
    for name, part in parts:
        t0 = time.perf_counter()
        try:
            r[name] = part()
        except Exception as exc:  # one broken part must not hide the other's figures
            r[name] = {"error": repr(exc)}
            print(f"bench skinny: {name} failed: {exc!r}", file=sys.stderr)
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(json.dumps(r.get("model")), file=sys.stderr)
    write_line({"bench": "skinny", "results": r}, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
