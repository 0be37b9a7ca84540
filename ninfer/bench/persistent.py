"""An experiment (`bench/gpu.sh persistent`): is a persistent decode kernel faster than the
chain of PDL kernels on Hopper, written in Triton?

bench/NOTES.md (stops 21, 22) left "a persistent kernel whose programs wait on counters,
loading the next operation's weights while they wait" as what remained toward 60% of the
H200's roofline. This times the part of a decode step where it would pay most: the four
GEMMs of 24 GDN-shaped layers of anchor-1b (rms norm + in-projection 6144 x 1024; out
1024 x 2048 + residual; rms norm + gate/up 2 x 3072 x 1024 with SwiGLU; down 1024 x 3072 +
residual), 96 dependent GEMMs reading 856 MB, in a CUDA graph:

- `chain`: the decode path's skinny GEMMs (`kernels.skinny`), one PDL kernel each;
- `persistent`: one launch of P programs (all resident at once: the launch is refused
  otherwise, since a program spinning on one that cannot start would hang the GPU), each
  owning a fixed slice of every GEMM's rows, a grid-wide barrier (a counter in L2) between
  GEMMs. Its weights are held in registers: with `ahead` a program issues the loads of its
  next slice once it has loaded the current GEMM's input and before computing it
  (double-buffered), otherwise after it, just before the barrier. Without its barriers
  (wrong results: nothing orders a GEMM's reads after the last one's writes) it times
  streaming the weights alone;
- `barriers`: 96 barriers and nothing else.

Each variant's result is checked against the chain's (max abs error, bf16 rounding); the
roofline is the weights' bytes over the copy bandwidth measured in the run.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import triton
import triton.language as tl

from .report import write_line

LAYERS, HIDDEN, IN_ROWS, OUT_K, INTER = 24, 1024, 6144, 2048, 3072
EPS = 1e-6


@triton.jit
def _grid_barrier(cnt_ptr, P: tl.constexpr):
    """Every program of the launch arrives here before any goes on. The counter only
    grows: a round ends at the next multiple of P (zero it before a launch of another P)."""
    tl.debug_barrier()  # the program's writes are issued before it counts itself in
    old = tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    target = old - old % P + P
    cur = old + 1
    while cur < target:
        cur = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _barriers_kernel(cnt_ptr, n, P: tl.constexpr):
    for _ in range(n):
        _grid_barrier(cnt_ptr, P)


@triton.jit
def _rows(w_ptr, row0, NR: tl.constexpr, K: tl.constexpr, stride):
    r = row0 + tl.arange(0, NR)
    return tl.load(w_ptr + r[:, None].to(tl.int64) * stride + tl.arange(0, K)[None, :])


@triton.jit
def _dot(w, x):
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _normed(h_ptr, nw_ptr, eps, K: tl.constexpr):
    """rms_norm(h) * (1 + w), rounded to bf16, as float32 (`kernels.skinny`'s prologue)."""
    k = tl.arange(0, K)
    x = tl.load(h_ptr + k).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    return (x * inv * (1.0 + tl.load(nw_ptr + k).to(tl.float32))).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _add_rows(h_ptr, rows, y):
    h = tl.load(h_ptr + rows).to(tl.float32)
    tl.store(h_ptr + rows, (h + y.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16))


@triton.jit
def _swiglu(out_ptr, wg, wu, x, N: tl.constexpr):
    g = _dot(wg, x).to(tl.bfloat16).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(tl.bfloat16).to(tl.float32)
    up = _dot(wu, x).to(tl.bfloat16).to(tl.float32)
    tl.store(out_ptr + tl.arange(0, N), (silu * up).to(tl.bfloat16))


@triton.jit
def _persistent_kernel(h_ptr, y_ptr, u_ptr, wa_ptr, wb_ptr, wc_ptr, wd_ptr, na_ptr, nc_ptr,
                       cnt_ptr, L, eps, P: tl.constexpr, AHEAD: tl.constexpr,
                       BARRIERS: tl.constexpr):
    pid = tl.program_id(0)
    # each program's rows of each GEMM, in two power-of-two pieces where needed
    A1: tl.constexpr = 6144 // P * 2 // 3
    A2: tl.constexpr = 6144 // P // 3
    RB: tl.constexpr = 1024 // P
    C1: tl.constexpr = 3072 // P * 2 // 3
    C2: tl.constexpr = 3072 // P // 3
    a0 = pid * (A1 + A2)
    b0 = pid * RB
    c0 = pid * (C1 + C2)
    rb = b0 + tl.arange(0, RB)
    la, lb, lc, ld = 6144 * 1024, 1024 * 2048, 6144 * 1024, 1024 * 3072
    up = 3072 * 1024
    wa1 = _rows(wa_ptr, a0, A1, 1024, 1024)
    wa2 = _rows(wa_ptr, a0 + A1, A2, 1024, 1024)
    for layer in range(L):
        # in-projection: y = W_a rms(h)
        x = _normed(h_ptr, na_ptr + layer * 1024, eps, 1024)
        if AHEAD:
            wb = _rows(wb_ptr + layer * lb, b0, RB, 2048, 2048)
        tl.store(y_ptr + a0 + tl.arange(0, A1), _dot(wa1, x).to(tl.bfloat16))
        tl.store(y_ptr + a0 + A1 + tl.arange(0, A2), _dot(wa2, x).to(tl.bfloat16))
        if not AHEAD:
            wb = _rows(wb_ptr + layer * lb, b0, RB, 2048, 2048)
        if BARRIERS:
            _grid_barrier(cnt_ptr, P)
        # out-projection: h += W_b y[:2048]
        wc = wc_ptr + layer * lc
        x = tl.load(y_ptr + tl.arange(0, 2048)).to(tl.float32)
        if AHEAD:
            g1, g2 = _rows(wc, c0, C1, 1024, 1024), _rows(wc, c0 + C1, C2, 1024, 1024)
            u1, u2 = _rows(wc + up, c0, C1, 1024, 1024), _rows(wc + up, c0 + C1, C2, 1024, 1024)
        _add_rows(h_ptr, rb, _dot(wb, x))
        if not AHEAD:
            g1, g2 = _rows(wc, c0, C1, 1024, 1024), _rows(wc, c0 + C1, C2, 1024, 1024)
            u1, u2 = _rows(wc + up, c0, C1, 1024, 1024), _rows(wc + up, c0 + C1, C2, 1024, 1024)
        if BARRIERS:
            _grid_barrier(cnt_ptr, P)
        # gate/up: u = silu(W_g rms(h)) * W_u rms(h)
        wd = wd_ptr + layer * ld
        x = _normed(h_ptr, nc_ptr + layer * 1024, eps, 1024)
        if AHEAD:
            d1, d2 = _rows(wd, b0, RB, 2048, 3072), _rows(wd + 2048, b0, RB, 1024, 3072)
        _swiglu(u_ptr + c0, g1, u1, x, C1)
        _swiglu(u_ptr + c0 + C1, g2, u2, x, C2)
        if not AHEAD:
            d1, d2 = _rows(wd, b0, RB, 2048, 3072), _rows(wd + 2048, b0, RB, 1024, 3072)
        if BARRIERS:
            _grid_barrier(cnt_ptr, P)
        # down: h += W_d u; then the next layer's in-projection slice
        nxt = wa_ptr + tl.minimum(layer + 1, L - 1) * la
        x1 = tl.load(u_ptr + tl.arange(0, 2048)).to(tl.float32)
        x2 = tl.load(u_ptr + 2048 + tl.arange(0, 1024)).to(tl.float32)
        if AHEAD:
            wa1, wa2 = _rows(nxt, a0, A1, 1024, 1024), _rows(nxt, a0 + A1, A2, 1024, 1024)
        y = _dot(d1, x1) + _dot(d2, x2)
        _add_rows(h_ptr, rb, y)
        if not AHEAD:
            wa1, wa2 = _rows(nxt, a0, A1, 1024, 1024), _rows(nxt, a0 + A1, A2, 1024, 1024)
        if BARRIERS:
            _grid_barrier(cnt_ptr, P)


def _weights(device) -> dict:
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16).to(device)
    return dict(wa=rand(LAYERS, IN_ROWS, HIDDEN), wb=rand(LAYERS, HIDDEN, OUT_K),
                wc=rand(LAYERS, 2 * INTER, HIDDEN), wd=rand(LAYERS, HIDDEN, INTER),
                na=rand(LAYERS, HIDDEN), nc=rand(LAYERS, HIDDEN))


