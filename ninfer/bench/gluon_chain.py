"""An experiment (`bench/gpu.sh gluon`): the decode chain's skinny GEMMs with their weights
staged in shared memory instead of registers, written in Gluon (Triton's lower-level
language, GPU only).

bench/NOTES.md (stops 15, 21, 23) charges most of the batch-1 step's excess over its
roofline to the chain of PDL kernels: a GEMM costs ~3 us in the chain whatever its size, and
the big ones (~12 MB) ~1.3 us more than the small, because a one-row GEMM holds its weight
tile in registers before its PDL wait, so the next kernel's programs cannot all start (and
load theirs) while the one before runs. Plain Triton cannot put a load's result anywhere
but registers outside a pipelined loop. Here each program issues cp.async copies of its
weight tile into shared memory before the wait (cp.async, or the TMA's bulk copies), holds
no weights in registers while it waits, and after the wait reads them back chunk by chunk
against x (loaded once into shared memory). Registers then no longer grow with the tile,
and the shared memory of two consecutive GEMMs fits an SM (~95 + ~48 KB at most for
anchor-1b's shapes), so a kernel's programs can all be resident, their copies landing,
while the kernel before computes.
Measured on the H100 (bench/NOTES.md, stop 25): no faster than the register chain, but for
2% with the TMA at 8 rows a program.

It times the same 96 GEMMs as `ninfer.bench.persistent` (24 GDN-shaped layers: rms norm +
in-projection 6144 x 1024; out 1024 x 2048 + residual; rms norm + gate/up 2 x 3072 x 1024
with SwiGLU; down 1024 x 3072 + residual), in a CUDA graph with PDL, against the decode
path's kernels (`kernels.skinny`) in the same run, under a few tilings, each result
checked against the chain's; and the chain's two parts alone: streaming the weights (the
same kernels without their waits) and the 96 boundaries (empty PDL kernels); and the same
bytes read by plain read kernels (the card's read bandwidth, against its copy bandwidth).
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .persistent import EPS, HIDDEN, IN_ROWS, INTER, LAYERS, _chain, _graph_us, setup
from .report import write_line

# Triton 3.6's names (the GPU machine's) for cp.async into shared memory and a program's
# barrier; 3.9 (CI's) renamed them
_async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
KC = gl.constexpr(256)  # a chunk of K: one cp.async of 16 bytes a thread per row and chunk


@gluon.jit
def _pdl(PDL: gl.constexpr, WAIT: gl.constexpr):
    if PDL:
        if WAIT:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _x_and_rows(x_ptr, r_ptr, nw_s, rows, eps, K: gl.constexpr, WARPS: gl.constexpr,
                NORM: gl.constexpr, RESIDUAL: gl.constexpr, CHP: gl.constexpr,
                PDL: gl.constexpr, WAIT: gl.constexpr):
    """After the weights' copies are issued: the PDL wait, then x into shared memory in one
    load, its rms inverse, and the residual's rows (where RESIDUAL; else zeros)."""
    _pdl(PDL and WAIT, True)
    xl: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
    kx = gl.arange(0, CHP * KC, xl)
    x_s = gl.allocate_shared_memory(gl.bfloat16, [CHP * KC], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    xc = gl.load(x_ptr + kx, mask=kx < K, other=0.0)
    x_s.store(xc)
    inv = gl.rsqrt(gl.sum(xc.to(gl.float32) * xc.to(gl.float32), axis=0) / K + eps)
    if RESIDUAL:
        r = gl.load(r_ptr + rows).to(gl.float32)
    else:
        r = rows.to(gl.float32) * 0.0
    return x_s, inv, r


@gluon.jit
def _chunk(w_s, c, BN: gl.constexpr, ROWS: gl.constexpr):
    """Chunk c ([BN, KC]) of the weights in w_s: [chunks * BN, KC] where ROWS, else
    [chunks, BN, KC]."""
    if ROWS:
        return w_s.slice(c * BN, BN)
    else:
        return w_s.index(c)


@gluon.jit
def _rows_out(w_s, x_s, nw_s, inv, r, y_ptr, rows, K: gl.constexpr, BN: gl.constexpr,
              WARPS: gl.constexpr, NORM: gl.constexpr, GLU: gl.constexpr,
              RESIDUAL: gl.constexpr, CHP: gl.constexpr, ROWS: gl.constexpr):
    """Once the weights have landed (w_s: PARTS x CHP chunks of [BN, KC], `_chunk`): the
    rows' dots against x (normed where NORM), SwiGLU, residual, stored."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    acc = gl.zeros([BN], gl.float32, rows_l)
    acc_u = gl.zeros([BN], gl.float32, rows_l)
    for c in gl.static_range(K // KC):
        xv = x_s.slice(c * KC, KC).load(cols_l).to(gl.float32)
        if NORM:  # rms_norm(x) * (1 + w), rounded
            nw = nw_s.slice(c * KC, KC).load(cols_l).to(gl.float32)
            xv = (xv * inv * (1.0 + nw)).to(gl.bfloat16).to(gl.float32)
        wv = _chunk(w_s, c, BN, ROWS).load(layout).to(gl.float32)
        acc += gl.sum(wv * xv[None, :], axis=1)
        if GLU:
            wu = _chunk(w_s, CHP + c, BN, ROWS).load(layout).to(gl.float32)
            acc_u += gl.sum(wu * xv[None, :], axis=1)
    y = acc.to(gl.bfloat16).to(gl.float32)
    if GLU:
        silu = (y / (1.0 + gl.exp(-y))).to(gl.bfloat16).to(gl.float32)
        y = silu * acc_u.to(gl.bfloat16).to(gl.float32)
    if RESIDUAL:
        y = r + y
    gl.store(y_ptr + rows, y.to(gl.bfloat16))


@gluon.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, r_ptr, nw_ptr, N, eps, K: gl.constexpr,
                 BN: gl.constexpr, WARPS: gl.constexpr, NORM: gl.constexpr,
                 GLU: gl.constexpr, RESIDUAL: gl.constexpr, PDL: gl.constexpr,
                 CHP: gl.constexpr, WAIT: gl.constexpr = True):
    """y[n] = W[n] . x (rms-normed with weights 1 + nw where NORM), rows n of this
    program's BN; GLU: y = silu(Wg x) * (Wu x), the up row N below the gate row; RESIDUAL:
    y += r[n]. Rounded where `kernels.skinny` rounds. The weights by cp.async. CHP: K // KC
    chunks, rounded up to a power of two (shared memory's shapes must be). WAIT False: no
    PDL wait (wrong results: nothing orders the reads of x after its writes), to time
    streaming the weights alone"""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    PARTS: gl.constexpr = 2 if GLU else 1
    pid = gl.program_id(0)
    _pdl(PDL, False)
    rows = pid * BN + gl.arange(0, BN, rows_l)
    # the weights in one asynchronous copy (in flight across the wait), as [PARTS x CHP
    # chunks, BN rows, KC]: chunk j is part j // CHP (gate, up), columns (j % CHP) * KC ...
    q = gl.arange(0, PARTS * CHP * BN, rows_l)[:, None]
    j = q // BN
    n = pid * BN + q % BN + (j // CHP) * N
    kc = gl.arange(0, KC, cols_l)[None, :]
    w_s = gl.allocate_shared_memory(gl.bfloat16, [PARTS * CHP * BN, KC],
                                    gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    _async_load(w_s, w_ptr + n * K + (j % CHP) * KC + kc, mask=((j % CHP) < K // KC) & (kc >= 0))
    nw_s = _norm_weights(nw_ptr, K, WARPS, NORM, CHP)
    cp.commit_group()
    x_s, inv, r = _x_and_rows(x_ptr, r_ptr, nw_s, rows, eps, K, WARPS, NORM, RESIDUAL, CHP,
                              PDL, WAIT)
    cp.wait_group(0)
    _barrier()  # every thread's copies and x's stores visible to all
    _rows_out(w_s, x_s, nw_s, inv, r, y_ptr, rows, K, BN, WARPS, NORM, GLU, RESIDUAL, CHP,
              True)


@gluon.jit
def _norm_weights(nw_ptr, K: gl.constexpr, WARPS: gl.constexpr, NORM: gl.constexpr,
                  CHP: gl.constexpr):
    """The norm's weights (written by no kernel), copied into shared memory (cp.async,
    committed with the caller's group); where not NORM, an unused buffer."""
    xl: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
    kx = gl.arange(0, CHP * KC, xl)
    nw_s = gl.allocate_shared_memory(gl.bfloat16, [CHP * KC], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    if NORM:
        _async_load(nw_s, nw_ptr + kx, mask=kx < K)
    return nw_s


@gluon.jit
def _gemm_tma_kernel(w_desc, x_ptr, y_ptr, r_ptr, nw_ptr, N, eps, K: gl.constexpr,
                     BN: gl.constexpr, WARPS: gl.constexpr, NORM: gl.constexpr,
                     GLU: gl.constexpr, RESIDUAL: gl.constexpr, PDL: gl.constexpr,
                     CHP: gl.constexpr, WAIT: gl.constexpr = True):
    """`_gemm_kernel` with the weights copied by the TMA (w_desc: blocks of [BN, KC]), one
    thread issuing every chunk's bulk copy onto one mbarrier."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    PARTS: gl.constexpr = 2 if GLU else 1
    CHUNKS: gl.constexpr = K // KC
    pid = gl.program_id(0)
    _pdl(PDL, False)
    rows = pid * BN + gl.arange(0, BN, rows_l)
    w_s = gl.allocate_shared_memory(gl.bfloat16, [PARTS * CHP, BN, KC], w_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, PARTS * CHUNKS * w_desc.block_type.nbytes)
    for c in gl.static_range(CHUNKS):
        tma.async_copy_global_to_shared(w_desc, [pid * BN, c * KC], bar, w_s.index(c))
        if GLU:
            tma.async_copy_global_to_shared(w_desc, [N + pid * BN, c * KC], bar,
                                            w_s.index(CHP + c))
    nw_s = _norm_weights(nw_ptr, K, WARPS, NORM, CHP)
    cp.commit_group()
    x_s, inv, r = _x_and_rows(x_ptr, r_ptr, nw_s, rows, eps, K, WARPS, NORM, RESIDUAL, CHP,
                              PDL, WAIT)
    cp.wait_group(0)
    mbarrier.wait(bar, 0)
    _barrier()  # x's stores and the norm weights' copies visible to all
    _rows_out(w_s, x_s, nw_s, inv, r, y_ptr, rows, K, BN, WARPS, NORM, GLU, RESIDUAL, CHP,
              False)


# (N, K, glu) -> (BN, warps): the tilings tried, the first each shape's default
TILINGS = {
    "bn8_in_bn4_rest_4w": {IN_ROWS: (8, 4), HIDDEN: (4, 4), INTER: (4, 4)},
    "bn8_all_4w": {IN_ROWS: (8, 4), HIDDEN: (8, 4), INTER: (8, 4)},
    "bn4_all_2w": {IN_ROWS: (4, 2), HIDDEN: (4, 2), INTER: (4, 2)},
    "bn16_in_bn8_rest_4w": {IN_ROWS: (16, 4), HIDDEN: (8, 4), INTER: (8, 4)},
}


@gluon.jit
def _empty_kernel(y_ptr, WARPS: gl.constexpr):
    """A chain's boundary and nothing else: wait for the kernel before, store one value."""
    _pdl(True, False)
    _pdl(True, True)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    gl.store(y_ptr + gl.program_id(0) + gl.arange(0, 32 * WARPS, one) * 0,
             gl.full([32 * WARPS], 0.0, gl.float32, one))


def _launch(x, w, y, tiling, r=None, nw=None, glu=False, wait=True, desc=None):
    """One GEMM of the chain (module docstring); desc: w's TMA descriptor (else cp.async)."""
    N = w.shape[0] // (2 if glu else 1)
    bn, warps = tiling[N]
    args = (x, y, r if r is not None else y, nw if nw is not None else w, N, EPS)
    kernel, first = (_gemm_tma_kernel, (desc,)) if desc is not None else (_gemm_kernel, ())
    if desc is None:  # (the cp.async kernel takes x first, then w's pointer)
        args = (x, w) + args[1:]
    return kernel[(N // bn,)](
        *first, *args, K=w.shape[1], BN=bn, WARPS=warps, NORM=nw is not None, GLU=glu,
        RESIDUAL=r is not None, PDL=True, CHP=triton.next_power_of_2(w.shape[1] // KC),
        WAIT=wait, num_warps=warps, launch_pdl=True)


class Chain:
    """The 96 GEMMs through a Gluon kernel (the weights by the TMA where `tma`, else by
    cp.async), into buffers kept across replays."""

    def __init__(self, w: dict, h0: torch.Tensor, tiling: dict, wait: bool = True,
                 tma: bool = False) -> None:
        dev = h0.device
        self.w, self.tiling, self.wait = w, tiling, wait
        self.h = [h0.clone().view(-1)] + [torch.empty(HIDDEN, dtype=torch.bfloat16, device=dev)
                                          for _ in range(2 * LAYERS)]
        self.y = torch.empty(IN_ROWS, dtype=torch.bfloat16, device=dev)
        self.u = torch.empty(INTER, dtype=torch.bfloat16, device=dev)
        self.desc = {name: [self._desc(m, name) if tma else None for m in w[name]]
                     for name in ("wa", "wb", "wc", "wd")}
        self.compiled: list = []

    def _desc(self, m: torch.Tensor, name: str):
        bn = self.tiling[m.shape[0] // (2 if name == "wc" else 1)][0]
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
        return TensorDescriptor.from_tensor(m, [bn, int(KC)], layout)

    def __call__(self) -> torch.Tensor:
        w, t, h, wait, d = self.w, self.tiling, self.h, self.wait, self.desc
        out = []
        for i in range(LAYERS):
            out.append(_launch(h[2 * i], w["wa"][i], self.y, t, nw=w["na"][i], wait=wait,
                               desc=d["wa"][i]))
            out.append(_launch(self.y, w["wb"][i], h[2 * i + 1], t, r=h[2 * i], wait=wait,
                               desc=d["wb"][i]))
            out.append(_launch(h[2 * i + 1], w["wc"][i], self.u, t, nw=w["nc"][i], glu=True,
                               wait=wait, desc=d["wc"][i]))
            out.append(_launch(self.u, w["wd"][i], h[2 * i + 2], t, r=h[2 * i + 1],
                               wait=wait, desc=d["wd"][i]))
        self.compiled = out
        return h[-1]


@gluon.jit
def _read_kernel(w_ptr, out_ptr, n, BLOCK: gl.constexpr, WARPS: gl.constexpr):
    """The card's read bandwidth: each program sums a contiguous block of n bf16 values."""
    lay: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
    offs = gl.program_id(0).to(gl.int64) * BLOCK + gl.arange(0, BLOCK, lay)
    v = gl.load(w_ptr + offs, mask=offs < n, other=0.0).to(gl.float32)
    gl.store(out_ptr + gl.program_id(0), gl.sum(v, axis=0))


def _read_us(w: dict) -> float:
    """Microseconds to read the chain's weights once, one plain read kernel a tensor."""
    block = 16384  # 32 KB a program
    weights = [w[k] for k in ("wa", "wb", "wc", "wd")]
    out = torch.empty(max(v.numel() // block + 1 for v in weights), device=weights[0].device)
    return _graph_us(lambda: [
        _read_kernel[(triton.cdiv(v.numel(), block),)](v, out, v.numel(), BLOCK=block,
                                                       WARPS=8, num_warps=8)
        for v in weights])


def main(json_path: str | None = None) -> int:
    device = torch.device("cuda")
    w, h0, weight_bytes, copy_tbps, ref = setup(device)
    ref = ref.view(-1)
    hc = h0.clone()
    r = {"device": torch.cuda.get_device_name(), "gemms": 4 * LAYERS,
         "weight_bytes": weight_bytes, "copy_TBps": copy_tbps,
         "roofline_us": weight_bytes / (copy_tbps * 1e12) * 1e6, "rows": []}
    bad = 0
    rows = [(False, name) for name in TILINGS] + [(True, name) for name in TILINGS]
    for use_tma, name in rows:
        tiling = TILINGS[name]
        row = {"copies": "tma" if use_tma else "cp.async", "tiling": name}
        try:
            chain = Chain(w, h0, tiling, tma=use_tma)
            out = chain()
            torch.cuda.synchronize()
            row["registers"] = sorted({k.n_regs for k in chain.compiled})
            row["shared_bytes"] = sorted({k.metadata.shared for k in chain.compiled})
            row["max_abs_error"] = (out.float() - ref.float()).abs().max().item()
            bad += row["max_abs_error"] > 0.5
            row["chain_us"] = _graph_us(lambda: _chain(w, hc))  # the baseline, again each row
            row["us"] = _graph_us(chain)
            row["over_chain"] = row["chain_us"] / row["us"]
        except Exception as exc:  # one tiling's failure must not hide the others
            row["error"] = repr(exc)[:400]
            bad += 1
        print(row, file=sys.stderr)
        r["rows"].append(row)
    # the chain's parts: streaming the weights alone (no waits), and its 96 boundaries alone
    # (empty PDL kernels of as many programs as the default tiling's GEMMs)
    default = next(iter(TILINGS.values()))
    r["streaming_us"] = {copies: _graph_us(Chain(w, h0, default, wait=False, tma=use_tma))
                         for copies, use_tma in (("cp.async", False), ("tma", True))}
    sink = torch.empty(8192, dtype=torch.float32, device=device)
    programs = [IN_ROWS // default[IN_ROWS][0], HIDDEN // default[HIDDEN][0],
                INTER // default[INTER][0], HIDDEN // default[HIDDEN][0]]
    r["boundaries_us"] = _graph_us(lambda: [
        _empty_kernel[(programs[i % 4],)](sink, WARPS=4, num_warps=4, launch_pdl=True)
        for i in range(4 * LAYERS)])
    r["read_us"] = _read_us(w)  # the same bytes by a plain read kernel: the read roofline
    r["read_TBps"] = weight_bytes / (r["read_us"] * 1e-6) / 1e12
    print({k: r[k] for k in ("roofline_us", "read_us", "read_TBps", "streaming_us",
                             "boundaries_us")}, file=sys.stderr)
    r["reference_max_abs"] = ref.abs().max().item()
    write_line({"bench": "gpu-gluon-chain", "results": r}, json_path)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
