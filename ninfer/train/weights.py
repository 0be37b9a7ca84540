"""The trained model's weights: their seeded initial values, and the `.ninfer` file they are
written to (bf16, with the corpus's tokenizer and the thinking-off chat template), which
`ninfer serve MODEL` and `load_files` read like any other."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tokenizers import Tokenizer as BackendTokenizer
from torch import nn

from ..model.bpe import added_ids, tokenizer_config
from ..model.config import ModelConfig, expected_tensors
from ..model.fileformat import write_ninfer
from ..model.gdn import GatedDeltaNet
from ..model.hybrid import HybridModel
from ..model.layers import GatedRMSNorm, RMSNorm

STD = 0.02
# output projections of each residual branch start smaller, by 1 / sqrt(2 x layers)
_BRANCH_OUTPUTS = ("o_proj", "out_proj", "down_proj")


def build(config: ModelConfig, seed: int) -> HybridModel:
    """A float32 HybridModel of `config` (MTP head included) with seeded initial weights:
    matrices N(0, 0.02) (branch outputs scaled down), zero-centred norms at 0 (identity),
    the GDN output norm at 1, conv taps U(+-1/sqrt(K)), decay rates A in [1, 16] and time
    steps log-uniform in [0.001, 0.1] (through dt_bias = softplus^-1(dt))."""
    g = torch.Generator().manual_seed(seed)
    net = HybridModel(config, mtp=True)
    branch_std = STD / math.sqrt(2 * config.num_hidden_layers)
    with torch.no_grad():
        for name, module in net.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear | nn.Embedding):
                std = branch_std if leaf in _BRANCH_OUTPUTS else STD
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * std)
            elif isinstance(module, nn.Conv1d):
                bound = module.weight.shape[-1] ** -0.5
                module.weight.copy_(torch.empty(module.weight.shape).uniform_(
                    -bound, bound, generator=g))
            elif isinstance(module, GatedRMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, RMSNorm):
                module.weight.zero_()
            if isinstance(module, GatedDeltaNet):  # its own parameters
                heads = module.A_log.shape
                module.A_log.copy_(torch.empty(heads).uniform_(1.0, 16.0, generator=g).log())
                dt = torch.exp(torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1),
                                                           generator=g))
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    return net


def weight_bytes(config: ModelConfig) -> int:
    """bf16 bytes of every tensor of the checkpoint (MTP head included)."""
    return 2 * sum(math.prod(s) for s in expected_tensors(config).values())


def save(net: HybridModel, tokenizer_json: str, path: str | Path, chat_template: str) -> Path:
    """Write `net` as a `.ninfer` (bf16 weights, checkpoint names) atomically, with
    `chat_template` (the corpus's). The header keeps the tokenizer without the corpus
    file's indentation: the default shape's file then stays under 16 MiB (what the GPU
    machine hands back in one file)."""
    config = net.config
    tokenizer_json = BackendTokenizer.from_str(tokenizer_json).to_str(pretty=False)
    params = dict(net.named_parameters())
    tensors = {name: params[name].detach().to("cpu", torch.bfloat16).contiguous()
               for name in expected_tensors(config)}
    ids = added_ids(tokenizer_json)
    tok_config = tokenizer_config(tokenizer_json, chat_template,
                                  config.max_position_embeddings)
    del tok_config["chat_template"]  # the header keeps the template on its own
    generation = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                  "pad_token_id": ids["<|endoftext|>"]}
    return write_ninfer(path, config=config.to_dict(), tokenizer_json=tokenizer_json,
                        tokenizer_config=tok_config,
                        chat_template=chat_template,
                        generation_config=generation, tensors=tensors, progress=False)
