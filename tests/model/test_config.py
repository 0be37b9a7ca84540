"""ModelConfig parsing and expected checkpoint tensors."""

import copy
import dataclasses

import pytest

from ninfer.model.config import ConfigError, ModelConfig, expected_tensors

# The shape of Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (legacy top-level rope keys).
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
    "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}

# The shape of a multimodal Qwen3.5 config.json: text part under text_config.
QWEN3_5 = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "attention_bias": False, "eos_token_id": 248044, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 1024, "intermediate_size": 3584,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"]
        + ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 16, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1, "num_attention_heads": 8, "num_hidden_layers": 8,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "vocab_size": 248320,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                            "rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25},
    },
    "vision_config": {"depth": 24, "hidden_size": 1024},
}


def test_qwen3_next_parses_with_derived_layer_types():
    c = ModelConfig.from_dict(QWEN3_NEXT)
    assert c.family == "qwen3_next"
    assert c.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert c.attention_layers == tuple(range(3, 48, 4))
    assert len(c.linear_layers) == 36
    assert (c.rope_theta, c.partial_rotary_factor, c.rotary_dim) == (1e7, 0.25, 64)
    assert c.num_experts == 512 and c.is_moe_layer(0) and c.is_moe
    assert c.conv_dim == 2 * 16 * 128 + 32 * 128
    assert c.eos_token_ids == (151645,) and c.mtp_num_hidden_layers == 1


def test_qwen3_5_wrapper_reads_text_config_and_top_level_tie():
    c = ModelConfig.from_dict(QWEN3_5)
    assert c.family == "qwen3_5" and not c.is_moe
    assert c.layer_types[3] == "full_attention" and c.layer_types[4] == "linear_attention"
    assert c.rope_theta == 1e7 and c.tie_word_embeddings
    assert c.intermediate_size == 3584 and c.eos_token_ids == (248044,)


def test_qwen3_5_text_model_type_directly():
    c = ModelConfig.from_dict(QWEN3_5["text_config"])
    assert c.family == "qwen3_5" and not c.tie_word_embeddings


def test_mlp_only_layers_and_sparse_step():
    d = dict(QWEN3_NEXT, num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3])
    c = ModelConfig.from_dict(d)
    assert [c.is_moe_layer(i) for i in range(8)] == [False, True, False, False,
                                                     False, True, False, True]


@pytest.mark.parametrize("d", [QWEN3_NEXT, QWEN3_5, dict(QWEN3_NEXT, num_experts=0)])
def test_to_dict_round_trips(d):
    c = ModelConfig.from_dict(d)
    assert ModelConfig.from_dict(c.to_dict()) == c


def _broken(base, path, value):
    d = copy.deepcopy(base)
    target = d
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return d


_DELETE = object()


