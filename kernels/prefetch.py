"""Weights pulled into L2 ahead of the GEMMs that read them, by a kernel beside the step.

A decode step streams ~1.2 GB of weights through a chain of ~120 dependent kernels, and
between two GEMMs the DRAM idles: the GDN step, the attention, each kernel's wait for the
one before and its store. An `L2Plan` keeps the step's weight stream (the skinny GEMMs'
weights, in the order a forward reads them), cut into chunks, and a prefetcher kernel runs
beside the step (its own branch of the graph) asking the L2 for each chunk with a bulk
prefetch (`cp.async.bulk.prefetch.L2`, Hopper's TMA) once the step's GEMMs have come
within `ahead` bytes of it: each GEMM, once it may run, adds one to a progress counter,
which the prefetcher polls. The GEMMs then find their weights in L2. Prefetches change no
value; the prefetcher sets the counter back to zero once the step's last GEMM has begun.

The plan is made from a recorded forward (`recording`), then applied to forwards run the
same way (`applying`: a CUDA graph's warm-up and capture). A GEMM whose weight is larger
than `ahead` (the LM head) is left out of the stream: it streams at full bandwidth on its
own, and fetching it would evict what the rest fetched.
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
THREADS = 128   # the prefetcher's: one program, a chunk per thread at a time


class L2Plan:
    """The recorded weight stream of a forward and the prefetcher's table."""

    def __init__(self, ahead: int, chunk: int | None = None) -> None:
        self.ahead, self.chunk = ahead, chunk or CHUNK
        self.calls: list[tuple[int, int]] = []   # (address, bytes) per GEMM, in order
        self.table: Tensor | None = None         # [chunks, 3] int64 (address, bytes, release)
        self.progress: Tensor | None = None      # int32 [1]: GEMMs of this step begun
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
            self.table = torch.tensor(self.chunks(), dtype=torch.int64,
                                      device=device).view(-1, 3)
            self.progress = torch.zeros(1, dtype=torch.int32, device=device)
        main = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _prefetcher_kernel[(1,)](self.table, self.table.shape[0], self.progress,
                                     len(self.calls), NT=THREADS, num_warps=THREADS // 32)
        self._mode, self._next = "apply", 0
        try:
            yield self
        finally:
            self._mode = None
            main.wait_stream(side)
        if self._next != len(self.calls):
            raise RuntimeError(f"{self._next} GEMMs ran of the {len(self.calls)} recorded")

    def chunks(self) -> list[tuple[int, int, int]]:
        """(address, bytes, release) per chunk of the stream, in stream order: a chunk is
        released once `release` GEMMs have begun, the last of them the first whose start is
        within `ahead` bytes of the chunk (0: at once)."""
        starts, pos = [], 0
        for _, n in self.calls:
            starts.append(pos)
            pos += n if n <= self.ahead else 0
        out, j = [], 0
        for (addr, n), s in zip(self.calls, starts, strict=True):
            if n > self.ahead:
                continue
            for lo in range(0, n, self.chunk):
                while starts[j] + self.ahead < s + lo:
                    j += 1
                out.append((addr + lo, min(self.chunk, n - lo), j + 1 if j else 0))
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
def _wait_for(progress_ptr, target):
    """Poll until the counter reaches target, or ~2^22 polls have passed (seconds: a GEMM
    that never counts must not hang the GPU)."""
    done = tl.load(progress_ptr, volatile=True)
    polls = 0
    while (done < target) & (polls < 4194304):
        done = tl.load(progress_ptr, volatile=True)
        polls += 1


@triton.jit
def _prefetcher_kernel(table_ptr, n_chunks, progress_ptr, calls, NT: tl.constexpr):
    t = tl.arange(0, NT)
    for c0 in range(0, n_chunks, NT):
        c = c0 + t
        m = c < n_chunks
        addr = tl.load(table_ptr + c * 3, mask=m, other=0)
        size = tl.load(table_ptr + c * 3 + 1, mask=m, other=0).to(tl.int32)
        release = tl.max(tl.load(table_ptr + c * 3 + 2, mask=m, other=0))
        _wait_for(progress_ptr, release)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    _wait_for(progress_ptr, calls)
    tl.store(progress_ptr, 0)


__all__ = ["L2Plan", "ahead_bytes", "begun", "launch_args", "using"]
