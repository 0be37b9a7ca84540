"""The forward pass training differentiates: the same model as `HybridModel.forward` and its
MTP head, over whole windows from position 0, in plain torch (no Triton kernel, none of which
has a backward), reading the `HybridModel`'s own parameters, so the trained state dict is the
checkpoint.

What it computes, stated so a test can hold it to the serving model (float64, on the CPU):
- `hidden(net, ids)` equals `HybridModel.forward(ids, positions 0..T-1, initial state)
  .hidden`, and `net.lm_logits` of it the logits;
- `mtp_logits(net, hidden, ids, depth)[d][:, p]` equals the logits of the MTP head's draft
  step d at position p as the engine chains them (`Runner.draft`): step 0 reads the main
  model's hidden state at p and token p+1; step d > 0 reads step d-1's output at p-1 and
  token p+1, and attends over step-0 entries up to p-d and step-i entries at p-d+i (what
  the MTP KV holds while drafting). Each predicts token p+2; entries p < d have no meaning.

Only the Qwen3.5 layout (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) with dense
MLPs is supported: the trained default model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..model.gdn import l2_normalize
from ..model.hybrid import DecoderLayer, HybridModel
from ..model.layers import compute_dtype

CHUNK = 64  # positions per chunk of the gated delta rule


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The zero-centred RMSNorm (`layers.RMSNorm`): x / rms(x) * (1 + weight), computed wide,
    returned in x's dtype."""
    w = compute_dtype(x)
    xw = x.to(w)
    return (xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + eps)
            * (1.0 + weight.to(w))).to(x.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`layers.apply_rope` in torch: x [B, T, H, D], cos / sin [B, T, rotary]."""
    rotary = cos.shape[-1]
    rot, rest = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    return torch.cat([rot * cos + turned * sin, rest], dim=-1)


def _mlp(layer: DecoderLayer, x: Tensor) -> Tensor:
    m = layer.mlp
    return m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


# --- attention -------------------------------------------------------------------------------

class _QKV:
    """One gated attention layer's q (with its gate), k, v for a window: [B, H*, T, D]."""

    def __init__(self, layer: DecoderLayer, x: Tensor, cos_sin: tuple[Tensor, Tensor]):
        attn = layer.self_attn
        B, T, _ = x.shape
        H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        eps = layer.input_layernorm.eps
        q_and_gate = attn.q_proj(x).view(B, T, H, 2 * D)
        q, self.gate = q_and_gate[..., :D], q_and_gate[..., D:]
        k = attn.k_proj(x).view(B, T, Hkv, D)
        self.v = attn.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        cos, sin = cos_sin
        self.q = _rope(rms_norm(q, attn.q_norm.weight, eps), cos, sin).transpose(1, 2)
        self.k = _rope(rms_norm(k, attn.k_norm.weight, eps), cos, sin).transpose(1, 2)
        self.groups, self.scale = H // Hkv, D ** -0.5

    def attend(self, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """SDPA over keys / values [B, Hkv, L, D] (causal when `mask` is None), gated:
        [B, T, H*D]."""
        if self.groups > 1:
            keys, values = (t.repeat_interleave(self.groups, dim=1) for t in (keys, values))
        q = self.q
        if q.dtype != keys.dtype:  # autocast made q, k, v in one dtype; wide ones stay wide
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             is_causal=mask is None, scale=self.scale)
        out = out.transpose(1, 2)  # [B, T, H, D]
        out = out * torch.sigmoid(self.gate.to(out.dtype))
        return out.flatten(2)


def _attention(layer: DecoderLayer, x: Tensor, cos_sin: tuple[Tensor, Tensor]) -> Tensor:
    qkv = _QKV(layer, x, cos_sin)
    return layer.self_attn.o_proj(qkv.attend(qkv.k, qkv.v, None))


# --- gated delta rule ------------------------------------------------------------------------

def delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
               chunk: int = CHUNK) -> Tensor:
    """The gated delta rule from a zero state (`kernels.gdn_reference`), chunks in parallel:
    q, k [B, H, T, Dk] (normalised, q scaled), v [B, H, T, Dv], g, beta [B, H, T], all in
    one wide dtype -> o [B, H, T, Dv].

    Per chunk n from state S_n, with U = A^-1 (beta v), W = A^-1 (beta exp(G) k) for the
    chunk's unit lower-triangular A (all chunks at once): u_n = U_n - W_n S_n, o_n =
    (q exp(G)) S_n + ((q k^T) * D) u_n, S_n+1 = exp(G_C) S_n + (k exp(G_C - G))^T u_n. Only
    the state runs chunk after chunk."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    pad = -T % chunk
    if pad:  # zero keys, values, gates: the padding changes nothing before it
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    N = (T + pad) // chunk
    q, k, v = (t.reshape(B, H, N, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(B, H, N, chunk), beta.reshape(B, H, N, chunk)
    G = g.cumsum(-1)  # [B, H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # D_ij = exp(G_i - G_j), j <= i (masked before exp: above the diagonal it could overflow)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    b = beta[..., None]
    A = torch.eye(chunk, dtype=q.dtype, device=q.device) + \
        (b * (k @ k.transpose(-1, -2)) * D).tril(-1)
    rhs = torch.cat([b * v, b * G.exp()[..., None] * k], dim=-1)  # [B, H, N, C, Dv + Dk]
    UW = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :Dv], UW[..., Dv:]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]  # k_j exp(G_C - G_j)
    decay_end = G[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    S = q.new_zeros(B, H, Dk, Dv)
    states, corrections = [], []
    for n in range(N):
        u = U[:, :, n] - W[:, :, n] @ S
        states.append(S)
        corrections.append(u)
        S = decay_end[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ u
    S_all, u_all = torch.stack(states, dim=2), torch.stack(corrections, dim=2)
    o = (q * G.exp()[..., None]) @ S_all + ((q @ k.transpose(-1, -2)) * D) @ u_all
    return o.reshape(B, H, N * chunk, Dv)[:, :, :T]


def _gdn(layer: DecoderLayer, x: Tensor) -> Tensor:
    """A GDN layer's mixer over a window from a zero state: x [B, T, hidden] (normed)."""
    m = layer.linear_attn
    if m.family != "qwen3_5":
        raise ValueError("the training forward supports the Qwen3.5 layout only")
    B, T, _ = x.shape
    Hk, Hv, Dk, Dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    qkv = m.in_proj_qkv(x)  # [B, T, conv_dim]
    z = m.in_proj_z(x).view(B, T, Hv, Dv)
    b, a = m.in_proj_b(x), m.in_proj_a(x)  # [B, T, Hv]
    conv = F.silu(_causal_conv(qkv, m.conv1d.weight.squeeze(1)))  # [B, T, conv_dim]
    wide = compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):  # the rule, its gates and norm, wide
        q, k, v = conv.to(wide).split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        q, k = (l2_normalize(t.reshape(B, T, Hk, Dk)) for t in (q, k))
        beta = torch.sigmoid(b.to(wide))
        g = -m.A_log.to(wide).exp() * F.softplus(a.to(wide) + m.dt_bias.to(wide))
        r = Hv // Hk  # value head h reads key head h // r
        q, k = (t.repeat_interleave(r, dim=2) if r > 1 else t for t in (q, k))
        o = delta_rule((q * Dk ** -0.5).transpose(1, 2), k.transpose(1, 2),
                       v.reshape(B, T, Hv, Dv).transpose(1, 2), g.transpose(1, 2),
                       beta.transpose(1, 2)).transpose(1, 2)  # [B, T, Hv, Dv]
        normed = _gated_norm(m.norm.weight, m.norm.eps, o, z.to(wide))
    return m.out_proj(normed.reshape(B, T, Hv * Dv))


