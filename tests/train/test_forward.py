"""The training forward computes what the serving model computes (float64, CPU): the main
model's logits from position 0, and the MTP head's draft steps as the engine chains them."""

import pytest
import torch

from ninfer.model.attention import ContiguousKV
from ninfer.model.config import ModelConfig
from ninfer.model.hybrid import HybridModel, HybridState
from ninfer.train import forward

SHAPE = {
    "model_type": "qwen3_5_text", "vocab_size": 101, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000,
                        "partial_rotary_factor": 0.5},
    "rms_norm_eps": 1e-6, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    "intermediate_size": 96, "tie_word_embeddings": True, "mtp_num_hidden_layers": 1,
}


@pytest.fixture(scope="module")
def net() -> HybridModel:
    torch.manual_seed(1)
    net = HybridModel(ModelConfig.from_dict(SHAPE)).to(torch.float64)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return net


def test_the_delta_rule_in_parallel_chunks_equals_the_reference():
    from kernels.gdn_reference import recurrent_gated_delta_rule
    B, T, H, Dk, Dv = 2, 150, 3, 8, 5  # T not a multiple of the chunk: padded
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, Dk, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(B, T, H, Dv, dtype=torch.float64)
    g = -torch.rand(B, T, H, dtype=torch.float64) * 3
    beta = torch.rand(B, T, H, dtype=torch.float64)
    ref, _ = recurrent_gated_delta_rule(q, k, v, g, beta)
    got = forward.delta_rule(*(t.transpose(1, 2) for t in (q * Dk ** -0.5, k, v, g, beta)),
                             chunk=32)
    assert torch.allclose(got.transpose(1, 2), ref, atol=1e-12, rtol=0)


@torch.no_grad()
def test_hidden_states_and_logits_equal_the_serving_forward(net):
    ids = torch.randint(0, 101, (2, 70))
    state = HybridState.initial(net.config, 2, torch.float64)
    ref = net.forward(ids, torch.arange(70).expand(2, 70), state)
    hidden = forward.hidden(net, ids)
    assert torch.allclose(hidden, ref.hidden, atol=1e-10, rtol=0)
    assert torch.allclose(net.lm_logits(hidden), ref.logits, atol=1e-9, rtol=0)


@torch.no_grad()
def test_every_draft_step_equals_the_engines_chain(net):
    T = 24
    ids = torch.randint(0, 101, (1, T + 1))
    hidden = forward.hidden(net, ids[:, :T])
    steps = forward.mtp_logits(net, hidden, ids, depth=3)
    for p in (3, 10, T - 2):
        for step in range(3):
            # the engine: step-0 entries for 0..p-step from the main model's hidden states,
            # then each chained entry from the last output and the next (right) token
            kv = ContiguousKV()
            start = p - step
            out = net.mtp_forward(hidden[:, :start + 1], ids[:, 1:start + 2],
                                  torch.arange(start + 1)[None], kv)
            y, logits = out.hidden[:, -1:], out.logits[:, -1]
            for i in range(1, step + 1):
                out = net.mtp_forward(y, ids[:, start + i + 1:start + i + 2],
                                      torch.tensor([[start + i]]), kv)
                y, logits = out.hidden, out.logits[:, -1]
            assert torch.allclose(steps[step][:, p], logits, atol=1e-9, rtol=0), (p, step)


def test_the_loss_has_a_gradient_for_every_parameter(net):
    ids = torch.randint(0, 101, (2, 33))
    hidden = forward.hidden(net, ids[:, :32])
    loss = net.lm_logits(hidden).sum() + sum(s.sum() for s in forward.mtp_logits(
        net, hidden, ids, depth=2))
    loss.backward()
    missing = [n for n, p in net.named_parameters() if p.grad is None or not p.grad.any()]
    net.zero_grad()
    assert missing == []
