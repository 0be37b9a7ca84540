"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's kernels.

A decode step is a chain of small kernels, each waiting for the one before. With PDL a
kernel is launched while its predecessor still runs: its programs start as soon as the
predecessor's have all started (`launch_dependents`) and there is room on the SMs, do what
needs nothing the predecessor writes (a GEMM's weight loads), then `wait` until the
predecessor has finished and its writes are visible. The launch latency and the first DRAM
round trip overlap the previous kernel's tail.

The rule every kernel launched this way keeps: nothing read that an earlier kernel writes,
and nothing written at all, before `wait` (a buffer written here may be one the previous
kernel still reads: graph pools reuse memory). Waiting covers every earlier kernel, not only
the last: the last one waited for its own predecessor before it could finish. One exception: what
only earlier forwards or the host write (a decode step's GDN slot pools, its positions and
block tables) may be read before `wait`, because a forward's chain starts only once
everything before it has finished (a graph's first kernel, or one after the host's copies),
and what its first kernel writes for them is fenced (below; `early_state` of
`kernels.gdn_decode`).

`launch(x)` gives the launch keywords for a kernel over tensor x: `PDL` (the kernel's
constexpr: whether to emit the two instructions) and, where it applies, `launch_pdl`.
`ninfer.flags.FLAGS.pdl` turns it off (NINFER_PDL=0; the benchmark's "before").

A fence (`fence(x)`): a kernel that writes what later kernels read before their wait (a
zero-copy decode step's first kernel, which fetches the staged inputs) asks that nothing
after it start before it has finished. The next PDL kernel launched keeps that: one that
takes a `FENCE` constexpr (`launch(x, fenced=True)`: the skinny GEMMs) reads nothing
before its wait but its weights and lets its dependents start only after its wait, so its
own weights still load while the fencing kernel runs; any other is preceded by a kernel
launched without PDL (a barrier), which starts only once everything before it has
finished."""

from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl

from ninfer.flags import FLAGS


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels over x launch with PDL: a Hopper-or-later GPU, `FLAGS.pdl`."""
    return x.is_cuda and FLAGS.pdl and _supported(x.device.index or 0)


_fence = threading.local()  # .pending: a fence not yet kept by a launch (this thread's)


def fence(x: torch.Tensor) -> None:
    """Nothing launched after this point may start before the kernel just launched over x
    has finished: kept by the next `launch` (see the module docstring). Without PDL every
    kernel starts after the one before it has finished: nothing to keep."""
    if enabled(x):
        _fence.pending = True


def launch(x: torch.Tensor, fenced: bool = False) -> dict:
    """The launch keywords for a PDL-aware kernel over x (see the module docstring);
    `fenced`: the kernel takes a FENCE constexpr, and is given one."""
    if not enabled(x):
        return {"PDL": False, **({"FENCE": False} if fenced else {})}
    pending = getattr(_fence, "pending", False)
    _fence.pending = False
    if pending and not (fenced and FLAGS.fence_in_kernel):
        _barrier_kernel[(1,)](x)  # launched without PDL
        pending = False
    return {"PDL": True, "launch_pdl": True, **({"FENCE": pending} if fenced else {})}


@triton.jit
def _barrier_kernel(x_ptr):
    """Nothing: launched without PDL, a point in the chain that every kernel launched after
    it starts behind."""
    pass


@triton.jit
def wait(PDL: tl.constexpr):
    """Until the kernels before this one have finished and their writes are visible."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    """Let the next kernel start its programs (they still `wait` for this one). A fenced
    kernel calls it after its `wait`."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)