def _causal_conv(x: Tensor, weight: Tensor) -> Tensor:
    """The depthwise causal conv from zero history: x [B, T, C], weight [C, K] -> [B, T, C],
    y_t = sum_j weight[:, j] x_{t-K+1+j}, as K shifted products (a grouped conv's backward
    is slow on the CPU, and these are cheap anywhere)."""
    K, T = weight.shape[-1], x.shape[1]
    padded = F.pad(x, (0, 0, K - 1, 0))
    w = weight.to(x.dtype)
    return sum(padded[:, j:j + T] * w[:, j] for j in range(K))


def _gated_norm(weight: Tensor, eps: float, x: Tensor, z: Tensor) -> Tensor:
    """`layers.GatedRMSNorm`: weight * x / rms(x) * silu(z), over the last axis."""
    return weight.to(x.dtype) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) \
        * F.silu(z)


# --- the model -------------------------------------------------------------------------------

def _layer(layer: DecoderLayer, h: Tensor, cos_sin: tuple[Tensor, Tensor]) -> Tensor:
    x = rms_norm(h, layer.input_layernorm.weight, layer.input_layernorm.eps)
    mixed = _attention(layer, x, cos_sin) if layer.layer_type == "full_attention" \
        else _gdn(layer, x)
    h = h + mixed
    post = layer.post_attention_layernorm
    return h + _mlp(layer, rms_norm(h, post.weight, post.eps))


