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
NINFER_PDL=0 turns it off (the benchmark's "before").

A fence (`fence(x)`): a kernel that writes what later kernels read before their wait (a
zero-copy decode step's first kernel, which fetches the staged inputs) asks that nothing
after it start before it has finished. The next PDL kernel launched keeps that: one that
takes a `FENCE` constexpr (`launch(x, fenced=True)`: the skinny GEMMs) reads nothing
before its wait but its weights and lets its dependents start only after its wait, so its
own weights still load while the fencing kernel runs; any other is preceded by a kernel
launched without PDL (a barrier), which starts only once everything before it has
finished.

Signals (`signalled()`, an experiment: `ninfer.bench.persistent`'s `chain_signals`): inside
a graph capture in that context, a kernel that takes them (the skinny GEMMs) ends by
counting itself done (a release after every thread's stores) in one of GROUPS counters of a
fresh slice of an arena, program p in counter p % GROUPS, each counter on its own 128-byte
line; and the next such kernel, when nothing was launched between the two, waits until
each of those counters holds its programs' count for this replay instead of `wait`. Which
replay it is, a program reads off its own kernel's counter (every slice starts at zero and
each replay counts every program once, so they stay in step). What `wait` gives holds for
it too: the kernel before waited for everything before it, and counted itself only at its
end. An aten op that is not a view, run in between, breaks the pair (a dispatch mode
watches), since its kernel would not be waited for."""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch
import triton
import triton.language as tl


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels over x launch with PDL: a Hopper-or-later GPU, not turned off."""
    return (x.is_cuda and os.environ.get("NINFER_PDL", "1") != "0"
            and _supported(x.device.index or 0))


_fence = threading.local()  # .pending: a fence not yet kept by a launch (this thread's)
# False: a fence is kept by a barrier whatever the next kernel (the benchmark's "before",
# `ninfer.bench.gpu_engine`)
FENCE_IN_KERNEL = True


def fence(x: torch.Tensor) -> None:
    """Nothing launched after this point may start before the kernel just launched over x
    has finished: kept by the next `launch` (see the module docstring). Without PDL every
    kernel starts after the one before it has finished: nothing to keep."""
    if enabled(x):
        _fence.pending = True


class _Signals(threading.local):
    arena: torch.Tensor | None = None   # int32 counts, zeros until a replay counts them
    used = 0
    last: tuple[torch.Tensor, int] | None = None  # the kernel just launched: its counts, n


_signals = _Signals()


class _Breaks(torch.utils._python_dispatch.TorchDispatchMode):
    """An aten op run between two signalled kernels launches a kernel that the second
    would not wait for: any op but a view or an allocation forgets the first."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func in _ALLOCATIONS):
            _signals.last = None
        return func(*args, **(kwargs or {}))


_ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default)


@contextlib.contextmanager
def signalled(device: torch.device, capacity: int = 1 << 20):
    """Kernels captured in a CUDA graph inside this context signal each other (the module
    docstring). The arena is made here, outside the capture, and must outlive the graph:
    it is returned."""
    arena = torch.zeros(capacity, dtype=torch.int32, device=device)
    _signals.arena, _signals.used, _signals.last = arena, 0, None
    try:
        with _Breaks():
            yield arena
    finally:
        _signals.arena, _signals.last = None, None


GROUPS, LINE = 32, 32  # counters a kernel, int32s apart


def _no_signals(x: torch.Tensor) -> dict:
    return {"sig_in": x, "n_sig_in": 1, "sig_out": x, "n_sig_out": 1, "SIG_IN": False,
            "SIG_OUT": False}


def _signal_keywords(x: torch.Tensor, programs: int) -> dict:
    """SIG_IN / SIG_OUT and their counters for a kernel of `programs` that takes them."""
    arena = _signals.arena
    last, _signals.last = _signals.last, None
    if arena is None or not torch.cuda.is_current_stream_capturing() \
            or _signals.used + GROUPS * LINE > arena.numel():
        return _no_signals(x)
    out = arena[_signals.used:_signals.used + GROUPS * LINE]
    _signals.used += GROUPS * LINE
    _signals.last = (out, programs)
    sig_in, n = last if last is not None else (out, 1)
    return {"sig_in": sig_in, "n_sig_in": n, "sig_out": out, "n_sig_out": programs,
            "SIG_IN": last is not None, "SIG_OUT": True}


def launch(x: torch.Tensor, fenced: bool = False, programs: int | None = None) -> dict:
    """The launch keywords for a PDL-aware kernel over x (see the module docstring);
    `fenced`: the kernel takes a FENCE constexpr, and is given one; `programs`: the
    kernel takes signals (`signal_wait`, `signal_done`), and is launched with that many."""
    signals = {}
    if programs is not None:
        signals = _signal_keywords(x, programs) if enabled(x) else _no_signals(x)
    else:
        _signals.last = None
    if not enabled(x):
        return {"PDL": False, **({"FENCE": False} if fenced else {}), **signals}
    pending = getattr(_fence, "pending", False)
    _fence.pending = False
    if pending and not (fenced and FENCE_IN_KERNEL):
        _barrier_kernel[(1,)](x)  # launched without PDL
        pending = False
    if pending and signals.get("SIG_IN"):  # a fence is kept by the real wait
        signals["SIG_IN"] = False
    return {"PDL": True, "launch_pdl": True, **({"FENCE": pending} if fenced else {}),
            **signals}


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


@triton.jit
def _in_group(n, g):
    """How many of n programs count in counter g (program p in p % GROUPS)."""
    return (n - g + 31) // 32


@triton.jit
def signal_replay(sig_out_ptr, n_out, pid, SIG_OUT: tl.constexpr):
    """Which replay this is: how many times this kernel's programs counted themselves done
    before (0 without signals). Read off this program's counter, to which this replay's
    other programs may have added, but never all of its group."""
    if SIG_OUT:
        g = pid % 32
        return tl.load(sig_out_ptr + g * 32, volatile=True) // _in_group(n_out, g)
    else:
        return 0


@triton.jit
def signal_wait(sig_in_ptr, n_in, replay):
    """Until every program of the kernel before has counted itself done this replay, then
    an acquire: their writes are visible from here on."""
    g = tl.arange(0, 32)
    need = (replay + 1) * _in_group(n_in, g)
    ready = tl.min((tl.load(sig_in_ptr + g * 32, volatile=True) >= need).to(tl.int32), axis=0)
    while ready == 0:
        ready = tl.min((tl.load(sig_in_ptr + g * 32, volatile=True) >= need).to(tl.int32),
                       axis=0)
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def signal_done(sig_out_ptr, pid, SIG_OUT: tl.constexpr):
    """Count this program done, after every thread's stores (a release)."""
    if SIG_OUT:
        tl.debug_barrier()
        tl.atomic_add(sig_out_ptr + (pid % 32) * 32, 1, sem="release", scope="gpu")
