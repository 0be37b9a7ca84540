"""A GDN layer's batch-1 decode mixer up to its output norm in one CUDA launch
(`kernels/gdn_fused.cu`): the input norm, the in-projection, the conv with its tail, and
the gated delta rule's step, for Hopper GPUs where nvcc is found. Elsewhere (and for any
other shape) the Triton chain runs: `kernels.skinny.norm_linear` with its conv epilogue,
then `kernels.gdn_decode`'s step, which is also this kernel's reference.

The library is built once per source on first use, into NINFER_KERNEL_CACHE (default
~/.cache/ninfer/kernels), and loaded with ctypes. NINFER_GDN_FUSED=0 (or FUSED = False,
the benchmark's "before") keeps the Triton chain."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("gdn_fused.cu")
DK = DV = 128
HIDDEN = 1024  # the hidden sizes the kernel is built for
RATIO = 2  # value heads per key head
MAXREG = 152  # registers a thread (x 320 threads: ~3/4 of an SM's file)
FUSED = os.environ.get("NINFER_GDN_FUSED", "1") != "0"


class _Params(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "h", "norm_w", "w", "conv_w", "conv_pool", "slots", "dests", "rec", "a_log", "dt_bias",
        "o", "z")] + [(name, ctypes.c_longlong) for name in (
            "s_w", "s_cwc", "s_cwk", "s_cn", "s_cc", "s_sn", "s_sh", "s_sk")] + [
        (name, ctypes.c_float) for name in ("eps", "offset", "scale")] + [
        (name, ctypes.c_int) for name in ("hk_heads", "hv_heads", "gates_f32", "fence")]


def nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build(out_dir: Path | None = None) -> Path:
    """The built library's path (built now unless the cache has it). Raises on failure."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found")
    source = SOURCE.read_bytes()
    flags = ["-O3", "-shared", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90a,code=sm_90a",
             f"-DMAXREG={MAXREG}"]
    tag = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    cache = out_dir or Path(os.environ.get("NINFER_KERNEL_CACHE",
                                           Path.home() / ".cache" / "ninfer" / "kernels"))
    lib = cache / f"gdn_fused-{tag}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, then moved in whole
        part = Path(tmp) / lib.name
        run = subprocess.run([compiler, *flags, "-o", str(part), str(SOURCE)],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"nvcc failed: {run.stderr[-2000:]}")
        os.replace(part, lib)
    return lib


def load(path: Path) -> ctypes.CDLL:
    """The built library at path, its entry points typed; raises if its Params differ."""
    lib = ctypes.CDLL(str(path))
    lib.ninfer_gdn_in_step.argtypes = [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_int,
                                       ctypes.c_void_p]
    lib.ninfer_gdn_in_step_clusters.argtypes = [ctypes.c_int]
    if lib.ninfer_gdn_in_step_params_size() != ctypes.sizeof(_Params):
        raise RuntimeError("gdn_fused: the library's Params differ from this module's")
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        return load(build())
    except (RuntimeError, OSError, AttributeError):
        return None


@functools.cache
def _supported(index: int) -> bool:
    # sm_90a code runs on compute capability 9.0 only; at least one cluster must fit
    if torch.cuda.get_device_capability(index) != (9, 0):
        return False
    lib = _library()
    return lib is not None and lib.ninfer_gdn_in_step_clusters(HIDDEN) > 0


def available(x: Tensor) -> bool:
    """Whether the fused kernel runs for tensors like x (a CUDA tensor on a Hopper GPU, the
    library built, not turned off)."""
    return FUSED and x.is_cuda and _supported(x.device.index or 0)