def _cos_sin(net: HybridModel, B: int, T: int, like: Tensor) -> tuple[Tensor, Tensor]:
    positions = torch.arange(T, device=like.device).expand(B, T)
    return net.rope(positions, compute_dtype(like))


def hidden(net: HybridModel, ids: Tensor) -> Tensor:
    """The main model's hidden states after its final norm: ids [B, T] from position 0 ->
    [B, T, hidden] (what `net.lm_logits` and the MTP head read)."""
    if net.config.is_moe:
        raise ValueError("the training forward supports dense MLPs only")
    h = net.model.embed_tokens(ids)
    cos_sin = _cos_sin(net, *ids.shape, h)
    for layer in net.model.layers:
        h = _layer(layer, h, cos_sin)
    norm = net.model.norm
    return rms_norm(h, norm.weight, norm.eps)


def _draft_mask(T: int, step: int, device: torch.device) -> Tensor:
    """Which keys step `step`'s entry at p attends: [T, (step+1) T], keys grouped by step:
    step 0's at positions <= p - step, step i's (1 <= i <= step) at p - step + i."""
    p = torch.arange(T, device=device)[:, None]
    key = torch.arange(T, device=device)[None, :]
    parts = [key <= p - step] + [key == p - step + i for i in range(1, step + 1)]
    return torch.cat(parts, dim=1)


def mtp_logits(net: HybridModel, main_hidden: Tensor, ids: Tensor, depth: int) -> list[Tensor]:
    """The MTP head's logits for draft steps 0..depth-1 at every position (see the module's
    docstring): main_hidden [B, T, hidden] from `hidden(net, ids[:, :T])`, ids [B, T + 1]
    (token p+1 is ids[:, p+1]) -> `depth` tensors [B, T, V]; step d's at p predicts
    ids[:, p + 2]."""
    mtp = net.mtp
    layer = mtp.layers[0]
    B, T, _ = main_hidden.shape
    if len(mtp.layers) != 1:
        raise ValueError("the training forward supports one MTP layer")
    emb = net.model.embed_tokens(ids[:, 1:T + 1])  # token p+1 for entry p
    e = rms_norm(emb, mtp.pre_fc_norm_embedding.weight, mtp.pre_fc_norm_embedding.eps)
    cos_sin = _cos_sin(net, B, T, main_hidden)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    out, h_in = [], main_hidden
    for step in range(depth):
        hn = rms_norm(h_in, mtp.pre_fc_norm_hidden.weight, mtp.pre_fc_norm_hidden.eps)
        x = mtp.fc(torch.cat([e, hn.to(e.dtype)], dim=-1))
        a = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        qkv = _QKV(layer, a, cos_sin)
        keys.append(qkv.k)
        values.append(qkv.v)
        mask = None if step == 0 else _draft_mask(T, step, x.device)
        attended = qkv.attend(torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
        x = x + layer.self_attn.o_proj(attended)
        post = layer.post_attention_layernorm
        x = x + _mlp(layer, rms_norm(x, post.weight, post.eps))
        y = rms_norm(x, mtp.norm.weight, mtp.norm.eps)
        out.append(net.lm_logits(y))
        # the next step's entry p reads this step's output at p - 1
        h_in = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)
    return out
