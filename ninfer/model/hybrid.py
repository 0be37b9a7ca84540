"""The hybrid decoder (GDN + gated attention layers), its explicit state, and the LM.

State is never hidden in modules: `HybridModel.forward` takes a `HybridState` (GDN states
per linear layer, a KVStore for the attention layers) and returns the state after the
tokens as a new value. The GDN states of the input are left untouched, so a caller that
keeps them can retry; the KVStore is written at the tokens' positions (harmless to a
rollback: positions past the committed frontier are rewritten before they are read).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from kernels import kernels_for, skinny_for

from .attention import ContiguousKV, GatedAttention, KVStore
from .config import ModelConfig
from .fileformat import LoadError  # one error for every refusal at load
from .gdn import GatedDeltaNet, GDNState
from .layers import MLP, RMSNorm, SparseMoE, rope_cos_sin
from .mtp import MTPHead, MTPOutput
from .protocol import run_through


@dataclass(frozen=True)
class HybridState:
    """The main model's state parts at a position P for a batch of rows: `gdn[i]` for each
    linear-attention layer i (conv tail and recurrent matrix exactly at P), and `kv`, the
    attention KV, which must hold positions [0, P) for every attention layer."""

    gdn: dict[int, GDNState]
    kv: KVStore

    @classmethod
    def initial(cls, config: ModelConfig, batch: int, dtype: torch.dtype,
                device: torch.device | str | None = None, kv: KVStore | None = None,
                ) -> HybridState:
        """The state at position 0 (a Root plan); a fresh ContiguousKV unless `kv` is given."""
        gdn = {i: GDNState.zeros(config, batch, dtype, device) for i in config.linear_layers}
        return cls(gdn, ContiguousKV() if kv is None else kv)


class ForwardOutput(NamedTuple):
    logits: Tensor | None  # [B, T, V]; None when forward(..., logits=False)
    hidden: Tensor  # [B, T, hidden]: after the final norm (what lm_head and the MTP head read)
    state: HybridState  # the state after the last token
    states: dict[int, GDNState] | None  # per-position GDN states, with all_states=True

    def state_at(self, index: Tensor | int) -> HybridState:
        """The state after position index[b] of this forward's tokens, per row (a rollback
        after verification). Needs all_states=True."""
        if self.states is None:
            raise ValueError("state_at needs forward(..., all_states=True)")
        return replace(self.state, gdn={i: s.pick(index) for i, s in self.states.items()})


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or gated attention), then MLP or MoE."""

    def __init__(self, config: ModelConfig, layer_type: str, moe: bool) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer_type == "full_attention":
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config) if moe else MLP(config.hidden_size, config.intermediate_size)

    def forward(self, h: Tensor, positions: Tensor, cos_sin: tuple[Tensor, Tensor],
                kv: KVStore, kv_layer: int, gdn: GDNState | None, all_states: bool = False,
                ) -> tuple[Tensor, GDNState | None]:
        """h [B, T, hidden] -> (h, new GDN state or None for an attention layer)."""
        if skinny_for(h) is not None and isinstance(self.mlp, MLP):
            return self._decode(h, positions, cos_sin, kv, kv_layer, gdn, all_states)
        x = self.input_layernorm(h)
        if self.layer_type == "full_attention":
            mixed, new_gdn = self.self_attn(x, positions, cos_sin, kv, kv_layer), None
        else:
            assert gdn is not None, "a GDN layer needs its state"
            mixed, new_gdn = self.linear_attn(x, gdn, all_states=all_states)
        dev = kernels_for(h)
        if dev is not None:  # the residual add and the norm in one kernel
            norm = self.post_attention_layernorm
            y, h = dev.rms_norm(mixed, norm.weight, norm.eps, 1.0, residual=h)
            return h + self.mlp(y), new_gdn
        h = h + mixed
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, new_gdn

    def _decode(self, h: Tensor, positions: Tensor, cos_sin: tuple[Tensor, Tensor],
                kv: KVStore, kv_layer: int, gdn: GDNState | None, all_states: bool,
                ) -> tuple[Tensor, GDNState | None]:
        """`forward` for a few rows on the device: each norm runs inside the GEMM after it,
        each residual add inside the GEMM before it (four GEMM kernels and the mixer's own
        in between, no norm or add kernel)."""
        norm = self.input_layernorm
        if self.layer_type == "full_attention":
            h, new_gdn = self.self_attn(h, positions, cos_sin, kv, kv_layer, norm=norm,
                                        residual=h), None
        else:
            assert gdn is not None, "a GDN layer needs its state"
            h, new_gdn = self.linear_attn(h, gdn, all_states=all_states, norm=norm, residual=h)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h), new_gdn


