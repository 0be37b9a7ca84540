"""Weights pulled into L2 ahead of the GEMMs that read them, by a kernel beside the step.

A decode step streams ~1.2 GB of weights through a chain of ~120 dependent kernels, and
between two GEMMs the DRAM idles: the GDN step, the attention, each kernel's wait for the
one before and its store. An `L2Plan` keeps the step's weight stream (the skinny GEMMs'
weights, in the order a forward reads them), cut into chunks, and a prefetcher kernel runs
beside the step (its own branch of the graph) asking the L2 for each chunk with a bulk
prefetch (`cp.async.bulk.prefetch.L2`, Hopper's TMA) once the step's GEMMs have come
within `ahead` bytes of it: each GEMM, once it may run, adds one to a progress counter,
which the prefetcher polls. The GEMMs then find their weights in L2. Prefetches change no
value; once the step's last GEMM has begun, the prefetcher's last program to finish sets
the counter back to zero.

The prefetcher has `PROGRAMS` programs of one warp, the pieces dealt round: one SM's bulk
prefetches were measured at ~0.3 TB/s on the H100 (the whole stream in 2.9 ms, against a
step of 0.56), far under the DRAM's bandwidth.

The plan is made from a recorded forward (`recording`), then applied to forwards run the
same way (`applying`: a CUDA graph's warm-up and capture). Its table has a row per piece of
the stream (at most `THREADS` prefetches of `CHUNK` bytes, one a thread), each with its own
release, so the lead holds piece by piece. A weight larger than any Hopper L2 (`LARGEST`:
the LM head) is left out of the stream: it streams at full bandwidth on its own, and
fetching it would evict what the rest fetched.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch import Tensor


def ahead_bytes() -> int:
    """NINFER_L2_AHEAD (MiB) as bytes; 0: no prefetch."""
    return int(float(os.environ.get("NINFER_L2_AHEAD", "0")) * 2 ** 20)


CHUNK = int(os.environ.get("NINFER_L2_CHUNK", str(64 * 1024)))  # bytes a prefetch
THREADS = 32    # the prefetcher's: programs of one warp, a chunk a thread per piece
PROGRAMS = int(os.environ.get("NINFER_L2_PROGRAMS", "16"))  # the prefetcher's programs
PATIENCE = 1 << 22     # the prefetcher's polls of the counter in all, at most
LARGEST = 64 * 2 ** 20  # a weight above this is left out of the stream (the LM head)


def streamed(address: int, n: int) -> bool:
    """Whether a weight goes into the stream: not above LARGEST, and where a bulk prefetch
    may name it (16-byte aligned, a multiple of 16 bytes)."""
    return n <= LARGEST and address % 16 == 0 and n % 16 == 0


class L2Plan:
    """The recorded weight stream of a forward and the prefetcher's table."""

    def __init__(self, ahead: int, chunk: int | None = None) -> None:
        self.ahead, self.chunk = ahead, chunk or CHUNK
        self.calls: list[tuple[int, int]] = []   # (address, bytes) per GEMM, in order
        self.table: Tensor | None = None         # [pieces, 3] int64 (address, bytes, release)
        # int32 [2]: GEMMs of this step begun, the prefetcher's programs finished
        self.progress: Tensor | None = None
        self._mode: str | None = None
        self._next = 0

    @contextlib.contextmanager
    def recording(self):
        """Record the GEMMs' weights of the forward run inside."""
        self.calls, self.table, self._mode = [], None, "record"
        try:
            yield self
        finally:
            self._mode = None

    @contextlib.contextmanager
    def applying(self, device: torch.device):
        """Run the prefetcher beside the forward run inside (on a side stream, joined at the
        end); its tables are made on first use, outside any capture."""
        if not self.calls:  # nothing to fetch (no skinny GEMM in this forward)
            yield self
            return
        if self.table is None:
            self.table = torch.tensor(self.pieces(), dtype=torch.int64,
                                      device=device).view(-1, 3)
            self.progress = torch.zeros(2, dtype=torch.int32, device=device)
        main = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            launch_prefetcher(self.table, self.progress, len(self.calls), self.chunk)
        self._mode, self._next = "apply", 0
        try:
            yield self
        finally:
            self._mode = None
            main.wait_stream(side)
        if self._next != len(self.calls):
            raise RuntimeError(f"{self._next} GEMMs ran of the {len(self.calls)} recorded")

    def pieces(self) -> list[tuple[int, int, int]]:
        """(address, bytes, release) per piece of the stream, in stream order: a piece is
        at most THREADS chunks, and is released once `release` GEMMs have begun, the last
        of them the first whose weight starts within `ahead` bytes of the piece, or the
        piece's own GEMM where none does (0: at once)."""
        starts, pos = [], 0
        for addr, n in self.calls:
            starts.append(pos)
            pos += n if streamed(addr, n) else 0
        piece, out, j = THREADS * self.chunk, [], 0
        for i, ((addr, n), s) in enumerate(zip(self.calls, starts, strict=True)):
            if not streamed(addr, n):
                continue
            for lo in range(0, n, piece):  # at the latest when its own GEMM begins
                while j < i and starts[j] + self.ahead < s + lo:
                    j += 1
                out.append((addr + lo, min(piece, n - lo), j + 1 if j else 0))
        return out

    def take(self, w: Tensor) -> Tensor | None:
        """The progress counter the calling GEMM adds to (None: none), recording its weight
        first."""
        if self._mode == "record":
            self.calls.append((w.data_ptr(), w.numel() * w.element_size()))
            return None
        if self._mode != "apply":
            return None
        j, self._next = self._next, self._next + 1
        if j >= len(self.calls) or self.calls[j][0] != w.data_ptr():
            raise RuntimeError(f"GEMM {j} of this forward is not the recorded one: the plan "
                               "holds for forwards that run as the recorded one ran")
        return self.progress


