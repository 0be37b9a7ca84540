"""Model configuration: a Hugging Face config.json of the Qwen3-Next / Qwen3.5 family, parsed
into one frozen dataclass, and the tensor names and shapes a checkpoint of it holds.

Accepted `model_type`s: `qwen3_next`; `qwen3_5_text` and `qwen3_5_moe_text` (text-only);
`qwen3_5` and `qwen3_5_moe` (multimodal wrappers: the text part is under `text_config`, the
vision tower is ignored). Anything the server cannot run the same way as the reference
(another activation, attention bias, a RoPE scaling type) is refused with a `ConfigError`
that names the file and the field, rather than silently run differently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FAMILIES = ("qwen3_next", "qwen3_5")
LAYER_TYPES = ("linear_attention", "full_attention")
# model_type -> (family, whether the family member is MoE by construction)
_MODEL_TYPES = {
    "qwen3_next": ("qwen3_next", None),  # dense or MoE: decided by num_experts
    "qwen3_5_text": ("qwen3_5", False),
    "qwen3_5_moe_text": ("qwen3_5", True),
}
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


class ConfigError(ValueError):
    """A config.json this server cannot run; the message names the file and the field."""

    def __init__(self, source: str, field_name: str, problem: str) -> None:
        super().__init__(f"{source}: field '{field_name}': {problem}")
        self.source, self.field = source, field_name


class _Reader:
    """Typed access to one dict, raising ConfigError with the field's dotted path."""

    def __init__(self, d: dict, source: str, prefix: str = "") -> None:
        self.d, self.source, self.prefix = d, source, prefix

    def _fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.source, self.prefix + key, problem)

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def get(self, key: str, kind: type, default: Any = ...) -> Any:
        if not self.has(key):
            if default is ...:
                raise self._fail(key, "missing required field")
            return default
        value = self.d[key]
        # bool is an int subclass: a `true` where a count belongs is a mistake, not 1
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self._fail(key, f"expected an integer, got {value!r}")
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self._fail(key, f"expected a number, got {value!r}")
            return float(value)
        if kind is bool and not isinstance(value, bool):
            raise self._fail(key, f"expected true/false, got {value!r}")
        if kind is str and not isinstance(value, str):
            raise self._fail(key, f"expected a string, got {value!r}")
        if kind is list and not isinstance(value, list):
            raise self._fail(key, f"expected a list, got {value!r}")
        if kind is dict and not isinstance(value, dict):
            raise self._fail(key, f"expected an object, got {value!r}")
        return value

    def positive(self, key: str, default: Any = ...) -> int:
        value = self.get(key, int, default)
        if value <= 0:
            raise self._fail(key, f"must be positive, got {value}")
        return value

    def int_list(self, key: str, default: Any = ...) -> tuple[int, ...]:
        value = self.get(key, list, default)
        if any(isinstance(x, bool) or not isinstance(x, int) for x in value):
            raise self._fail(key, f"expected a list of integers, got {value!r}")
        return tuple(value)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one hybrid checkpoint; derived sizes are properties."""

    family: str  # "qwen3_next" | "qwen3_5"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int  # 0 when every layer is MoE and the file gives none
    num_experts: int = 0  # 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 1  # 0: no MTP head
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        """Cross-field consistency, also for configs built in code rather than parsed."""
        def fail(name: str, problem: str) -> ConfigError:
            return ConfigError("ModelConfig", name, problem)

        if self.family not in FAMILIES:
            raise fail("family", f"unknown family {self.family!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise fail("layer_types", f"has {len(self.layer_types)} entries for "
                                      f"{self.num_hidden_layers} layers")
        if any(t not in LAYER_TYPES for t in self.layer_types):
            raise fail("layer_types", f"unknown layer type in {self.layer_types!r}")
        if self.family == "qwen3_5" and (self.decoder_sparse_step != 1 or self.mlp_only_layers
                                         or not self.norm_topk_prob):
            # Qwen3.5 has no such knobs, so to_dict() could not write them
            raise fail("decoder_sparse_step", "qwen3_5 MoE is every layer, top-k renormalised")

    # --- derived sizes --------------------------------------------------------------------

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each attention head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse MoE block (else a dense MLP). The MTP
        layer uses this rule at index 0, as vLLM does for `mtp.layers.0`."""
        return _is_moe_layer(layer, self.num_experts, self.mlp_only_layers,
                             self.decoder_sparse_step)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    # --- parsing --------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> ModelConfig:
        """Parse a config.json dict; raise ConfigError naming `source` and the field."""
        if not isinstance(d, dict):
            raise ConfigError(source, "(top level)", "expected a JSON object")
        top = _Reader(d, source)
        model_type = top.get("model_type", str)
        text, prefix = d, ""
        if model_type in _WRAPPERS:
            text, prefix = top.get("text_config", dict), "text_config."
            inner = text.get("model_type", _WRAPPERS[model_type])
            if inner != _WRAPPERS[model_type]:
                raise ConfigError(source, "text_config.model_type",
                                  f"expected {_WRAPPERS[model_type]!r}, got {inner!r}")
            model_type = _WRAPPERS[model_type]
        if model_type not in _MODEL_TYPES:
            raise ConfigError(source, "model_type", f"unsupported architecture {model_type!r} "
                              f"(supported: qwen3_next, qwen3_5, qwen3_5_text, qwen3_5_moe)")
        family, moe_by_type = _MODEL_TYPES[model_type]
        r = _Reader(text, source, prefix)
        return _parse(r, top, family, moe_by_type)

    def to_dict(self) -> dict:
        """An HF-style config.json (text-only model_type) that `from_dict` reads back equal,
        and that transformers' Qwen3NextConfig / Qwen3_5TextConfig accept."""
        d = asdict(self)
        family = d.pop("family")
        d["layer_types"] = list(self.layer_types)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        eos = d.pop("eos_token_ids")
        d["eos_token_id"] = eos[0] if len(eos) == 1 else (list(eos) or None)
        d["hidden_act"] = "silu"
        d["attention_bias"] = False
        rope = {"rope_type": "default", "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor}
        if family == "qwen3_next":
            d["model_type"] = "qwen3_next"
            d["architectures"] = ["Qwen3NextForCausalLM"]
            d["rope_parameters"] = rope
        else:
            moe = self.num_experts > 0
            d["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
            d["architectures"] = ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"]
            d["rope_parameters"] = rope
            del d["rope_theta"], d["partial_rotary_factor"]
            # Qwen3.5 has no such knobs: every layer is MoE (or none), top-k is renormalised
            for k in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
                del d[k]
            if not moe:
                for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "shared_expert_intermediate_size"):
                    del d[k]
        return d


def _is_moe_layer(layer: int, num_experts: int, mlp_only_layers: tuple[int, ...],
                  decoder_sparse_step: int) -> bool:
    return (num_experts > 0 and layer not in mlp_only_layers
            and (layer + 1) % decoder_sparse_step == 0)


def _parse(r: _Reader, top: _Reader, family: str, moe_by_type: bool | None) -> ModelConfig:
    act = r.get("hidden_act", str, "silu")
    if act != "silu":
        raise r._fail("hidden_act", f"only 'silu' is supported, got {act!r}")
    if r.get("attention_bias", bool, False):
        raise r._fail("attention_bias", "attention projections with bias are not supported")

    n_layers = r.positive("num_hidden_layers")
    if r.has("layer_types"):
        layer_types = tuple(r.get("layer_types", list))
        if len(layer_types) != n_layers:
            raise r._fail("layer_types", f"has {len(layer_types)} entries for {n_layers} layers")
        bad = [t for t in layer_types if t not in LAYER_TYPES]
        if bad:
            raise r._fail("layer_types", f"unknown layer type {bad[0]!r}")
    else:
        # the HF rule: every interval-th layer (1-based) is full attention
        interval = r.positive("full_attention_interval", 4)
        layer_types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                            for i in range(n_layers))

    rope_theta, partial = _parse_rope(r)

    heads, kv_heads = r.positive("num_attention_heads"), r.positive("num_key_value_heads")
    if heads % kv_heads:
        raise r._fail("num_key_value_heads", f"{kv_heads} does not divide {heads} heads")
    head_dim = r.positive("head_dim")
    rotary = int(head_dim * partial)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise r._fail("partial_rotary_factor",
                      f"{partial} x head_dim {head_dim} is not an even rotary width")
    lk, lv = r.positive("linear_num_key_heads"), r.positive("linear_num_value_heads")
    if lv % lk:
        raise r._fail("linear_num_value_heads", f"{lv} is not a multiple of {lk} key heads")

    # MoE: qwen3_next needs num_experts stated (HF's silent default is 512 experts)
    if moe_by_type is None:
        num_experts = r.get("num_experts", int)
    elif moe_by_type:
        num_experts = r.positive("num_experts")
    else:
        num_experts = 0
    if num_experts < 0:
        raise r._fail("num_experts", f"must be >= 0, got {num_experts}")
    moe: dict[str, Any] = {}
    if num_experts > 0:
        top_k = r.positive("num_experts_per_tok")
        if top_k > num_experts:
            raise r._fail("num_experts_per_tok", f"{top_k} > num_experts {num_experts}")
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=r.positive("moe_intermediate_size"),
            shared_expert_intermediate_size=r.positive("shared_expert_intermediate_size"),
        )
        if family == "qwen3_next":
            moe.update(
                norm_topk_prob=r.get("norm_topk_prob", bool, True),
                decoder_sparse_step=r.positive("decoder_sparse_step", 1),
                mlp_only_layers=r.int_list("mlp_only_layers", []),
            )
    needs_dense = not all(
        _is_moe_layer(i, num_experts, moe.get("mlp_only_layers", ()),
                      moe.get("decoder_sparse_step", 1))
        for i in range(n_layers))
    intermediate = r.positive("intermediate_size") if needs_dense else r.get(
        "intermediate_size", int, 0)

    # Qwen3.5 wrappers may keep eos_token_id and tie_word_embeddings at the top level
    eos_src = r if r.has("eos_token_id") else top
    eos = eos_src.d.get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        eos_ids: tuple[int, ...] = (eos,)
    else:
        eos_ids = eos_src.int_list("eos_token_id", [])
    mtp_layers = r.get("mtp_num_hidden_layers", int, 1)
    if mtp_layers < 0:
        raise r._fail("mtp_num_hidden_layers", f"must be >= 0, got {mtp_layers}")
    tie = (r if r.has("tie_word_embeddings") else top).get("tie_word_embeddings", bool, False)

    return ModelConfig(
        family=family,
        vocab_size=r.positive("vocab_size"),
        hidden_size=r.positive("hidden_size"),
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        partial_rotary_factor=partial,
        rope_theta=rope_theta,
        rms_norm_eps=r.get("rms_norm_eps", float, 1e-6),
        linear_num_key_heads=lk,
        linear_num_value_heads=lv,
        linear_key_head_dim=r.positive("linear_key_head_dim"),
        linear_value_head_dim=r.positive("linear_value_head_dim"),
        linear_conv_kernel_dim=r.positive("linear_conv_kernel_dim", 4),
        intermediate_size=intermediate,
        tie_word_embeddings=tie,
        mtp_num_hidden_layers=mtp_layers,
        max_position_embeddings=r.positive("max_position_embeddings", 32768),
        bos_token_id=r.get("bos_token_id", int, None),
        eos_token_ids=eos_ids,
        **moe,
    )


