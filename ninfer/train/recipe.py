"""The recipe's fixed choices: the model's shape and the training settings.

The shape is a Qwen3.5 text model sized for bf16 weights of at most 16 MiB (8.16M
parameters, 15.6 MiB): hidden 256, eight layers [GDN, GDN, GDN, gated attention] x 2, dense
SwiGLU MLPs of 512, attention 4 heads x 64 over 2 KV heads with a quarter of each head
rotated, GDN 2 key / 4 value heads of 64, conv 4, the embeddings tied to the output head,
one MTP layer. Torch-free: the configuration is data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..model.config import ModelConfig

MAX_WEIGHT_BYTES = 16 * 2**20


def trained_config(vocab_size: int, *, endoftext: int, im_end: int, **overrides) -> ModelConfig:
    """The trained default model's shape; `overrides` replace fields (the CI smoke test's
    smaller shape)."""
    config = ModelConfig(
        family="qwen3_5", vocab_size=vocab_size, hidden_size=256, num_hidden_layers=8,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
        rope_theta=10_000.0, rms_norm_eps=1e-6, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, intermediate_size=512, tie_word_embeddings=True,
        mtp_num_hidden_layers=1, max_position_embeddings=4096, bos_token_id=None,
        eos_token_ids=(im_end, endoftext))
    return dataclasses.replace(config, **overrides)


def smoke_shape(layers: int = 4) -> dict:
    """Overrides of a shape small enough to train a few steps on the CPU in seconds."""
    return dict(hidden_size=64, num_hidden_layers=layers,
                layer_types=(("linear_attention",) * 3 + ("full_attention",)) * (layers // 4),
                num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                linear_key_head_dim=16, linear_value_head_dim=16, intermediate_size=128)


@dataclass(frozen=True)
class TrainSettings:
    """Everything that decides the trained weights besides the corpus and the shape."""

    steps: int = 2300               # ~4 epochs of the corpus (its held-out loss still falls)
    batch: int = 32                 # windows per step
    seq_len: int = 1024             # tokens per window (each window reads seq_len + 1)
    lr: float = 2e-3                # peak; AdamW, linear warmup, cosine decay to min_lr
    min_lr: float = 2e-4
    warmup: int = 150
    weight_decay: float = 0.1       # on matrices only (not norms, gates, decay rates)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    mtp_depth: int = 3              # draft steps the MTP head is trained for (k up to 3)
    mtp_weight: float = 0.6         # of the MTP steps' mean loss, beside the main loss
    seed: int = 0
    # a window drawn inside a chat example starts at its first token (`loop.Windows`;
    # bench/NOTES.md, stop 42)
    whole_chats: bool = True
    eval_every: int = 250           # held-out loss every this many steps (0: never)
    checkpoint_every: int = 1000    # a .ninfer beside the final one every this many steps

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len
