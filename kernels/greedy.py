"""The greedy token of a decode step, found on the device where the logits are made, and the
decode graph's first kernel, which feeds a step its tokens from the step before.

Between two replays of a batch-1 decode graph the stream used to run an argmax over the
vocabulary, copies of the token into the next replay's inputs and the embedding and rotary
kernels: each its own launch, each gap a few microseconds. Here:

- A *greedy key* packs a logit and its column into one int64 whose integer order is the
  argmax's: the logit's float32 bits made order-preserving in the high word, the column
  subtracted from 2^32 - 1 in the low word (so of equal logits the first column wins, as
  torch.argmax picks). The skinny LM-head GEMM (`kernels.skinny`, `argmax=`) takes the max
  of each program's keys and `atomic_max`es it into the row's key; `greedy_keys` does the
  same from logits already made (several rows, cuBLAS). `token_of(keys)` reads them back.
- `decode_start` is the first kernel of the graph: per lane it takes the token from the
  staged inputs, or, where the host staged -1, from the key the previous replay left (the
  step run ahead of the engine), resets the key, gathers the embedding row and computes
  the rotary cos / sin of the lane's position (`ninfer.model.layers.rope_cos_sin`'s
  float32 arithmetic: tl.cos and tl.sin are libdevice's cosf and sinf, as torch's are).
  It reads only what was written before the graph began (the staged inputs, the keys the
  last replay left), and launches with PDL (`kernels.pdl`) so that the first GEMM loads
  its weights while it runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import pdl

KEY_NONE = -(2 ** 63)  # the reset key: below every real one
_LOW = 0xFFFFFFFF
KEY_NONE_C = tl.constexpr(KEY_NONE)


@triton.jit
def _low_word(x):
    """2^32 - 1 - x for x in [0, 2^32), as int64: the low word of a key, and back."""
    return tl.full(x.shape, 4294967295, tl.int64) - x.to(tl.int64)


@triton.jit
def key_of(v, cols):
    """Greedy keys of float32 logits v at columns cols (same shape): int64, ordered as
    (logit, -column)."""
    bits = (v + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 ties with +0.0, as in argmax
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    return (ordered << 32) | _low_word(cols)


@triton.jit
def _greedy_keys_kernel(x_ptr, keys_ptr, V, s_x, BV: tl.constexpr):
    row, blk = tl.program_id(0), tl.program_id(1)
    cols = blk * BV + tl.arange(0, BV)
    v = tl.load(x_ptr + row.to(tl.int64) * s_x + cols, mask=cols < V, other=0.0)
    key = tl.where(cols < V, key_of(v.to(tl.float32), cols), KEY_NONE_C)
    tl.atomic_max(keys_ptr + row, tl.max(key, axis=0))


def greedy_keys(logits: Tensor, keys: Tensor) -> Tensor:
    """Fold the greedy keys of logits [B, V] into keys [B] (int64, reset to KEY_NONE or
    holding keys of other columns of the same rows); returns keys."""
    B, V = logits.shape
    if keys.shape != (B,) or keys.dtype != torch.int64 or logits.stride(-1) != 1:
        raise ValueError(f"greedy keys of logits {tuple(logits.shape)} go to an int64 [B], "
                         f"got {tuple(keys.shape)} {keys.dtype}")
    BV = 4096 if logits.is_cuda else 64
    _greedy_keys_kernel[(B, triton.cdiv(V, BV))](logits, keys, V, logits.stride(0), BV=BV)
    return keys


def token_of(keys: Tensor) -> Tensor:
    """The columns the keys name (int64, on the keys' device)."""
    return _LOW - (keys & _LOW)


def greedy_keys_reference(logits: Tensor) -> Tensor:
    """The keys greedy_keys makes, in torch: (order-preserving bits << 32) | (2^32-1 - col)
    of each row's argmax."""
    v = logits.float() + 0.0
    col = v.argmax(-1)
    bits = v.gather(-1, col[:, None])[:, 0].view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered << 32) | (_LOW - col)