class Decoder(nn.Module):
    """`model.*` in the checkpoint: embeddings, the decoder layers, the final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, t, config.is_moe_layer(i))
                                    for i, t in enumerate(config.layer_types))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class HybridModel(nn.Module):
    """A Qwen3-Next / Qwen3.5 causal LM with its optional MTP head.

    Parameter names are the checkpoint's: `model.state_dict()` keys equal
    `expected_tensors(config, mtp=...)` (no fused or renamed tensors); `load_weights` fills
    them from checkpoint-named tensors. Works in float32, float64 or bf16 (`.to(dtype)`)."""

    def __init__(self, config: ModelConfig, mtp: bool = True) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if mtp and config.mtp_num_hidden_layers > 0:
            # vLLM decides the MTP layer's MLP kind as for layer index 0
            self.mtp = MTPHead(config, [DecoderLayer(config, "full_attention",
                                                     config.is_moe_layer(0))
                                        for _ in range(config.mtp_num_hidden_layers)])

    @property
    def has_mtp(self) -> bool:
        return hasattr(self, "mtp")

    def lm_logits(self, hidden: Tensor) -> Tensor:
        """The shared output head: hidden [.., hidden] (already final-normed) -> [.., V]."""
        skinny = skinny_for(hidden)
        return F.linear(hidden, self._head_weight()) if skinny is None \
            else skinny.linear(hidden, self._head_weight())

    def _head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings \
            else self.lm_head.weight

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        c = self.config
        return rope_cos_sin(positions, c.rotary_dim, c.rope_theta, dtype)

    def forward(self, input_ids: Tensor, positions: Tensor, state: HybridState,
                all_states: bool = False, logits: bool = True,
                embedded: tuple[Tensor, tuple[Tensor, Tensor]] | None = None,
                greedy: Tensor | None = None, last_logits: bool = False) -> ForwardOutput:
        """`forward_steps` run through (see there for the arguments)."""
        return run_through(self.forward_steps(input_ids, positions, state, all_states, logits,
                                              embedded, greedy, last_logits))

    def forward_steps(self, input_ids: Tensor, positions: Tensor, state: HybridState,
                      all_states: bool = False, logits: bool = True,
                      embedded: tuple[Tensor, tuple[Tensor, Tensor]] | None = None,
                      greedy: Tensor | None = None, last_logits: bool = False
                      ) -> Generator[None, None, ForwardOutput]:
        """Feed input_ids [B, T] at positions [B, T] (row b: P_b, P_b+1, ..., P_b+T-1)
        continuing from `state`, the state at P_b of each row. Prefill (any T, any P),
        decode (T=1) and verification (T=k+1, `all_states=True` for per-position GDN states
        so a rollback is `out.state_at(index)`) are this one call. `embedded`: the
        embedding rows and rotary cos / sin of input_ids at positions, made already (a
        decode graph's first kernel, `kernels.greedy.decode_start`). `greedy`: int64 [B],
        reset to `kernels.greedy.KEY_NONE`: each row's greedy key of its last position's
        logits is folded into it on the device (`kernels.greedy`; needs the kernels).
        `last_logits`: only the last position's logits are made ([B, 1, V]; a prefill reads
        no others, and the LM head over every position of a 2K chunk of a 152K vocabulary
        is a 0.6 TFLOP GEMM and 0.6 GB of logits)."""
        if embedded is None:
            h = self.model.embed_tokens(input_ids)  # [B, T, hidden]
            cos_sin = self.rope(positions, h.dtype)
        else:
            h, cos_sin = embedded
        new_gdn: dict[int, GDNState] = {}
        for i, layer in enumerate(self.model.layers):
            h, s = layer(h, positions, cos_sin, state.kv, i, state.gdn.get(i), all_states)
            if s is not None:
                new_gdn[i] = s
            yield   # a layer's work launched: the caller may launch other work before the next
        skinny = skinny_for(h) if logits else None
        if skinny is not None:  # the final norm inside the head's GEMM, which writes it out
            norm = self.model.norm
            out, hidden = skinny.norm_linear(h, norm.weight, norm.eps, self._head_weight(),
                                             normed=True, argmax=greedy)
        else:
            hidden = self.model.norm(h)
            out = self.lm_logits(hidden[:, -1:] if last_logits else hidden) if logits else None
            if greedy is not None and out is not None:
                dev = kernels_for(out)
                if dev is None:
                    raise ValueError("greedy keys are made by the device kernels")
                dev.greedy_keys(out[:, -1].contiguous(), greedy)
        final = {i: s.pick(-1) for i, s in new_gdn.items()} if all_states else new_gdn
        return ForwardOutput(out, hidden, HybridState(final, state.kv),
                             new_gdn if all_states else None)

    def mtp_forward(self, hidden: Tensor, next_ids: Tensor, positions: Tensor, kv: KVStore,
                    step: int = 0) -> MTPOutput:
        """The MTP head over entries t = positions [B, T]: hidden [B, T, D] is h_t (main
        model `ForwardOutput.hidden`, or a previous `MTPOutput.hidden` when chaining),
        next_ids [B, T] is token t+1. Writes the MTP KV at t into `kv` (the MTP layer's own
        store, never the main model's) and attends over its [0, t]; `logits` predict token
        t+2. See `ninfer.model.mtp` for the definition."""
        if not self.has_mtp:
            raise ValueError("this model was built without its MTP head")
        embedding = self.model.embed_tokens(next_ids)
        y = self.mtp(hidden, embedding, positions, self.rope(positions, hidden.dtype), kv, step)
        return MTPOutput(self.lm_logits(y), y)


def checkpoint_name(name: str) -> str | None:
    """Map a name as found in checkpoint files to this model's name; None to skip it.
    Multimodal Qwen3.5 files prefix the text model with `model.language_model.` and carry
    a vision tower (`model.visual.*`, skipped)."""
    if name.startswith("model.visual.") or name.startswith("visual."):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def load_weights(model: HybridModel, tensors: dict[str, Tensor], *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
    """Copy checkpoint-named tensors into `model` (cast to each parameter's dtype/device).
    Every parameter must be provided exactly once with its shape; `mtp.*` tensors are
    skipped when the model was built without its MTP head, and `lm_head.weight` when the
    embeddings are tied. Anything else unexpected is an error: a silently ignored tensor
    is a model that computes something else.

    A model built on the meta device (`loaded_model`) gets each tensor as its parameter,
    moved to `device` in `dtype`, instead of a copy into a parameter made first."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    unexpected, misshapen = [], []
    for raw, tensor in tensors.items():
        name = checkpoint_name(raw)
        if name is None:
            continue
        if name not in params:
            tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings
            if not (tied_head or (name.startswith("mtp.") and not model.has_mtp)):
                unexpected.append(raw)
            continue
        if tuple(tensor.shape) != tuple(params[name].shape):
            misshapen.append(f"{raw}: {tuple(tensor.shape)} != {tuple(params[name].shape)}")
            continue
        seen.add(name)
        if params[name].is_meta:
            _assign(model, name, tensor.to(device=device, dtype=dtype or params[name].dtype,
                                           copy=True))  # not the file's pages
            continue
        with torch.no_grad():
            params[name].copy_(tensor)
    missing = sorted(set(params) - seen)
    problems = [f"{what}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                for what, names in (("missing", missing), ("unexpected", sorted(unexpected)),
                                    ("wrong shape", misshapen)) if names]
    if problems:
        raise LoadError("; ".join(problems))


def _assign(model: nn.Module, name: str, value: Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def loaded_model(config: ModelConfig, tensors: dict[str, Tensor], *, mtp: bool,
                 device: torch.device | str, dtype: torch.dtype) -> HybridModel:
    """The model with the checkpoint's tensors as its parameters, on `device` in `dtype`.
    Built on the meta device with no initialiser run, so no parameter is made and randomly
    initialised only to be overwritten: for anchor-1b (0.73B parameters) that
    initialisation in float32 was 9.2 s of a 11.8 s load on the CPU, and the cast to bf16
    another 2.2 s (bench/NOTES.md, stop 42)."""
    with torch.device("meta"), _NoInit():
        net = HybridModel(config, mtp=mtp)
    load_weights(net, tensors, device=device, dtype=dtype)
    return net


class _NoInit(TorchFunctionMode):
    """The initialisers skipped while a model is built on the meta device: there they
    compute nothing, and the first of them imports torch._dynamo (1.1 s on the CPU)."""

    SKIPPED = frozenset({"normal_", "uniform_", "kaiming_uniform_", "trunc_normal_",
                         "zero_", "zeros_", "fill_", "ones_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))
