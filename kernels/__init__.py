"""Compute kernels: torch references (always available) beside the Triton kernels that run
them on a GPU (`device_kernels()`, imported on first use)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from ninfer.flags import FLAGS

from .gdn_reference import (
    causal_conv1d_update,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)


@functools.cache
def device_kernels() -> SimpleNamespace | None:
    """The Triton kernels (conv, chunk, step, attention and its prologue with the KV write,
    the attention layer's whole mixer for one new token, the fused elementwise ones, the
    skinny GEMMs with their prologues and epilogues, the greedy keys and a decode graph's
    first kernel), or None where Triton is missing.
    Callers use them for CUDA tensors only (on the CPU they run only in the interpreter)."""
    try:
        from . import fused, skinny
        from .conv1d import causal_conv1d_update as conv
        from .decode_attention import decode_attention
        from .gdn_chunk import chunk_gated_delta_rule as chunk
        from .gdn_decode import fused_recurrent_gated_delta_rule as step
        from .greedy import decode_start, greedy_keys
        from .kv_write import attention_prologue
        from .paged_attention import paged_attention_decode as attention
    except ImportError:
        return None
    return SimpleNamespace(conv=conv, chunk=chunk, step=step, attention=attention,
                           rms_norm=fused.rms_norm, gated_rms_norm=fused.gated_rms_norm,
                           silu_mul=fused.silu_mul, sigmoid_mul=fused.sigmoid_mul,
                           rope=fused.rope, qk_norm_gates=fused.qk_norm_gates,
                           linear=skinny.linear,
                           norm_linear=skinny.norm_linear,
                           gated_norm_linear=skinny.gated_norm_linear,
                           gate_linear=skinny.gate_linear,
                           attention_prologue=attention_prologue, greedy_keys=greedy_keys,
                           decode_start=decode_start, decode_attention=decode_attention)


_DTYPES = ("bfloat16", "float16", "float32")


def kernels_for(x) -> SimpleNamespace | None:
    """The Triton kernels for tensor `x`: on a GPU (or on the CPU in the interpreter, when
    `FLAGS.interpret_on_cpu`), in a dtype they take; None means the torch references."""
    if not (x.is_cuda or FLAGS.interpret_on_cpu) \
            or str(x.dtype).removeprefix("torch.") not in _DTYPES:
        return None
    return device_kernels()


def skinny_for(x) -> SimpleNamespace | None:
    """`kernels_for(x)` where x [..., K] has at most `FLAGS.skinny_rows` rows (one, unless
    a benchmark says otherwise), else None."""
    dev = kernels_for(x)
    if dev is None or x.numel() > FLAGS.skinny_rows * x.shape[-1]:
        return None
    return dev


__all__ = ["causal_conv1d_update", "chunk_gated_delta_rule", "device_kernels", "kernels_for",
           "recurrent_gated_delta_rule", "skinny_for"]