@triton.jit
def _decode_start_kernel(ids_ptr, pos_ptr, keys_ptr, emb_ptr, freq_ptr, h_ptr, cos_ptr,
                         sin_ptr, D, R, s_e, V, ring_ptr, turn_ptr, inputs_ptr, N, S, RING,
                         BD: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                         FETCH: tl.constexpr, PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    b = tl.program_id(0)
    if FETCH:  # the host's staging row of this turn, read through the bus (".cv": the
        # L2 may hold an older turn's lines of it); a row staged for another turn (a replay
        # the host did not count) is not used: the neutral row is, which no lane reads from
        # or writes to, and publish_keys tells the host
        turn = tl.load(turn_ptr)
        mine = turn & (RING - 1)  # (RING a power of two: an int64 modulo spills here)
        seq = tl.load(ring_ptr + mine * (N + 1), cache_modifier=".cv")
        src = ring_ptr + tl.where(seq == turn, mine, RING) * (N + 1) + 1
        staged = tl.load(src + b, cache_modifier=".cv")
        pos = tl.load(src + S + b, cache_modifier=".cv")
    else:
        staged = tl.load(ids_ptr + b)
        pos = tl.load(pos_ptr + b)
    key = tl.load(keys_ptr + b)
    pdl.wait(PDL)  # (nothing runs before this kernel in its graph: the rule for writes)
    tl.store(keys_ptr + b, KEY_NONE_C)  # this program read it: the next LM head folds anew
    left = _low_word(key & 4294967295)
    token = tl.where(staged >= 0, staged, tl.where(key != KEY_NONE_C, left, 0))
    token = tl.minimum(tl.maximum(token, 0), V - 1).to(tl.int64)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        row = tl.load(emb_ptr + token * s_e + d, mask=d < D, other=0.0)
        tl.store(h_ptr + b.to(tl.int64) * D + d, row, mask=d < D)
    r = tl.arange(0, BR)
    angles = pos.to(tl.float32) * tl.load(freq_ptr + r, mask=r < R, other=0.0)
    dt = cos_ptr.dtype.element_ty
    tl.store(cos_ptr + b * R + r, tl.cos(angles).to(dt), mask=r < R)
    tl.store(sin_ptr + b * R + r, tl.sin(angles).to(dt), mask=r < R)
    if FETCH:  # this program's share of the whole staged buffer, for the kernels after
        share = tl.cdiv(N, tl.num_programs(0))
        end = tl.minimum(b * share + share, N)
        for i0 in range(b * share, end, BN):
            i = i0 + tl.arange(0, BN)
            v = tl.load(src + i, mask=i < end, other=0, cache_modifier=".cv")
            tl.store(inputs_ptr + i, v, mask=i < end)
        if b == 0:  # for publish_keys: the turn, or -2 where the row was not staged for it
            tl.store(turn_ptr + 1, tl.where(seq == turn, turn, -2))


def decode_start(ids: Tensor, positions: Tensor, keys: Tensor, embedding: Tensor,
                 inv_freq: Tensor, fetch: tuple[Tensor, Tensor, Tensor] | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """One token per lane: ids, positions [B, 1] int64 (a negative id: the token `keys[b]`
    names), keys [B] (reset here), embedding [V, D], inv_freq [R] float32 (the rotary
    frequencies twice over). Returns h [B, 1, D] (the embedding rows) and cos, sin
    [B, 1, R] in the embedding's dtype.

    `fetch` = (ring [RING + 1, 1 + N] int64 in pinned host memory, RING a power of two;
    turn [2] int64; inputs [N] int64), zero-copy staging: the staged inputs are read from
    the host's ring, not from ids and positions (which must be views of inputs: ids its
    first B, positions its next B), and copied into inputs for the kernels after this one,
    which start only once it has finished (`kernels.pdl.fence`).
    The row read is turn[0] % RING where its first word (the turn the host staged it for)
    is turn[0], else the last row (neutral: padding lanes only); turn[1] gets turn[0], or
    -2 where the neutral row was read (`publish_keys` hands it to the host, which checks it
    is the launch it staged, and moves the turn on)."""
    B = ids.shape[0]
    V, D = embedding.shape
    R = inv_freq.shape[0]
    if ids.shape != (B, 1) or positions.shape != (B, 1) or keys.shape != (B,) \
            or embedding.stride(-1) != 1:
        raise ValueError(f"decode_start takes ids/positions [B, 1] and keys [B], got "
                         f"{tuple(ids.shape)}, {tuple(positions.shape)}, {tuple(keys.shape)}")
    ring, turn, inputs = fetch if fetch is not None else (keys, keys, keys)
    if fetch is not None and (ring.dim() != 2 or not _power_of_two(ring.shape[0] - 1)
                              or inputs.dim() != 1
                              or ring.shape[1] != 1 + inputs.shape[0]
                              or ring.dtype != torch.int64 or inputs.dtype != torch.int64
                              or turn.shape != (2,) or ids.data_ptr() != inputs.data_ptr()
                              or positions.data_ptr() != inputs.data_ptr() + 8 * B):
        raise ValueError("decode_start fetches from an int64 ring [RING + 1, 1 + N] into "
                         "inputs [N] whose first B are the ids and next B the positions")
    h = torch.empty(B, 1, D, dtype=embedding.dtype, device=embedding.device)
    cos = torch.empty(B, 1, R, dtype=embedding.dtype, device=embedding.device)
    sin = torch.empty_like(cos)
    _decode_start_kernel[(B,)](ids, positions, keys, embedding, inv_freq, h, cos, sin,
                               D, R, embedding.stride(0), V, ring, turn, inputs,
                               ring.shape[-1] - 1, B, ring.shape[0] - 1,
                               BD=min(triton.next_power_of_2(D), 4096),
                               BR=triton.next_power_of_2(R), BN=1024 if ids.is_cuda else 64,
                               FETCH=fetch is not None, **pdl.launch(embedding))
    if fetch is not None:  # the kernels after this read the staged inputs before their
        # PDL wait (a GDN step its slots, the attention its block table): none may start
        # before this one has finished (kept by the next launch: `kernels.pdl`)
        pdl.fence(embedding)
    return h, cos, sin


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@triton.jit
def _publish_keys_kernel(keys_ptr, ring_ptr, turn_ptr, S, RING, BS: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    turn = tl.load(turn_ptr)
    row = ring_ptr + (turn & (RING - 1)) * (S + 1)
    s = tl.arange(0, BS)
    keys = tl.load(keys_ptr + s, mask=s < S)
    tl.store(row + 1 + s, keys, mask=s < S, cache_modifier=".wt")
    tl.store(row, tl.load(turn_ptr + 1), cache_modifier=".wt")
    tl.store(turn_ptr, turn + 1)


def publish_keys(keys: Tensor, ring: Tensor, turn: Tensor) -> None:
    """The greedy keys [S] into the host's ring [RING, 1 + S] (int64, pinned; RING a power
    of two) at row turn[0] % RING, after turn[1] (decode_start's: the turn whose inputs it
    read, or -2; the host checks it is its own launch), and the turn moved on: a decode
    graph's last kernel, where the host reads its tokens without a copy between replays."""
    S = keys.shape[0]
    if keys.shape != (S,) or ring.dim() != 2 or ring.shape[1] != 1 + S or turn.shape != (2,) \
            or not _power_of_two(ring.shape[0]) \
            or keys.dtype != torch.int64 or ring.dtype != torch.int64:
        raise ValueError(f"publish_keys takes int64 keys [S] and ring [RING, 1 + S], got "
                         f"{tuple(keys.shape)} and {tuple(ring.shape)}")
    _publish_keys_kernel[(1,)](keys, ring, turn, S, ring.shape[0],
                               BS=triton.next_power_of_2(S), **pdl.launch(keys))


def decode_start_reference(ids, positions, keys, embedding, inv_freq):
    """decode_start in torch (keys are not reset here): (h, cos, sin)."""
    left = token_of(keys)
    token = torch.where(ids[:, 0] >= 0, ids[:, 0], torch.where(keys != KEY_NONE, left, 0))
    angles = positions[..., None] * inv_freq
    return (embedding[token.clamp(0, embedding.shape[0] - 1)][:, None],
            angles.cos().to(embedding.dtype), angles.sin().to(embedding.dtype))