_active: L2Plan | None = None


@contextlib.contextmanager
def using(plan: L2Plan | None):
    """Make `plan` the one the GEMMs launched inside consult."""
    global _active
    before, _active = _active, plan
    try:
        yield plan
    finally:
        _active = before


def launch_args(w: Tensor) -> tuple[Tensor | None, bool]:
    """(progress counter or None, whether to count) for a GEMM over weight w."""
    counter = _active.take(w) if _active is not None else None
    return counter, counter is not None


@triton.jit
def begun(progress_ptr, first, ON: tl.constexpr):
    """A GEMM's program `first` says the GEMM has begun (call after `pdl.wait`)."""
    if ON:
        if first:
            tl.atomic_add(progress_ptr, 1, sem="relaxed")


@triton.jit
def _pick(v, t, i):
    return tl.sum(tl.where(t == i, v, 0))


@triton.jit
def _prefetcher_kernel(table_ptr, n_pieces, progress_ptr, calls, CHUNK: tl.constexpr,
                       NT: tl.constexpr, PATIENCE: tl.constexpr):
    """Program q takes pieces q, q + P, q + 2P, ... (P programs), NT rows of the table at a
    time, and polls the counter only while a piece waits for its release, at most PATIENCE
    times in all (seconds: a GEMM that never counts must not hang the GPU)."""
    q, P = tl.program_id(0), tl.num_programs(0)
    t = tl.arange(0, NT)
    seen = tl.load(progress_ptr, volatile=True)
    polls = 0
    for p0 in range(0, tl.cdiv(n_pieces - q, P), NT):  # this program's rows, NT at a time
        p = (p0 + t) * P + q
        m = p < n_pieces
        addrs = tl.load(table_ptr + p * 3, mask=m, other=0)
        sizes = tl.load(table_ptr + p * 3 + 1, mask=m, other=0)
        releases = tl.load(table_ptr + p * 3 + 2, mask=m, other=0)
        for i in range(NT):  # rows past the table's end: no bytes, released at once
            release = _pick(releases, t, i)
            while (seen < release) & (polls < PATIENCE):
                seen = tl.load(progress_ptr, volatile=True)
                polls += 1
            size = (_pick(sizes, t, i) - t * CHUNK).to(tl.int32)  # this thread's chunk
            size = tl.minimum(size, CHUNK)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [_pick(addrs, t, i) + t * CHUNK, size], dtype=tl.int32,
                is_pure=False, pack=1)
    while (seen < calls) & (polls < PATIENCE):  # the step's last GEMM has begun
        seen = tl.load(progress_ptr, volatile=True)
        polls += 1
    # the last program to get here: every program has seen the last count (none polls
    # any more), so the counters go back to zero for the next step
    if tl.atomic_add(progress_ptr + 1, 1, sem="acq_rel") == P - 1:
        tl.store(progress_ptr, 0)
        tl.store(progress_ptr + 1, 0)


def launch_prefetcher(table: Tensor, progress: Tensor, calls: int, chunk: int,
                      programs: int | None = None) -> None:
    """The prefetcher over `table` (`L2Plan.pieces`), `programs` (PROGRAMS) programs of one
    warp, for a step of `calls` counting GEMMs; progress: int32 [2], zeros."""
    P = max(1, min(programs or PROGRAMS, table.shape[0]))
    _prefetcher_kernel[(P,)](table, table.shape[0], progress, calls, CHUNK=chunk,
                             NT=THREADS, PATIENCE=PATIENCE, num_warps=1)


__all__ = ["L2Plan", "ahead_bytes", "begun", "launch_args", "using"]
