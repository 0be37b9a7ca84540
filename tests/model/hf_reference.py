"""Test-only bridge to transformers' Qwen3-Next / Qwen3.5 models: tiny configs, seeded
non-trivial random weights, and conversion between transformers' in-memory names (fused
3-D experts) and the checkpoint names ninfer loads. ninfer itself never imports this."""

from __future__ import annotations

import zlib

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

from ninfer.model.config import ModelConfig, expected_tensors
from ninfer.model.hybrid import HybridModel, load_weights

HF_CLASSES = {
    ("qwen3_next", False): (Qwen3NextConfig, Qwen3NextForCausalLM),
    ("qwen3_next", True): (Qwen3NextConfig, Qwen3NextForCausalLM),
    ("qwen3_5", False): (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    ("qwen3_5", True): (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
}


def tiny_config(family: str, moe: bool, **overrides) -> ModelConfig:
    """hidden 64, 4 layers (GDN, attention, GDN, attention), vocab 256, 2 query heads over 1
    KV head, GDN 2 key / 4 value heads; with `moe`, 4 experts top-2 plus a shared expert."""
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48) if moe else {}
    fields = dict(
        family=family, vocab_size=256, hidden_size=64, num_hidden_layers=4,
        layer_types=("linear_attention", "full_attention") * 2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, rope_theta=10000.0,
        rms_norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        intermediate_size=96, mtp_num_hidden_layers=1, **experts)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Seeded by (seed, name). Away from every identity: norms are not 0/1, decays spread
    over slow and fast heads, matrices N(0, 1/fan_in) so logits are O(1)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.05, 3.0, generator=g).log()
    if name.endswith("dt_bias"):
        return torch.empty(shape).uniform_(-2.0, 1.0, generator=g)
    noise = torch.randn(shape, generator=g)
    if name.endswith("linear_attn.norm.weight"):  # plain weight: identity is 1
        return 1.0 + 0.3 * noise
    if name.endswith("norm.weight") or "norm_" in name:  # zero-centred: identity is 0
        return 0.3 * noise
    if name.endswith("embed_tokens.weight"):
        return noise
    return noise * shape[-1] ** -0.5  # [out, in], [E, out, in], conv [C, 1, K]


def hf_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 fuses experts in memory: `experts.gate_up_proj` [E, 2I, H] (gate rows
    first) and `experts.down_proj` [E, H, I]; checkpoint files hold them one by one."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def checkpoint_to_hf(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix`, prefix removed, experts fused the transformers way."""
    out, experts = {}, {}
    for name, t in tensors.items():
        if not name.startswith(prefix):
            continue
        name = name[len(prefix):]
        if ".experts." in name:
            head, rest = name.split(".experts.")
            e, proj = rest.split(".")[:2]
            experts.setdefault(head, {}).setdefault(proj, {})[int(e)] = t
        else:
            out[name] = t
    for head, projs in experts.items():
        n = len(projs["gate_proj"])
        out[f"{head}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)])
        out[f"{head}.experts.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


def hf_config(config: ModelConfig):
    cls, _ = HF_CLASSES[(config.family, config.is_moe)]
    hc = cls(**config.to_dict())
    hc._attn_implementation = "eager"
    return hc


def build_pair(config: ModelConfig, seed: int = 0):
    """(transformers model, ninfer model, checkpoint tensors), float32, same weights. The
    MTP tensors (transformers has no MTP head) are random checkpoint tensors of their own."""
    _, model_cls = HF_CLASSES[(config.family, config.is_moe)]
    torch.manual_seed(seed)
    hf = model_cls(hf_config(config)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(random_tensor(name, tuple(p.shape), seed))
    ckpt = hf_to_checkpoint({k: v.clone() for k, v in hf.state_dict().items()})
    for name, shape in expected_tensors(config).items():
        if name.startswith("mtp."):
            ckpt[name] = random_tensor(name, shape, seed)
    ours = HybridModel(config).eval()
    load_weights(ours, ckpt)
    return hf, ours, ckpt
