"""An experiment (`bench/gpu.sh gluon-persistent`): the 96 GEMMs of `ninfer.bench.persistent`
as one persistent Gluon kernel whose weights stream without ever waiting for the chain.

Stop 23 measured a persistent Triton kernel against the PDL chain and found it slower: its
programs held the next GEMM's weights in registers, so streaming stopped at every grid
barrier. Stop 25 found the PDL chain to be its bytes read plus ~47 us of streaming lost at
kernel switches plus ~46 us of waits. Here each of P programs (one an SM) splits into two
warp-specialised partitions:
- a loader (one warp) that copies the program's slices of every GEMM of every layer, in
  order, by the TMA into a ring of NS shared-memory stages, waiting only for a free stage;
- the computing warps, which for each GEMM wait at a grid barrier (a counter in L2) for the
  GEMM before to be written everywhere, read x, and reduce the stages as they land.

So the weights stream at the card's read rate whenever the ring has room, and a barrier
only delays the compute that follows it. Each stage is [64, 256] bf16 (32 KB): the
in-projection's 48 rows a program, by 256 columns (4 stages); gate and up, 24 rows each
(4 stages); out and down, 8 rows by 256 columns four and six times over (2 stages each).
"""

from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .persistent import EPS, HIDDEN, IN_ROWS, INTER, LAYERS, OUT_K, _chain, _graph_us, setup
from .report import write_line