def _chain(w: dict, h):
    from kernels import skinny
    for i in range(LAYERS):
        y = skinny.norm_linear(h, w["na"][i], EPS, w["wa"][i])
        h = skinny.linear(y[:, :OUT_K], w["wb"][i], residual=h)
        u = skinny.norm_linear(h, w["nc"][i], EPS, w["wc"][i], glu=True)
        h = skinny.linear(u, w["wd"][i], residual=h)
    return h


def _resident(programs: int, warps: int, kernel) -> bool:
    """Whether `programs` of a compiled kernel fit on the GPU at once (registers only: the
    kernel's shared memory is a few KB)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    regs = ((kernel.n_regs + 7) // 8 * 8) * 32 * warps
    return programs <= sms * min(65536 // regs, 64 // warps)


def _graph_us(fn, reps: int = 50) -> float:
    """Microseconds a replay of fn() captured alone in a CUDA graph: the best of five runs
    of `reps` replays."""
    from .kernels import graph_ms
    return graph_ms(fn, steps=1, replays=reps, runs=5) * 1000


def setup(device: torch.device) -> tuple[dict, torch.Tensor, int, float, torch.Tensor]:
    """What each of these experiments starts from: the weights, the input row, the weights'
    bytes, the copy bandwidth of this run (TB/s) and the chain's result (the reference)."""
    w = _weights(device)
    h0 = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    h0 = h0.to(device)
    weight_bytes = sum(v.numel() * v.element_size() for k, v in w.items() if k[0] == "w")
    src = torch.empty(2 ** 28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_tbps = 2 * src.numel() / (_graph_us(lambda: dst.copy_(src), 20) * 1e-6) / 1e12
    return w, h0, weight_bytes, copy_tbps, _chain(w, h0.clone())


def main(json_path: str | None = None) -> int:
    device = torch.device("cuda")
    w, h0, weight_bytes, copy_tbps, ref = setup(device)
    y = torch.zeros(IN_ROWS, dtype=torch.bfloat16, device=device)
    u = torch.zeros(INTER, dtype=torch.bfloat16, device=device)
    cnt = torch.zeros(1, dtype=torch.int64, device=device)
    hc = h0.clone()
    r = {"device": torch.cuda.get_device_name(), "layers": LAYERS, "gemms": 4 * LAYERS,
         "weight_bytes": weight_bytes, "copy_TBps": copy_tbps,
         "roofline_us": weight_bytes / (copy_tbps * 1e12) * 1e6,
         "chain_us": _graph_us(lambda: _chain(w, hc))}
    r["barriers_us"] = {}
    r["persistent"] = []
    for programs, warps in ((128, 8), (256, 4)):
        cnt.zero_()
        r["barriers_us"][programs] = _graph_us(partial(
            _barriers_kernel[(programs,)], cnt, 4 * LAYERS, P=programs, num_warps=warps))
        for ahead in (False, True):
            args = (y, u, w["wa"], w["wb"], w["wc"], w["wd"], w["na"], w["nc"], cnt, LAYERS,
                    EPS)
            kernel = _persistent_kernel.warmup(h0, *args, P=programs, AHEAD=ahead,
                                               BARRIERS=True, num_warps=warps, grid=(programs,))
            kernel._init_handles()
            row = {"programs": programs, "warps": warps, "ahead": ahead,
                   "registers": kernel.n_regs}
            if not _resident(programs, warps, kernel):
                row["skipped"] = "not every program fits on the GPU at once"
                r["persistent"].append(row)
                continue
            hp = h0.clone().view(-1)
            cnt.zero_()
            _persistent_kernel[(programs,)](hp, *args, P=programs, AHEAD=ahead, BARRIERS=True,
                                            num_warps=warps)
            row["max_abs_error"] = (hp.float() - ref.view(-1).float()).abs().max().item()
            for barriers in (True, False):
                cnt.zero_()
                row["us" if barriers else "us_without_barriers"] = _graph_us(partial(
                    _persistent_kernel[(programs,)], hp, *args, P=programs, AHEAD=ahead,
                    BARRIERS=barriers, num_warps=warps))
            row["over_chain"] = r["chain_us"] / row["us"]
            r["persistent"].append(row)
            print(row, file=sys.stderr)
    r["reference_max_abs"] = ref.abs().max().item()
    write_line({"bench": "gpu-persistent", "results": r}, json_path)
    bad = [row for row in r["persistent"] if row.get("max_abs_error", 0) > 0.5]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