def _parse_rope(r: _Reader) -> tuple[float, float]:
    """rope_theta and partial_rotary_factor: top level (Qwen3-Next) or `rope_parameters`
    (Qwen3.5, transformers 5); `rope_scaling` is the older spelling of the latter."""
    key = "rope_parameters" if r.has("rope_parameters") else "rope_scaling"
    params = r.get(key, dict, {})
    sub = _Reader(params, r.source, f"{r.prefix}{key}.")
    rope_type = sub.get("rope_type", str, None) or sub.get("type", str, "default")
    if rope_type != "default":
        # mrope sections are harmless for text (all three position axes are equal)
        raise sub._fail("rope_type", f"only 'default' RoPE is supported, got {rope_type!r}")
    theta = sub.get("rope_theta", float) if sub.has("rope_theta") else r.get("rope_theta", float)
    if sub.has("partial_rotary_factor"):
        partial = sub.get("partial_rotary_factor", float)
    else:
        partial = r.get("partial_rotary_factor", float, 0.25)
    return theta, partial


def _mlp_tensors(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def _layer_tensors(c: ModelConfig, prefix: str, layer_type: str, moe: bool) -> dict:
    h, t = c.hidden_size, {}
    t[f"{prefix}.input_layernorm.weight"] = (h,)
    t[f"{prefix}.post_attention_layernorm.weight"] = (h,)
    if layer_type == "full_attention":
        a = f"{prefix}.self_attn"
        q_width = c.num_attention_heads * c.head_dim
        kv_width = c.num_key_value_heads * c.head_dim
        t[f"{a}.q_proj.weight"] = (2 * q_width, h)  # query and output gate, per head
        t[f"{a}.k_proj.weight"] = (kv_width, h)
        t[f"{a}.v_proj.weight"] = (kv_width, h)
        t[f"{a}.o_proj.weight"] = (h, q_width)
        t[f"{a}.q_norm.weight"] = (c.head_dim,)
        t[f"{a}.k_norm.weight"] = (c.head_dim,)
    else:
        g = f"{prefix}.linear_attn"
        kd, vd, hv = c.linear_key_dim, c.linear_value_dim, c.linear_num_value_heads
        if c.family == "qwen3_next":
            t[f"{g}.in_proj_qkvz.weight"] = (2 * kd + 2 * vd, h)
            t[f"{g}.in_proj_ba.weight"] = (2 * hv, h)
        else:
            t[f"{g}.in_proj_qkv.weight"] = (2 * kd + vd, h)
            t[f"{g}.in_proj_z.weight"] = (vd, h)
            t[f"{g}.in_proj_b.weight"] = (hv, h)
            t[f"{g}.in_proj_a.weight"] = (hv, h)
        t[f"{g}.conv1d.weight"] = (c.conv_dim, 1, c.linear_conv_kernel_dim)
        t[f"{g}.dt_bias"] = (hv,)
        t[f"{g}.A_log"] = (hv,)
        t[f"{g}.norm.weight"] = (c.linear_value_head_dim,)
        t[f"{g}.out_proj.weight"] = (h, vd)
    m = f"{prefix}.mlp"
    if moe:
        t[f"{m}.gate.weight"] = (c.num_experts, h)
        for e in range(c.num_experts):
            t.update(_mlp_tensors(f"{m}.experts.{e}", h, c.moe_intermediate_size))
        t.update(_mlp_tensors(f"{m}.shared_expert", h, c.shared_expert_intermediate_size))
        t[f"{m}.shared_expert_gate.weight"] = (1, h)
    else:
        t.update(_mlp_tensors(m, h, c.intermediate_size))
    return t


def expected_tensors(config: ModelConfig, mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape in a Hugging Face safetensors checkpoint of `config`, as
    named in the files: text-only `model.` prefix (a multimodal Qwen3.5 checkpoint's
    `model.language_model.` is the same tensors), experts one by one, `lm_head.weight`
    unless tied, and the MTP head (`mtp.*`) when `mtp` and mtp_num_hidden_layers > 0."""
    c, h = config, config.hidden_size
    t: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i, layer_type in enumerate(c.layer_types):
        t.update(_layer_tensors(c, f"model.layers.{i}", layer_type, c.is_moe_layer(i)))
    t["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        t["lm_head.weight"] = (c.vocab_size, h)
    if mtp and c.mtp_num_hidden_layers > 0:
        t["mtp.fc.weight"] = (h, 2 * h)
        t["mtp.pre_fc_norm_embedding.weight"] = (h,)
        t["mtp.pre_fc_norm_hidden.weight"] = (h,)
        t["mtp.norm.weight"] = (h,)
        for j in range(c.mtp_num_hidden_layers):
            t.update(_layer_tensors(c, f"mtp.layers.{j}", "full_attention", c.is_moe_layer(0)))
    return t