P = 128  # programs, one an SM: 6144 / 128 = 48 in-projection rows, 24 of gate and of up, 8
KC = gl.constexpr(256)
SPIN_LIMIT = gl.constexpr(1 << 20)  # a barrier that never fills gives up (the error flag)
_sync = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _stage(it, ring, full, empty, nbytes, NS: gl.constexpr):
    """The loader's next stage: waits until the computing warps have freed it, then arms its
    `full` barrier for nbytes of copies."""
    i = it % NS
    mbarrier.wait(empty.index(i), ((it // NS) & 1) ^ 1)
    mbarrier.expect(full.index(i), nbytes)
    return ring.index(i), full.index(i)


@gluon.jit
def _load_rows8(desc, row, PER: gl.constexpr, it, ring, full, empty, NS: gl.constexpr):
    """8 rows of 2 * PER * KC columns in 2 stages of PER [8, KC] blocks; the stage count
    after."""
    for s in gl.static_range(2):
        buf, bar = _stage(it, ring, full, empty, PER * 8 * 256 * 2, NS)
        for j in gl.static_range(PER):
            tma.async_copy_global_to_shared(desc, [row, (PER * s + j) * KC], bar,
                                            buf.slice(8 * j, 8))
        it += 1
    return it


@gluon.jit
def _loader(descs, ring, full, empty, L, pid, NS: gl.constexpr):
    """Every stage of every layer, in the order the computing warps take them. Boxes are
    powers of two rows: 48 = 32 + 16 (in-projection), 24 = 16 + 8 (gate, up)."""
    wa32, wa16, wb8, wc16, wc8, wd8 = descs
    it = 0
    for layer in range(L):
        row = layer * 6144 + pid * 48  # in-projection: 48 rows x 1024, 4 stages
        for c in gl.static_range(4):
            buf, bar = _stage(it, ring, full, empty, 48 * 256 * 2, NS)
            tma.async_copy_global_to_shared(wa32, [row, c * KC], bar, buf.slice(0, 32))
            tma.async_copy_global_to_shared(wa16, [row + 32, c * KC], bar, buf.slice(32, 16))
            it += 1
        # out: 8 rows x 2048, 4 column blocks a stage
        it = _load_rows8(wb8, layer * 1024 + pid * 8, 4, it, ring, full, empty, NS)
        row = layer * 6144 + pid * 24  # gate rows at 0, up rows (3072 below) at 32
        for c in gl.static_range(4):
            buf, bar = _stage(it, ring, full, empty, 48 * 256 * 2, NS)
            for part in gl.static_range(2):
                tma.async_copy_global_to_shared(wc16, [row + part * 3072, c * KC], bar,
                                                buf.slice(32 * part, 16))
                tma.async_copy_global_to_shared(wc8, [row + part * 3072 + 16, c * KC], bar,
                                                buf.slice(32 * part + 16, 8))
            it += 1
        # down: 8 rows x 3072, 6 column blocks a stage
        it = _load_rows8(wd8, layer * 1024 + pid * 8, 6, it, ring, full, empty, NS)


@gluon.jit
def _grid_sync(cnt_ptr, err_ptr, P: gl.constexpr, BARRIERS: gl.constexpr,
               BACKOFF: gl.constexpr):
    """Every program's writes so far visible to all before any goes on (the counter only
    grows: a round ends at the next multiple of P). Without BARRIERS, nothing (wrong
    results: to time the rest alone)."""
    if not BARRIERS:
        return
    _sync()
    old = gl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    target = old - old % P + P
    cur = old + 1
    spins = 0
    while (cur < target) & (spins < SPIN_LIMIT):
        if BACKOFF > 0:
            gl.inline_asm_elementwise(f"nanosleep.u32 {BACKOFF}; // $0", "=r", [],
                                      dtype=gl.int32, is_pure=False, pack=1)
        cur = gl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= SPIN_LIMIT:
        gl.atomic_add(err_ptr, 1)
    _sync()


@gluon.jit
def _take(it, full, NS: gl.constexpr):
    i = it % NS
    mbarrier.wait(full.index(i), (it // NS) & 1)
    return i


@gluon.jit
def _stage_x(src_ptr, nw_ptr, x_s, eps, N: gl.constexpr, NORM: gl.constexpr,
             WARPS: gl.constexpr):
    """x (N values at src_ptr; where NORM, rms_norm(x) * (1 + nw) rounded to bf16) into
    shared memory for the stage loop to read: one load of all of it, one L2 round trip."""
    flat: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])
    k = gl.arange(0, 4096, flat)
    x = gl.load(src_ptr + k, mask=k < N, other=0.0).to(gl.float32)
    if NORM:
        inv = gl.rsqrt(gl.sum(x * x, axis=0) / N + eps)
        x = x * inv * (1.0 + gl.load(nw_ptr + k, mask=k < N, other=0.0).to(gl.float32))
    x_s.store(x.to(gl.bfloat16))
    _sync()  # (the computing warps' own barrier)


@gluon.jit
def _x(x_s, c, layout: gl.constexpr):
    """Columns c * KC ... of the staged x, as [1, KC] float32 in the stage loads' columns."""
    return x_s.slice(c * KC, KC).load(gl.SliceLayout(0, layout)).to(gl.float32)[None, :]


@gluon.jit
def _dot(w_s, xv, layout: gl.constexpr):
    """The rows of a [R, KC] stage slice against x's columns xv ([1, KC], float32)."""
    return gl.sum(w_s.load(layout).to(gl.float32) * xv, axis=1)


@gluon.jit
def _swiglu(g, u):
    g = g.to(gl.bfloat16).to(gl.float32)
    silu = (g / (1.0 + gl.exp(-g))).to(gl.bfloat16).to(gl.float32)
    return (silu * u.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16)


@gluon.jit
def _residual_rows(x_ptr, h_ptr, x_s, ring, full, empty, it, pid, PER: gl.constexpr,
                   NS: gl.constexpr, WARPS: gl.constexpr):
    """h[the program's 8 rows] += W x, x of 2 * PER * KC values, W's slice in 2 stages of PER
    [8, KC] blocks (out: PER 4; down: 6). Returns the stage count after."""
    l24: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    r24: gl.constexpr = gl.SliceLayout(1, l24)
    _stage_x(x_ptr, x_ptr, x_s, 0.0, 2 * PER * 256, False, WARPS)
    r = pid * 8 + gl.arange(0, 8, r24)
    hr = gl.load(h_ptr + r).to(gl.float32)
    acc = gl.zeros([8], gl.float32, r24)
    for s in gl.static_range(2):
        i = _take(it, full, NS)
        for j in gl.static_range(PER):
            acc += _dot(ring.index(i).slice(8 * j, 8), _x(x_s, PER * s + j, l24), l24)
        mbarrier.arrive(empty.index(i), count=1)
        it += 1
    gl.store(h_ptr + r, (hr + acc.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16))
    return it


@gluon.jit
def _compute(h_ptr, y_ptr, u_ptr, na_ptr, nc_ptr, cnt_ptr, err_ptr, eps, L, pid, ring, full,
             empty, x_s, NS: gl.constexpr, P: gl.constexpr, WARPS: gl.constexpr,
             BARRIERS: gl.constexpr, BACKOFF: gl.constexpr):
    l24: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    r24: gl.constexpr = gl.SliceLayout(1, l24)
    it = 0
    for layer in range(L):
        # in-projection: y[48 rows] = W_a rms(h)
        _stage_x(h_ptr, na_ptr + layer * 1024, x_s, eps, 1024, True, WARPS)
        acc0 = gl.zeros([32], gl.float32, r24)
        acc1 = gl.zeros([16], gl.float32, r24)
        for c in gl.static_range(4):
            xv = _x(x_s, c, l24)
            i = _take(it, full, NS)
            acc0 += _dot(ring.index(i).slice(0, 32), xv, l24)
            acc1 += _dot(ring.index(i).slice(32, 16), xv, l24)
            mbarrier.arrive(empty.index(i), count=1)
            it += 1
        gl.store(y_ptr + pid * 48 + gl.arange(0, 32, r24), acc0.to(gl.bfloat16))
        gl.store(y_ptr + pid * 48 + 32 + gl.arange(0, 16, r24), acc1.to(gl.bfloat16))
        _grid_sync(cnt_ptr, err_ptr, P, BARRIERS, BACKOFF)
        # out: h[8 rows] += W_b y[:2048]
        it = _residual_rows(y_ptr, h_ptr, x_s, ring, full, empty, it, pid, 4, NS, WARPS)
        _grid_sync(cnt_ptr, err_ptr, P, BARRIERS, BACKOFF)
        # gate/up: u[24 rows] = silu(W_g rms(h)) * W_u rms(h)
        _stage_x(h_ptr, nc_ptr + layer * 1024, x_s, eps, 1024, True, WARPS)
        g16 = gl.zeros([16], gl.float32, r24)
        g8 = gl.zeros([8], gl.float32, r24)
        u16 = gl.zeros([16], gl.float32, r24)
        u8 = gl.zeros([8], gl.float32, r24)
        for c in gl.static_range(4):
            xv = _x(x_s, c, l24)
            i = _take(it, full, NS)
            g16 += _dot(ring.index(i).slice(0, 16), xv, l24)
            g8 += _dot(ring.index(i).slice(16, 8), xv, l24)
            u16 += _dot(ring.index(i).slice(32, 16), xv, l24)
            u8 += _dot(ring.index(i).slice(48, 8), xv, l24)
            mbarrier.arrive(empty.index(i), count=1)
            it += 1
        gl.store(u_ptr + pid * 24 + gl.arange(0, 16, r24), _swiglu(g16, u16))
        gl.store(u_ptr + pid * 24 + 16 + gl.arange(0, 8, r24), _swiglu(g8, u8))
        _grid_sync(cnt_ptr, err_ptr, P, BARRIERS, BACKOFF)
        # down: h[8 rows] += W_d u
        it = _residual_rows(u_ptr, h_ptr, x_s, ring, full, empty, it, pid, 6, NS, WARPS)
        _grid_sync(cnt_ptr, err_ptr, P, BARRIERS, BACKOFF)


@gluon.jit
def _persistent_kernel(wa32, wa16, wb8, wc16, wc8, wd8, h_ptr, y_ptr, u_ptr, na_ptr, nc_ptr,
                       cnt_ptr, err_ptr, eps, L, NS: gl.constexpr, P: gl.constexpr,
                       WARPS: gl.constexpr, BARRIERS: gl.constexpr = True,
                       BACKOFF: gl.constexpr = 0):
    pid = gl.program_id(0)
    descs = (wa32, wa16, wb8, wc16, wc8, wd8)
    ring = gl.allocate_shared_memory(gl.bfloat16, [NS, 64, 256], descs[0].layout)
    full = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    x_s = gl.allocate_shared_memory(gl.bfloat16, [4096], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(NS):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_compute, (h_ptr, y_ptr, u_ptr, na_ptr, nc_ptr, cnt_ptr, err_ptr, eps, L, pid, ring,
                    full, empty, x_s, NS, P, WARPS, BARRIERS, BACKOFF)),
        (_loader, (descs, ring, full, empty, L, pid, NS)),
    ], [1], [24])


def _descriptors(w: dict) -> tuple:
    """The loader's TMA descriptors: (tensor, box rows) wa 32, wa 16, wb 8, wc 16, wc 8, wd
    8, each box 256 columns wide, over the layers' weights stacked."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    flat = {k: w[k].reshape(-1, w[k].shape[-1]) for k in ("wa", "wb", "wc", "wd")}
    return tuple(TensorDescriptor.from_tensor(flat[k], [rows, 256], layout)
                 for k, rows in (("wa", 32), ("wa", 16), ("wb", 8), ("wc", 16), ("wc", 8),
                                 ("wd", 8)))


def main(json_path: str | None = None) -> int:
    device = torch.device("cuda")
    assert (IN_ROWS, HIDDEN, INTER, OUT_K) == (6144, 1024, 3072, 2048)
    w, h0, weight_bytes, copy_tbps, ref = setup(device)
    ref = ref.view(-1)
    hc = h0.clone()
    descs = _descriptors(w)
    y = torch.zeros(IN_ROWS, dtype=torch.bfloat16, device=device)
    u = torch.zeros(INTER, dtype=torch.bfloat16, device=device)
    cnt = torch.zeros(1, dtype=torch.int32, device=device)
    err = torch.zeros(1, dtype=torch.int32, device=device)
    r = {"device": torch.cuda.get_device_name(), "gemms": 4 * LAYERS, "programs": P,
         "weight_bytes": weight_bytes, "copy_TBps": copy_tbps,
         "roofline_us": weight_bytes / (copy_tbps * 1e12) * 1e6, "rows": []}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if P > sms:
        print(f"gluon persistent: needs {P} SMs, the card has {sms}", file=sys.stderr)
        return 2
    bad = 0
    for ns, warps, backoff in ((6, 4, 0), (6, 4, 64), (6, 8, 0), (6, 8, 64)):
        row = {"stages": ns, "warps": warps, "backoff_ns": backoff}
        try:
            hp = h0.clone().view(-1)

            def launch(hp=hp, ns=ns, warps=warps, backoff=backoff, barriers=True):
                _persistent_kernel[(P,)](*descs, hp, y, u, w["na"], w["nc"], cnt, err, EPS,
                                         LAYERS, NS=ns, P=P, WARPS=warps, BARRIERS=barriers,
                                         BACKOFF=backoff, num_warps=warps)
            launch()
            torch.cuda.synchronize()
            row["barrier_timeouts"] = int(err.item())
            row["max_abs_error"] = (hp.float() - ref.float()).abs().max().item()
            bad += row["max_abs_error"] > 0.5 or row["barrier_timeouts"] > 0
            row["chain_us"] = _graph_us(lambda: _chain(w, hc))
            row["us"] = _graph_us(launch)
            row["over_chain"] = row["chain_us"] / row["us"]
            row["us_without_barriers"] = _graph_us(lambda: launch(barriers=False))
        except Exception as exc:  # one setting's failure must not hide the others
            import traceback
            row["error"] = repr(exc)[:300] + " " + traceback.format_exc()[-900:]
            bad += 1
        print(row, file=sys.stderr)
        r["rows"].append(row)
    write_line({"bench": "gpu-gluon-persistent", "results": r}, json_path)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
