"""Differential tests: ninfer's torch model against transformers' Qwen3-Next / Qwen3.5 on
tiny random weights (float32, CPU, transformers' torch fallback kernels), and the MTP head
(which transformers lacks) against a direct formulation around transformers' own decoder
layer."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

from ninfer.model.attention import ContiguousKV
from ninfer.model.hybrid import HybridState

from .hf_reference import build_pair, checkpoint_to_hf, hf_config, tiny_config

TOL = 1e-4
CONFIGS = {
    "next-dense": ("qwen3_next", False),
    "next-moe": ("qwen3_next", True),
    "3.5-dense": ("qwen3_5", False),
    "3.5-moe": ("qwen3_5", True),
}
HF_LAYERS = {
    ("qwen3_next", False): Qwen3NextDecoderLayer, ("qwen3_next", True): Qwen3NextDecoderLayer,
    ("qwen3_5", False): Qwen3_5DecoderLayer, ("qwen3_5", True): Qwen3_5MoeDecoderLayer,
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
    family, moe = CONFIGS[request.param]
    config = tiny_config(family, moe)
    hf, ours, ckpt = build_pair(config, seed=3)
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = hf.model(input_ids=ids, use_cache=False)
        ref_logits = hf.lm_head(out.last_hidden_state)
    return config, hf, ours, ckpt, ids, ref_logits, out.last_hidden_state


def _positions(start: int, n: int, batch: int = 2) -> torch.Tensor:
    return torch.arange(start, start + n).expand(batch, n)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def test_full_prefill_matches_transformers(pair):
    config, _, ours, _, ids, ref, ref_hidden = pair
    out = ours(ids, _positions(0, 20), HybridState.initial(config, 2, torch.float32))
    assert _max_diff(out.logits, ref) < TOL
    assert _max_diff(out.hidden, ref_hidden) < TOL


@torch.no_grad()
def test_prefill_then_decode_matches_full_sequence(pair):
    config, _, ours, _, ids, ref, _ = pair
    out = ours(ids[:, :12], _positions(0, 12), HybridState.initial(config, 2, torch.float32))
    logits, state = [out.logits], out.state
    for t in range(12, 20):
        step = ours(ids[:, t:t + 1], _positions(t, 1), state)
        logits.append(step.logits)
        state = step.state
    assert _max_diff(torch.cat(logits, dim=1), ref) < TOL


@torch.no_grad()
def test_uneven_chunked_prefill_equals_one_prefill(pair):
    config, _, ours, _, ids, ref, _ = pair
    whole = ours(ids, _positions(0, 20), HybridState.initial(config, 2, torch.float32))
    state, logits, start = HybridState.initial(config, 2, torch.float32), [], 0
    for n in (5, 3, 7, 5):
        out = ours(ids[:, start:start + n], _positions(start, n), state)
        logits.append(out.logits)
        state, start = out.state, start + n
    chunked = torch.cat(logits, dim=1)
    assert _max_diff(chunked, whole.logits) < TOL  # float32 rounding; float64: test_model
    assert _max_diff(chunked, ref) < TOL
    for i, s in whole.state.gdn.items():
        torch.testing.assert_close(state.gdn[i].recurrent, s.recurrent, rtol=0, atol=TOL)
        torch.testing.assert_close(state.gdn[i].conv, s.conv, rtol=0, atol=TOL)


@torch.no_grad()
def test_verify_then_rollback_continues_like_transformers(pair):
    """Verify 5 positions at once with per-position states, roll each row back to a
    different accepted length, decode on: logits equal the full-sequence reference."""
    config, _, ours, _, ids, ref, _ = pair
    pre = ours(ids[:, :10], _positions(0, 10), HybridState.initial(config, 2, torch.float32))
    verify = ours(ids[:, 10:15], _positions(10, 5), pre.state, all_states=True)
    assert _max_diff(verify.logits, ref[:, 10:15]) < TOL
    # row 0 keeps 2 of the 5 verified tokens, row 1 keeps 4: positions now 12 and 14
    state = verify.state_at(torch.tensor([1, 3]))
    positions = torch.tensor([[12], [14]])
    step = ours(torch.stack([ids[0, 12:13], ids[1, 14:15]]), positions, state)
    assert _max_diff(step.logits[0, 0], ref[0, 12]) < TOL
    assert _max_diff(step.logits[1, 0], ref[1, 14]) < TOL


# --- MTP ----------------------------------------------------------------------------------

def _zc_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


@torch.no_grad()
def test_mtp_head_equals_direct_formulation(pair):
    """logits_t = lm_head(norm(layer(fc(cat(norm_e(embed(x_{t+1})), norm_h(h_t)))))) with
    h_t transformers' final-normed hidden state and transformers' decoder layer."""
    config, hf, ours, ckpt, ids, _, ref_hidden = pair
    eps, T = config.rms_norm_eps, ids.shape[1] - 1
    layer_config = hf_config(replace(config, num_hidden_layers=1, layer_types=("full_attention",)))
    layer = HF_LAYERS[(config.family, config.is_moe)](layer_config, 0).eval()
    layer.load_state_dict(checkpoint_to_hf(ckpt, "mtp.layers.0."))

    emb = F.embedding(ids[:, 1:], ckpt["model.embed_tokens.weight"])
    x = torch.cat([_zc_rms(emb, ckpt["mtp.pre_fc_norm_embedding.weight"], eps),
                   _zc_rms(ref_hidden[:, :-1], ckpt["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
    x = x @ ckpt["mtp.fc.weight"].T
    position_ids = _positions(0, T)
    # Qwen3.5's rotary takes (T, H, W) position axes; for text all three are the position
    rope_ids = position_ids if config.family == "qwen3_next" else position_ids.expand(3, -1, -1)
    cos_sin = hf.model.rotary_emb(x, rope_ids)
    causal = torch.full((T, T), float("-inf")).triu(1).expand(2, 1, T, T)
    y = layer(x, position_embeddings=cos_sin, attention_mask=causal, position_ids=position_ids)
    expected = _zc_rms(y, ckpt["mtp.norm.weight"], eps) @ ckpt["lm_head.weight"].T

    got = ours.mtp_forward(ref_hidden[:, :-1], ids[:, 1:], position_ids, ContiguousKV())
    assert _max_diff(got.logits, expected) < TOL


@torch.no_grad()
def test_mtp_step_by_step_equals_whole_sequence(pair):
    config, _, ours, _, ids, _, _ = pair
    ours64 = ours.to(torch.float64)
    try:
        out = ours64(ids, _positions(0, 20), HybridState.initial(config, 2, torch.float64))
        hidden, T = out.hidden, 19
        whole = ours64.mtp_forward(hidden[:, :T], ids[:, 1:], _positions(0, T), ContiguousKV())
        kv, steps = ContiguousKV(initial_capacity=4), []
        for t in range(T):
            steps.append(ours64.mtp_forward(hidden[:, t:t + 1], ids[:, t + 1:t + 2],
                                            _positions(t, 1), kv).logits)
        assert _max_diff(torch.cat(steps, dim=1), whole.logits) < 1e-12

        # drafting writes MTP KV past the frontier; the verified entries overwrite it
        P, kv, h, tok = 12, ContiguousKV(), hidden[:, :11], ids[:, 1:12]
        ours64.mtp_forward(h, tok, _positions(0, 11), kv)  # entries [0, P-1)
        draft = ours64.mtp_forward(hidden[:, 11:12], ids[:, 12:13], _positions(11, 1), kv)
        for t in range(12, 15):  # chain three more drafts from the MTP's own output
            token = draft.logits.argmax(-1)
            draft = ours64.mtp_forward(draft.hidden, token, _positions(t, 1), kv)
        redo = ours64.mtp_forward(hidden[:, P - 1:T], ids[:, P:], _positions(P - 1, T - P + 1), kv)
        assert _max_diff(redo.logits, whole.logits[:, P - 1:]) < 1e-12
    finally:
        ours.to(torch.float32)
