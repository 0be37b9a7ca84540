"""The MTP (multi-token prediction) head of Qwen3-Next / Qwen3.5: one extra decoder layer
that predicts token t+2 from the main model's hidden state at t and the embedding of t+1.

Definition (as vLLM and SGLang run these checkpoints):

    x_t    = fc(cat(pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(h_t)))
    y_t    = mtp.norm(decoder_layer(x_t at position t))      # full attention, own KV
    logits = lm_head(y_t)                                     # shared with the main model

h_t is the main model's hidden state at t *after* its final norm (`model.norm`), the same
tensor the lm_head reads; the embedding comes first in the concatenation. The entry for
position t uses RoPE position t and writes the MTP layer's KV at t. To draft a second
token, chain: feed y_t (the MTP output, also after its norm) as the hidden state at t+1
with the first draft as token t+2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .attention import KVStore
from .config import ModelConfig
from .layers import RMSNorm


class MTPOutput(NamedTuple):
    logits: Tensor  # [B, T, V]: the distribution of token t+2 for each entry t
    hidden: Tensor  # [B, T, hidden]: after mtp.norm, the hidden state to chain from


class MTPHead(nn.Module):
    """`mtp.*` in the checkpoint. The decoder layers (full attention, with the model's MLP
    kind) are built by the caller and registered as `layers`; spec step s uses layer
    s % len(layers), as vLLM does when a checkpoint has several."""

    def __init__(self, config: ModelConfig, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps)
        self.pre_fc_norm_hidden = RMSNorm(h, eps)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(h, eps)

    def forward(self, hidden: Tensor, next_embedding: Tensor, positions: Tensor,
                cos_sin: tuple[Tensor, Tensor], kv: KVStore, step: int = 0) -> Tensor:
        """hidden [B, T, D] (h_t), next_embedding [B, T, D] (embedding of token t+1),
        positions [B, T] (t) -> y [B, T, D] after mtp.norm. Writes the MTP KV at `positions`
        under key step % len(layers) of `kv`, attends over MTP KV [0, t]."""
        x = torch.cat([self.pre_fc_norm_embedding(next_embedding),
                       self.pre_fc_norm_hidden(hidden)], dim=-1)  # [B, T, 2D]
        x = self.fc(x)
        which = step % len(self.layers)
        x, _ = self.layers[which](x, positions, cos_sin, kv, which, None)
        return self.norm(x)