def fits(x: Tensor, w: Tensor, conv_pool: Tensor, rec_pool: Tensor, slots: Tensor,
         hk: int, hv: int, dk: int, dv: int) -> bool:
    """Whether a call with these operands is one the kernel takes (else: the Triton chain)."""
    n = 2 * hk * dk + 2 * hv * dv + 2 * hv
    return (x.shape == (1, 1, HIDDEN) and x.dtype == torch.bfloat16 and x.is_contiguous()
            and x.data_ptr() % 16 == 0
            and dk == DK and dv == DV and hv == RATIO * hk
            and w.dtype == torch.bfloat16 and tuple(w.shape) == (n, HIDDEN) and w.stride(1) == 1
            and w.stride(0) % 8 == 0 and w.data_ptr() % 16 == 0
            and conv_pool.dtype == torch.bfloat16 and conv_pool.stride(2) == 1
            and conv_pool.shape[1:] == (2 * hk * dk + hv * dv, 3)
            and rec_pool.dtype == torch.float32 and tuple(rec_pool.shape[1:]) == (hv, dk, dv)
            and rec_pool.stride(-1) == 1 and all(s % 4 == 0 for s in rec_pool.stride()[:3])
            and rec_pool.data_ptr() % 16 == 0 and slots.shape == (1,)
            and slots.dtype == torch.int64)


def fits_weights(norm_weight: Tensor, conv_weight: Tensor, dests: Tensor) -> bool:
    """The rest of `fits`: the norm's and the conv's weights, the destination slots."""
    return (norm_weight.dtype == torch.bfloat16 and norm_weight.is_contiguous()
            and norm_weight.data_ptr() % 16 == 0 and conv_weight.dtype == torch.bfloat16
            and conv_weight.dim() == 2 and conv_weight.shape[1] == 4
            and dests.shape == (1,) and dests.dtype == torch.int64)


def in_step(x: Tensor, norm_weight: Tensor, eps: float, w: Tensor, conv_weight: Tensor,
            conv_pool: Tensor, slots: Tensor, dests: Tensor, rec_pool: Tensor, A_log: Tensor,
            dt_bias: Tensor, hk: int, hv: int, offset: float = 1.0,
            scale: float | None = None) -> tuple[Tensor, Tensor]:
    """x [1, 1, hidden] (the residual stream) -> (o, z), each [1, 1, hv, 128]: what
    `norm_linear(x, norm_weight, eps, w, conv=(conv_pool, slots, conv_weight, dests))` then
    the step (`fused_recurrent_gated_delta_rule` with use_qk_l2norm, raw gates (a, b,
    A_log, dt_bias), state_indices=slots, out_indices=dests) give: o the step's output,
    z the output gate's projection. The conv tail and the recurrent state are updated at
    slot dests[0] as those kernels update them. Callers check `available` and `fits`."""
    from . import pdl  # (Triton: imported where a GPU call needs it)
    lib = _library()
    o = x.new_empty(1, 1, hv, DV)
    z = x.new_empty(1, 1, hv, DV)
    launch = pdl.launch(x, fenced=True)
    gates_f32 = A_log.dtype == torch.float32
    A_log = A_log.to(torch.float32 if gates_f32 else torch.bfloat16).contiguous()
    dt_bias = dt_bias.to(A_log.dtype).contiguous()
    p = _Params(
        h=x.data_ptr(), norm_w=norm_weight.data_ptr(), w=w.data_ptr(),
        conv_w=conv_weight.data_ptr(), conv_pool=conv_pool.data_ptr(), slots=slots.data_ptr(),
        dests=dests.data_ptr(), rec=rec_pool.data_ptr(), a_log=A_log.data_ptr(),
        dt_bias=dt_bias.data_ptr(), o=o.data_ptr(), z=z.data_ptr(),
        s_w=w.stride(0), s_cwc=conv_weight.stride(0), s_cwk=conv_weight.stride(1),
        s_cn=conv_pool.stride(0), s_cc=conv_pool.stride(1), s_sn=rec_pool.stride(0),
        s_sh=rec_pool.stride(1), s_sk=rec_pool.stride(2), eps=eps, offset=offset,
        scale=DK ** -0.5 if scale is None else scale, hk_heads=hk, hv_heads=hv,
        gates_f32=int(gates_f32), fence=int(launch.get("FENCE", False)))
    stream = torch.cuda.current_stream(x.device).cuda_stream
    err = lib.ninfer_gdn_in_step(ctypes.byref(p), HIDDEN, int(launch["PDL"]), stream)
    if err != 0:
        raise RuntimeError(f"gdn_fused launch failed: CUDA error {err}")
    return o, z
