"""A tiny random hybrid model in float64, built once per test session (CPU, milliseconds)."""

import copy
import functools
import os

import torch

from ninfer.model.config import ModelConfig
from ninfer.model.hybrid import HybridModel
from ninfer.model.torch_model import TorchModel

TINY = {
    "model_type": "qwen3_next", "vocab_size": 97, "hidden_size": 64, "num_hidden_layers": 4,
    "full_attention_interval": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    "head_dim": 16, "partial_rotary_factor": 0.5, "rope_theta": 10000, "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "intermediate_size": 128,
    "num_experts": 0, "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,
}


@functools.cache
def tiny_net(dtype=torch.float64) -> HybridModel:
    torch.manual_seed(0)
    net = HybridModel(ModelConfig.from_dict(TINY)).to(dtype)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return net


# NINFER_TEST_TENSOR_PARALLEL=N: `torch_factory` shards the tiny net over N gloo ranks
# (followers spawned once per test process), so the torch-model tests run on the sharded model
TENSOR_PARALLEL = int(os.environ.get("NINFER_TEST_TENSOR_PARALLEL", "1"))
_ranks = None


def plain_factory(num_blocks: int, block_size: int, num_slots: int) -> TorchModel:
    return TorchModel(tiny_net(), num_blocks=num_blocks, block_size=block_size,
                      num_slots=num_slots, identity="tiny-test")


def torch_factory(num_blocks: int, block_size: int, num_slots: int):
    """The tiny float64 model in the pools' sizes: whole, or sharded (see above)."""
    if TENSOR_PARALLEL == 1:
        return plain_factory(num_blocks, block_size, num_slots)
    global _ranks
    if _ranks is None:
        from ninfer.model.ranks import launch
        _ranks = launch(TENSOR_PARALLEL, timeout=120)
    sizes = dict(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots)
    return _ranks.open("tests.model.nets:tiny_shard", sizes,
                       local=lambda: tiny_shard(_ranks, **sizes))


def tiny_shard(ranks, *, num_blocks: int, block_size: int, num_slots: int) -> TorchModel:
    """One rank's shard of the tiny float64 net (every rank builds it alike)."""
    from ninfer.model.shard import Collectives, Shard, build_shard
    torch.set_num_threads(1)
    net = build_shard(tiny_net(), Shard(ranks.rank, ranks.world),
                      Collectives(ranks.wire.compute, ranks.world))
    return TorchModel(net, num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                      identity=f"tiny-test-tp{ranks.world}", graphs=False)


@torch.inference_mode()
def reference(tokens, max_tokens: int, net=None):
    """A plain Root run in float64 on the CPU (of `net`'s weights, default the float64 tiny
    net): greedy tokens and, at each, the gap between the top two logits."""
    model = plain_factory(4, 4, 2) if net is None else TorchModel(
        copy.deepcopy(net).to("cpu", torch.float64), num_blocks=4, block_size=4,
        num_slots=2, identity="reference")
    out = model.reference_generate(tokens, max_tokens)
    gaps = []
    seq = list(tokens)
    for token in out:
        from ninfer.model.hybrid import HybridState
        state = HybridState.initial(model.config, 1, torch.float64)
        logits = model.net.forward(torch.tensor([seq]), torch.arange(len(seq))[None],
                                   state).logits[0, -1]
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        seq.append(token)
    return out, gaps


def agree_until_tie(got, ref, gaps, tie=1e-9) -> bool:
    """The tie rule (specs/invariants.md, "Exactness"): equal up to the first position where
    the reference's top-2 logit gap is below `tie` (there arithmetic alone may decide)."""
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):
        if gaps[i] < tie:
            return True
        if a != b:
            return False
    return len(got) == len(ref)


class ChunkKV:
    """A KV store holding one lane's keys and values [1, L, Hkv, D] (`_attend` reads it)."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def read(self, layer, length):
        return self.keys[:, :length], self.values[:, :length]

    def to(self, dtype):
        return ChunkKV(self.keys.to(dtype), self.values.to(dtype))


def attention_chunk_case(device: str, T: int = 24, L: int = 80):
    """An attention layer of the tiny net's shape but 4 query heads to 2 KV heads (a group
    of 2, as in the real models), in bf16, and a prefill chunk's inputs: q [1, T, H, D], a
    store of L positions' keys and values, the chunk's positions L - T .. L - 1."""
    from ninfer.model.attention import GatedAttention
    config = ModelConfig.from_dict({**TINY, "num_attention_heads": 4, "num_key_value_heads": 2})
    attn = GatedAttention(config).to(device, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)
    q = rand(1, T, attn.num_heads, attn.head_dim)
    store = ChunkKV(rand(1, L, attn.num_kv_heads, attn.head_dim),
                    rand(1, L, attn.num_kv_heads, attn.head_dim))
    return attn, q, store, torch.arange(L - T, L, device=device)[None]