@pytest.mark.parametrize("base,path,value,field", [
    (QWEN3_NEXT, ["model_type"], "llama", "model_type"),
    (QWEN3_NEXT, ["hidden_size"], _DELETE, "hidden_size"),
    (QWEN3_NEXT, ["hidden_size"], "2048", "hidden_size"),
    (QWEN3_NEXT, ["num_hidden_layers"], True, "num_hidden_layers"),
    (QWEN3_NEXT, ["num_experts"], _DELETE, "num_experts"),
    (QWEN3_NEXT, ["num_experts_per_tok"], 513, "num_experts_per_tok"),
    (QWEN3_NEXT, ["rms_norm_eps"], "tiny", "rms_norm_eps"),
    (QWEN3_NEXT, ["hidden_act"], "gelu", "hidden_act"),
    (QWEN3_NEXT, ["rope_theta"], _DELETE, "rope_theta"),
    (QWEN3_NEXT, ["rope_scaling"], {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type"),
    (QWEN3_NEXT, ["layer_types"], ["full_attention"] * 3, "layer_types"),
    (QWEN3_NEXT, ["layer_types"], ["mamba"] * 48, "layer_types"),
    (QWEN3_NEXT, ["linear_num_value_heads"], 24, "linear_num_value_heads"),
    (QWEN3_NEXT, ["mlp_only_layers"], [1, "2"], "mlp_only_layers"),
    (QWEN3_5, ["text_config"], _DELETE, "text_config"),
    (QWEN3_5, ["text_config", "vocab_size"], _DELETE, "text_config.vocab_size"),
    (QWEN3_5, ["text_config", "rope_parameters", "rope_theta"], _DELETE, "text_config.rope_theta"),
    (QWEN3_5, ["text_config", "intermediate_size"], _DELETE, "text_config.intermediate_size"),
])
def test_errors_name_file_and_field(base, path, value, field):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(_broken(base, path, value), source="ckpt/config.json")
    assert info.value.field == field
    assert str(info.value).startswith(f"ckpt/config.json: field '{field}'")


def test_expected_tensors_qwen3_next_moe_names_and_shapes():
    c = ModelConfig.from_dict(dict(QWEN3_NEXT, num_hidden_layers=4, num_experts=4,
                                   num_experts_per_tok=2))
    t = expected_tensors(c)
    g, a = "model.layers.0.linear_attn", "model.layers.3.self_attn"
    assert t[f"{g}.in_proj_qkvz.weight"] == (2 * 2048 + 2 * 4096, 2048)
    assert t[f"{g}.in_proj_ba.weight"] == (64, 2048)
    assert t[f"{g}.conv1d.weight"] == (2 * 2048 + 4096, 1, 4)
    assert t[f"{g}.A_log"] == t[f"{g}.dt_bias"] == (32,)
    assert t[f"{g}.norm.weight"] == (128,) and t[f"{g}.out_proj.weight"] == (2048, 4096)
    assert t[f"{a}.q_proj.weight"] == (2 * 16 * 256, 2048)
    assert t[f"{a}.k_proj.weight"] == (512, 2048) and t[f"{a}.o_proj.weight"] == (2048, 4096)
    assert t[f"{a}.q_norm.weight"] == (256,)
    assert t["model.layers.1.mlp.gate.weight"] == (4, 2048)
    assert t["model.layers.1.mlp.experts.3.down_proj.weight"] == (2048, 512)
    assert t["model.layers.1.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert "model.layers.1.mlp.gate_proj.weight" not in t
    assert t["mtp.fc.weight"] == (2048, 4096)
    assert t["mtp.layers.0.self_attn.q_proj.weight"] == (8192, 2048)
    assert t["mtp.layers.0.mlp.experts.0.gate_proj.weight"] == (512, 2048)
    assert "mtp.layers.0.linear_attn.A_log" not in t
    assert t["lm_head.weight"] == (151936, 2048)
    # 4 layers x (2 norms + 4 experts x 3 + shared 3 + 2 gates) + mixers + top-level + MTP
    assert len([k for k in t if k.startswith("model.layers.1.")]) == 2 + 12 + 3 + 2 + 7


def test_expected_tensors_qwen3_5_dense_tied():
    c = ModelConfig.from_dict(QWEN3_5)
    t = expected_tensors(c)
    g = "model.layers.0.linear_attn"
    assert t[f"{g}.in_proj_qkv.weight"] == (3 * 2048, 1024)
    assert t[f"{g}.in_proj_z.weight"] == (2048, 1024)
    assert t[f"{g}.in_proj_b.weight"] == t[f"{g}.in_proj_a.weight"] == (16, 1024)
    assert f"{g}.in_proj_qkvz.weight" not in t
    assert t["model.layers.0.mlp.up_proj.weight"] == (3584, 1024)
    assert t["mtp.layers.0.mlp.down_proj.weight"] == (1024, 3584)
    assert "lm_head.weight" not in t
    assert not any(k.startswith("mtp.") for k in expected_tensors(c, mtp=False))


def test_qwen3_5_moe_wrapper_is_moe_on_every_layer():
    text = dict(QWEN3_5["text_config"], model_type="qwen3_5_moe_text", num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=64,
                shared_expert_intermediate_size=128)
    del text["intermediate_size"]  # not needed when every layer is MoE
    c = ModelConfig.from_dict(dict(QWEN3_5, model_type="qwen3_5_moe", text_config=text))
    assert c.family == "qwen3_5" and all(c.is_moe_layer(i) for i in range(8))
    assert c.to_dict()["model_type"] == "qwen3_5_moe_text"
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_configs_built_in_code_are_checked():
    c = ModelConfig.from_dict(QWEN3_5)
    with pytest.raises(ConfigError, match="'layer_types'"):
        dataclasses.replace(c, num_hidden_layers=7)
    with pytest.raises(ConfigError, match="'family'"):
        dataclasses.replace(c, family="llama")
    with pytest.raises(ConfigError, match="'decoder_sparse_step'"):
        dataclasses.replace(c, num_experts=4, decoder_sparse_step=2)
