"""Tensor-parallel sharding of the hybrid model, Megatron style: what one rank of N holds
and where its partial results are summed.

- Attention: query heads split evenly; key/value head groups kept whole. With at least N
  KV heads each rank takes Hkv/N of them and their query heads; with fewer (the tiny
  models have one) each rank holds a copy of the one KV head its query heads read, as
  vLLM does. q/k/v are column-parallel, o_proj row-parallel.
- GDN: key heads split evenly, each with its value heads (value head kh*r+j reads key
  head kh), so the conv channels, the recurrent matrix and the gates of a rank are those
  of its heads; the in-projections column-parallel, out_proj row-parallel.
- MLP: the intermediate dimension split (gate/up column-, down row-parallel).
- MoE: every expert's intermediate dimension split across the ranks (tensor-parallel
  experts), the router and the shared expert's gate replicated. Routing is then computed
  identically on every rank from the same hidden state, every rank works on every chosen
  expert (load stays even whatever the router picks), and the block needs one all-reduce
  like a dense MLP. Expert-parallel would give each rank whole experts, but it needs an
  all-to-all of tokens per block and balances only as well as the router does: at the
  sizes this runs (tiny experts, few tokens a step) that exchange costs more than it
  saves.
- LM head (and the MTP head's, which is the same weight): vocabulary-parallel, each rank
  its slice of rows; the logits are gathered, so every rank sees the full [.., V] and
  greedy / sampling read what a single process would. The embedding is replicated.

One all-reduce per block: after each mixer (attention or GDN) and after each MLP / MoE,
the partial outputs are summed on every rank (`_reduce` hooks). The hidden state between
blocks is therefore whole and equal on every rank; the KV pool and the recurrent-state
slots of a rank hold only its heads.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import GatedAttention
from .config import ModelConfig
from .gdn import GatedDeltaNet
from .hybrid import DecoderLayer, HybridModel
from .layers import MLP, SparseMoE


class ShardError(ValueError):
    """The model cannot be split over this many ranks; the message says what does not
    divide."""


@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int
    world: int


def check_shardable(config: ModelConfig, world: int) -> None:
    """Raise ShardError naming every size that does not divide over `world` ranks."""
    if world < 1:
        raise ShardError(f"--tensor-parallel must be at least 1, got {world}")
    c, problems = config, []
    if c.num_attention_heads % world:
        problems.append(f"attention heads ({c.num_attention_heads})")
    kv = c.num_key_value_heads
    if kv % world and world % kv:
        problems.append(f"key/value heads ({kv}: neither divides the other)")
    if c.linear_num_key_heads % world:
        problems.append(f"GDN key heads ({c.linear_num_key_heads})")
    if c.intermediate_size % world:
        problems.append(f"MLP intermediate size ({c.intermediate_size})")
    if c.is_moe:
        for name, size in (("expert intermediate size", c.moe_intermediate_size),
                           ("shared expert intermediate size",
                            c.shared_expert_intermediate_size)):
            if size % world:
                problems.append(f"{name} ({size})")
    if problems:
        raise ShardError(f"this model cannot be split over {world} ranks: "
                         + ", ".join(problems) + f" not divisible by {world}")


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The sizes one rank's modules have (the vocabulary stays whole: the embedding is
    replicated, the head is built apart)."""
    check_shardable(config, world)
    c = config
    return dataclasses.replace(
        c, num_attention_heads=c.num_attention_heads // world,
        num_key_value_heads=max(1, c.num_key_value_heads // world),
        linear_num_key_heads=c.linear_num_key_heads // world,
        linear_num_value_heads=c.linear_num_value_heads // world,
        intermediate_size=c.intermediate_size // world,
        moe_intermediate_size=c.moe_intermediate_size // world,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size // world)


class Collectives:
    """The sums and gathers a rank's forward needs, over one process group, timed (the
    bench reports the time spent in them)."""

    def __init__(self, group, world: int) -> None:
        self.group, self.world = group, world
        self.seconds, self.calls = 0.0, 0

    def all_reduce(self, x: Tensor) -> Tensor:
        import torch.distributed as dist
        x = x.contiguous()
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """Every rank's x [.., n] concatenated along the last axis, in rank order."""
        import torch.distributed as dist
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        t0 = time.perf_counter()
        dist.all_gather(parts, x, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return torch.cat(parts, dim=-1)


class ShardedHybridModel(HybridModel):
    """One rank's part of a HybridModel: sharded blocks whose outputs are summed over the
    ranks, and a vocabulary-parallel head whose logits are gathered. It computes what the
    whole model computes (up to the order of the sums)."""

    def __init__(self, full_config: ModelConfig, shard: Shard, collectives: Collectives,
                 mtp: bool = True) -> None:
        super().__init__(shard_config(full_config, shard.world), mtp=mtp)
        self.full_config, self.shard, self.collectives = full_config, shard, collectives
        self.vocab_per_rank = -(-full_config.vocab_size // shard.world)
        if hasattr(self, "lm_head"):
            del self.lm_head
        # rows [rank * n, (rank + 1) * n) of the head; the last rank's padded with zeros
        self.head_slice = nn.Parameter(torch.zeros(self.vocab_per_rank,
                                                   full_config.hidden_size))
        for layer in self._layers():
            mixer = layer.self_attn if layer.layer_type == "full_attention" \
                else layer.linear_attn
            mixer.register_forward_hook(self._reduce)
            layer.mlp.register_forward_hook(self._reduce)

    def _layers(self) -> list[DecoderLayer]:
        layers = list(self.model.layers)
        return layers + (list(self.mtp.layers) if self.has_mtp else [])

    def _reduce(self, _module, _inputs, output):
        """A block's partial output summed over the ranks (a GDN layer's is (y, state))."""
        if isinstance(output, tuple):
            return (self.collectives.all_reduce(output[0]), *output[1:])
        return self.collectives.all_reduce(output)

    def lm_logits(self, hidden: Tensor) -> Tensor:
        local = F.linear(hidden, self.head_slice)  # [.., V / N]
        return self.collectives.all_gather_last(local)[..., :self.full_config.vocab_size]

    def _head_weight(self) -> Tensor:
        raise NotImplementedError("a sharded model's head is vocabulary-parallel")

    @torch.no_grad()
    def load_from(self, full: HybridModel) -> None:
        """Copy this rank's slices of `full`'s weights. Every parameter is first set to
        NaN, so one that no rule copied shows up as an error here, not as a wrong model."""
        for p in self.parameters():
            p.fill_(float("nan"))
        fc, r, n = self.full_config, self.shard.rank, self.shard.world
        self.model.embed_tokens.weight.copy_(full.model.embed_tokens.weight)
        self.model.norm.weight.copy_(full.model.norm.weight)
        head = full.model.embed_tokens.weight if fc.tie_word_embeddings \
            else full.lm_head.weight
        rows = head[r * self.vocab_per_rank:(r + 1) * self.vocab_per_rank]
        self.head_slice.zero_()
        self.head_slice[:rows.shape[0]] = rows
        pairs = list(zip(full.model.layers, self.model.layers, strict=True))
        if self.has_mtp:
            for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
                getattr(self.mtp, name).load_state_dict(getattr(full.mtp, name).state_dict())
            pairs += list(zip(full.mtp.layers, self.mtp.layers, strict=True))
        for whole, part in pairs:
            part.input_layernorm.load_state_dict(whole.input_layernorm.state_dict())
            part.post_attention_layernorm.load_state_dict(
                whole.post_attention_layernorm.state_dict())
            if whole.layer_type == "full_attention":
                _attention(whole.self_attn, part.self_attn, fc, r, n)
            else:
                _gdn(whole.linear_attn, part.linear_attn, fc, r, n)
            _mlp_kind(whole.mlp, part.mlp, r, n)
        missed = [name for name, p in self.named_parameters() if torch.isnan(p).any()]
        if missed:
            raise ShardError(f"no sharding rule filled {', '.join(missed[:5])}")


def _span(size: int, rank: int, world: int) -> slice:
    per = size // world
    return slice(rank * per, (rank + 1) * per)


def kv_heads(config: ModelConfig, rank: int, world: int) -> slice:
    """The KV heads rank `rank` holds: its share, or the one its query heads read."""
    kv, h = config.num_key_value_heads, config.num_attention_heads
    if kv >= world:
        return _span(kv, rank, world)
    first = rank * (h // world) // (h // kv)
    return slice(first, first + 1)


def _attention(whole: GatedAttention, part: GatedAttention, c: ModelConfig, r: int,
               n: int) -> None:
    h, D = c.hidden_size, c.head_dim
    q, kv = _span(c.num_attention_heads, r, n), kv_heads(c, r, n)
    part.q_proj.weight.copy_(whole.q_proj.weight.view(-1, 2 * D, h)[q].reshape(-1, h))
    part.k_proj.weight.copy_(whole.k_proj.weight.view(-1, D, h)[kv].reshape(-1, h))
    part.v_proj.weight.copy_(whole.v_proj.weight.view(-1, D, h)[kv].reshape(-1, h))
    part.o_proj.weight.copy_(whole.o_proj.weight.view(h, -1, D)[:, q].reshape(h, -1))
    part.q_norm.load_state_dict(whole.q_norm.state_dict())
    part.k_norm.load_state_dict(whole.k_norm.state_dict())


def _gdn(whole: GatedDeltaNet, part: GatedDeltaNet, c: ModelConfig, r: int, n: int) -> None:
    h = c.hidden_size
    Hk, Hv = c.linear_num_key_heads, c.linear_num_value_heads
    Dk, Dv = c.linear_key_head_dim, c.linear_value_head_dim
    k, v = _span(Hk, r, n), _span(Hv, r, n)  # value heads follow their key heads

    def heads(t: Tensor, count: int, width: int, which: slice) -> Tensor:
        return t.reshape(count, width, *t.shape[1:])[which].reshape(-1, *t.shape[1:])

    def channels(t: Tensor) -> Tensor:  # q | k | v sections, each cut to the rank's heads
        qs, ks, vs = t.split([Hk * Dk, Hk * Dk, Hv * Dv])
        return torch.cat([heads(qs, Hk, Dk, k), heads(ks, Hk, Dk, k), heads(vs, Hv, Dv, v)])

    if c.family == "qwen3_next":  # packed per key-head group already
        part.in_proj_qkvz.weight.copy_(heads(whole.in_proj_qkvz.weight, Hk, -1, k))
        part.in_proj_ba.weight.copy_(heads(whole.in_proj_ba.weight, Hk, -1, k))
    else:
        part.in_proj_qkv.weight.copy_(channels(whole.in_proj_qkv.weight))
        part.in_proj_z.weight.copy_(heads(whole.in_proj_z.weight, Hv, Dv, v))
        part.in_proj_b.weight.copy_(whole.in_proj_b.weight[v])
        part.in_proj_a.weight.copy_(whole.in_proj_a.weight[v])
    part.conv1d.weight.copy_(channels(whole.conv1d.weight))
    part.dt_bias.copy_(whole.dt_bias[v])
    part.A_log.copy_(whole.A_log[v])
    part.norm.load_state_dict(whole.norm.state_dict())
    part.out_proj.weight.copy_(whole.out_proj.weight.view(h, Hv, Dv)[:, v].reshape(h, -1))


def _mlp(whole: MLP, part: MLP, r: int, n: int) -> None:
    cut = _span(whole.gate_proj.weight.shape[0], r, n)
    part.gate_proj.weight.copy_(whole.gate_proj.weight[cut])
    part.up_proj.weight.copy_(whole.up_proj.weight[cut])
    part.down_proj.weight.copy_(whole.down_proj.weight[:, cut])


def _mlp_kind(whole: nn.Module, part: nn.Module, r: int, n: int) -> None:
    if isinstance(whole, SparseMoE):
        assert isinstance(part, SparseMoE)
        part.gate.load_state_dict(whole.gate.state_dict())  # the router: replicated
        part.shared_expert_gate.load_state_dict(whole.shared_expert_gate.state_dict())
        for e, expert in enumerate(whole.experts):
            _mlp(expert, part.experts[e], r, n)
        _mlp(whole.shared_expert, part.shared_expert, r, n)
    else:
        _mlp(whole, part, r, n)


def build_shard(full: HybridModel, shard: Shard, collectives: Collectives) -> ShardedHybridModel:
    """Rank `shard.rank`'s part of `full` (same dtype and device)."""
    weight = next(full.parameters())
    net = ShardedHybridModel(full.config, shard, collectives, mtp=full.has_mtp)
    net = net.to(device=weight.device, dtype=weight.dtype)
    net.load_from(full)
    return net
