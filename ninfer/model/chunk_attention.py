"""A prefill chunk's attention on the GPU: its T queries over the lane's L keys, the last T of
which are its own (query i sees keys up to L - T + i).

As one call, that is SDPA with the causal mask aligned to the bottom right, which only
flash attention takes without a mask tensor: at anchor-1b's heads of 256 it ran at ~300
TFLOP/s, 87 of the ~230 ms of a 32K prefill on the H100 (bench/NOTES.md, stop 43). Split
in two, the chunk's queries over the prefix (every key visible, no mask) and over the chunk
itself (square, causal from the top left, which is the same as the bottom right there), each
half reaches cuDNN's kernel; the halves are merged by their log-sum-exps. Measured on the
H100 (bench/attention_split.py): 51 ms for the same prefill, 450-550 TFLOP/s per chunk past
the first. A chunk with no prefix (L == T) stays one flash call, which is as fast.

Only shapes `prepare` has run take the split. cuDNN builds a plan per shape (a few hundred
ms, by public reports: sglang's and MLX's cuDNN attention), so a split over any length would
land that on the first request of each prompt length; `prepare`, run by the warm-up before
the server says it is ready, builds the plans of a served prompt's whole chunks (T = the
prefill chunk, the prefix a whole number of chunks), and every other chunk (a prompt's last
partial chunk, a next turn's delta) stays one flash call.

`FLAGS.split_chunk_attention` switches the split off (the benchmarks' "before"); a backend
that refuses it (another card, another torch) is logged once and the whole call is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..flags import FLAGS

log = logging.getLogger("ninfer.model")

# half(q [1, H, T, D], k, v [1, Hkv, S, D], causal, scale) -> (out [1, H, T, D], lse
# [1, H, T] float32, natural log)
Half = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]

_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_refused: list[str] = []  # the backend's refusal, once met: the split is not tried again
_prepared: set[tuple] = set()  # the shapes whose halves `prepare` ran (`_shape`)
MAX_PREPARED = 16  # prefixes of up to this many chunks take the split; longer ones do not


def chunk_attention(q: Tensor, keys: Tensor, values: Tensor, scale: float,
                    half: Half | None = None) -> Tensor:
    """q [1, H, T, D] over keys / values [1, Hkv, L, D] (L >= T), causal from the bottom
    right: [1, H, T, D]. `half`: the split's attention (default cuDNN's on the GPU, none
    elsewhere)."""
    half = half or (cudnn_half if q.is_cuda else None)
    if _shape(q, keys) in _prepared and half is not None and FLAGS.split_chunk_attention \
            and not _refused:
        try:
            return split_attention(q, keys, values, scale, half)
        except RuntimeError as exc:  # a card or build whose cuDNN lacks this shape
            _refuse(exc)
    return whole_attention(q, keys, values, scale)


def _shape(q: Tensor, keys: Tensor) -> tuple:
    """What a plan is built for: (T, the prefix's length, heads, KV heads, head size,
    dtype, device)."""
    _, H, T, D = q.shape
    return T, keys.shape[2] - T, H, keys.shape[1], D, q.dtype, q.device


def _refuse(exc: Exception) -> None:
    _refused.append(f"{type(exc).__name__}: {exc}"[:300])
    log.warning("a prefill chunk's attention in two cuDNN halves failed (%s); using one "
                "flash call from now on", _refused[0])


def prepare(*, heads: int, kv_heads: int, head_dim: int, chunk: int, max_context: int,
            device: torch.device | str, dtype: torch.dtype, half: Half | None = None
            ) -> list[tuple[int, int]]:
    """Run the split once on each shape of a served prompt's whole chunks past the first
    (`chunk` queries over a prefix of k chunks, the prefix and the chunk within
    `max_context`, k up to MAX_PREPARED), so cuDNN's plans are built now, and from now on
    those shapes take the split. The shapes prepared, as (chunk, prefix); none where no half
    applies (the CPU by default) or the backend refuses."""
    device = torch.device(device)
    half = half or (cudnn_half if device.type == "cuda" else None)
    if half is None or not FLAGS.split_chunk_attention or _refused or chunk < 2:
        return []
    done = []
    q = torch.zeros(1, heads, chunk, head_dim, device=device, dtype=dtype)
    for k in range(1, min(MAX_PREPARED, max_context // chunk - 1) + 1):
        kv = torch.zeros(1, kv_heads, (k + 1) * chunk, head_dim, device=device, dtype=dtype)
        try:
            split_attention(q, kv, kv, head_dim ** -0.5, half)
        except RuntimeError as exc:
            _refuse(exc)
            return []
        _prepared.add(_shape(q, kv))
        done.append((chunk, k * chunk))
    return done


def whole_attention(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """One SDPA call with the bottom-right causal mask, the KV heads shared by their query
    heads inside the kernel: [1, H, T, D]. Never by cuDNN: a chunk with no prefix (L == T)
    is plain causal, where SDPA prefers cuDNN on an H100 or H200, whose plan per shape cost
    a served prompt of a length not seen before ~45 ms (bench/NOTES.md, stop 47), and
    building the plan of a whole first chunk of 8,192 before ready took 6.4 s; flash takes
    any length at once."""
    from torch.nn.attention.bias import causal_lower_right
    T, L = q.shape[2], keys.shape[2]
    with without_cudnn():
        return F.scaled_dot_product_attention(q, keys, values,
                                              attn_mask=causal_lower_right(T, L), scale=scale,
                                              enable_gqa=q.shape[1] != keys.shape[1])


def without_cudnn():
    """SDPA's backends but cuDNN, for the calls inside: cuDNN builds a plan for each shape
    it meets (tens to hundreds of ms on an H100), and a served request's shapes follow its
    prompt's length."""
    return sdpa_kernel(_NOT_CUDNN)


def split_attention(q: Tensor, keys: Tensor, values: Tensor, scale: float,
                    half: Half) -> Tensor:
    """The chunk over the prefix and over itself by `half`, merged: [1, H, T, D]."""
    T, L = q.shape[2], keys.shape[2]
    o1, l1 = half(q, keys[:, :, :L - T], values[:, :, :L - T], False, scale)
    o2, l2 = half(q, keys[:, :, L - T:], values[:, :, L - T:], True, scale)
    l1, l2 = (lse.float().reshape(q.shape[:3]) for lse in (l1, l2))
    top = torch.maximum(l1, l2)  # every row sees at least one key of each half: finite
    w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
    total = w1 + w2
    out = o1.float() * (w1 / total)[..., None] + o2.float() * (w2 / total)[..., None]
    return out.to(q.dtype)


def _shared(kv: Tensor, heads: int) -> Tensor:
    """KV heads repeated for their query heads (query head h reads KV head h // group)."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def cudnn_half(q: Tensor, k: Tensor, v: Tensor, causal: bool,
               scale: float) -> tuple[Tensor, Tensor]:
    """One half by cuDNN's fused attention, with its log-sum-exp."""
    H = q.shape[1]
    # contiguous, so a served chunk's tensors have the strides `prepare`'s had: cuDNN's
    # plans are cached by shape and strides
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.contiguous(), _shared(k, H).contiguous(), _shared(v, H).contiguous(), None, True,
        0.0, causal, False, scale=scale)[:2]
    return out, lse


def cpu_half(q: Tensor, k: Tensor, v: Tensor, causal: bool,
             scale: float) -> tuple[Tensor, Tensor]:
    """One half by the CPU's flash attention, with its log-sum-exp (the tests' half)."""
    H = q.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, _shared(k, H), _shared(v, H), 0.0, causal, scale=scale)
    return out, lse
