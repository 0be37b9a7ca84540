"""Torch reference implementations of the gated delta rule and the causal depthwise conv.

The gated delta rule, per value head, with state S: [Dk, Dv] and inputs at token t
(q_t, k_t: [Dk], v_t: [Dv], log-decay g_t <= 0, write strength beta_t in (0, 1)):

    S   <- exp(g_t) * S                          # forget
    u_t  = beta_t * (v_t - S^T k_t)              # delta: what S mispredicts for k_t
    S   <- S + k_t u_t^T                         # write the correction
    o_t  = S^T (scale * q_t)                     # read

Grouped heads: q and k have Hk heads, v/g/beta have Hv = r * Hk heads, and value head h
reads key head h // r (consecutive value heads share a key head, as in the checkpoints).

These functions take q and k as given (the model L2-normalises them first), compute in
float32 or wider (float64 stays float64), return the output in v's dtype and the state in
the compute dtype. They never modify their inputs: the caller owns every state tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any of them is, else float32 (decided in Python: torch.promote_types is a
    dispatched op, and the CPU decode step calls this for every GDN layer)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _heads_first(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, dtype: torch.dtype):
    """[B, T, H, ...] -> [B, H, T, ...] in `dtype`, key heads repeated to the value heads."""
    r = v.shape[2] // k.shape[2]
    if v.shape[2] != r * k.shape[2]:
        raise ValueError(f"value heads {v.shape[2]} are not a multiple of key heads {k.shape[2]}")
    q, k = (x.repeat_interleave(r, dim=2) if r > 1 else x for x in (q, k))
    return [x.transpose(1, 2) if x.dtype == dtype else x.transpose(1, 2).to(dtype)
            for x in (q, k, v, g, beta)]


def _initial(state: Tensor | None, shape: tuple[int, ...], like: Tensor) -> Tensor:
    if state is None:
        return like.new_zeros(shape)
    if tuple(state.shape) != shape:
        raise ValueError(f"initial_state has shape {tuple(state.shape)}, expected {shape}")
    return state.to(like.dtype)



def _prepare(q, k, v, g, beta, initial_state, scale):
    """Heads first in the compute dtype, the initial state, an output buffer, the scale."""
    dtype, out_dtype = _compute_dtype(q, k, v, g, beta), v.dtype
    B, T, _, Dk = k.shape
    Hv, Dv = v.shape[2:]
    scale = Dk ** -0.5 if scale is None else scale
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, dtype)  # q: [B, Hv, T, Dk]
    S = _initial(initial_state, (B, Hv, Dk, Dv), v)  # S: [B, Hv, Dk, Dv]
    return q, k, v, g, beta, S, v.new_empty(B, Hv, T, Dv), scale, out_dtype

def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Tensor | None = None, scale: float | None = None, all_states: bool = False,
) -> tuple[Tensor, Tensor]:
    """The rule token by token: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv],
    initial_state [B, Hv, Dk, Dv] (None: zeros); scale defaults to Dk ** -0.5.

    Returns (o [B, T, Hv, Dv], state): the final state [B, Hv, Dk, Dv], or with
    `all_states` the state after every position, [B, T, Hv, Dk, Dv] (so a rollback to
    position t is `states[:, t]`)."""
    q, k, v, g, beta, S, out, scale, out_dtype = _prepare(q, k, v, g, beta, initial_state, scale)
    T = q.shape[2]
    states = [] if all_states else None
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]  # [B, Hv, Dk]
        predicted = torch.einsum("bhkv,bhk->bhv", S, k_t)
        u = beta[:, :, t, None] * (v[:, :, t] - predicted)  # [B, Hv, Dv]
        S = S + k_t[..., :, None] * u[..., None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, :, t] * scale)
        if states is not None:
            states.append(S)
    o = out.transpose(1, 2).to(out_dtype)
    return o, (torch.stack(states, dim=1) if states is not None else S)


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Tensor | None = None, chunk_size: int = 64, scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The same rule, chunk by chunk (the WY / UT form): same shapes as
    `recurrent_gated_delta_rule`; returns (o [B, T, Hv, Dv], final state [B, Hv, Dk, Dv]).

    Within a chunk starting from state S0, let G_i be the cumulative log-decay up to i and
    D_ij = exp(G_i - G_j) (j <= i). Unrolling the recurrence, the corrections u_i satisfy
    the unit lower-triangular system

        u_i + beta_i sum_{j<i} D_ij (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S0^T k_i)

    solved with one triangular solve per chunk; then o_i = exp(G_i) S0^T q_i
    + sum_{j<=i} D_ij (q_i . k_j) u_j and S_end = exp(G_C) S0 + sum_j D_Cj k_j u_j^T.
    Every exponent is <= 0, so nothing overflows however strong the decay."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    q, k, v, g, beta, S, out, scale, out_dtype = _prepare(q, k, v, g, beta, initial_state, scale)
    T = q.shape[2]
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        C = end - start
        q_c, k_c, v_c = (x[:, :, start:end] for x in (q, k, v))  # [B, Hv, C, D*]
        b_c = beta[:, :, start:end, None]  # [B, Hv, C, 1]
        G = g[:, :, start:end].cumsum(dim=-1)  # [B, Hv, C]
        lower = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
        # D_ij = exp(G_i - G_j) on and below the diagonal; masked before exp (above it the
        # difference is positive and could overflow)
        D = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        strict = D.tril(-1)  # [B, Hv, C, C], without the diagonal
        eye = torch.eye(C, dtype=v.dtype, device=v.device)
        system = eye + b_c * (k_c @ k_c.transpose(-1, -2)) * strict  # unit lower triangular
        decayed_k = k_c * G.exp()[..., None]  # exp(G_i) k_i: [B, Hv, C, Dk]
        rhs = b_c * (v_c - decayed_k @ S)  # [B, Hv, C, Dv]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        qs = q_c * scale
        read_old = (qs * G.exp()[..., None]) @ S  # what S0 answers, decayed to i
        out[:, :, start:end] = read_old + ((qs @ k_c.transpose(-1, -2)) * D) @ u
        to_end = (G[..., -1:] - G).exp()[..., None]  # exp(G_C - G_j): [B, Hv, C, 1]
        S = S * G[..., -1].exp()[..., None, None] + (k_c * to_end).transpose(-1, -2) @ u
    return out.transpose(1, 2).to(out_dtype), S


def causal_conv1d_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None,
    activation: str | None = "silu", all_states: bool = False,
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over new inputs, continuing from a saved tail.

    x: [B, C, T] new inputs; conv_state: [B, C, K-1], the K-1 inputs before them (zeros at
    the start of a sequence); weight: [C, K] (the checkpoint's [C, 1, K] squeezed).
    Returns (y [B, C, T], tail): the new tail [B, C, K-1] (the last K-1 inputs), or with
    `all_states` the tail after every position, [B, T, C, K-1]. Inputs are not modified."""
    B, C, T = x.shape
    K = weight.shape[-1]
    if tuple(conv_state.shape) != (B, C, K - 1):
        raise ValueError(
            f"conv_state has shape {tuple(conv_state.shape)}, expected {(B, C, K - 1)}")
    window = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # [B, C, K-1+T]
    # y[b, c, t] = sum_j weight[c, j] * window[b, c, t + j]; written out rather than
    # F.conv1d(groups=C), which on CPU runs one slow convolution per channel
    y = (window.unfold(-1, K, 1) * weight.to(x.dtype)[:, None, :]).sum(-1)  # [B, C, T]
    if bias is not None:
        y = y + bias.to(x.dtype)[:, None]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    if all_states:
        # the tail after position t is window[..., t+1 : t+K]
        tails = window.unfold(-1, K - 1, 1)[:, :, 1:]  # [B, C, T, K-1]
        return y, tails.permute(0, 2, 1, 3)
    return y, window[..., window.shape[-1] - (K - 1):]
