"""Named model shapes for `make_tiny(preset=...)` and `ninfer make-tiny --preset`: plain data
(no torch), so the command's help lists them without loading torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    """A named model shape for `make_tiny(preset=...)` / `ninfer make-tiny --preset`:
    ModelConfig fields that replace the default shape's."""

    description: str
    overrides: Mapping[str, Any]


PRESETS = {
    "tiny": Preset("the default shape (hidden 256, 8 layers, vocab 4,096): 9.5M "
                   "parameters, written in about a second; the tests' and the CPU benches' "
                   "model", {}),
    # the GPU benchmarks' model (bench/gpu.sh): the shape of ../shared/TARGETS.md's anchor
    "anchor-1b": Preset(
        "the GPU benchmarks' model: 0.73B parameters and an MTP layer of 19M (hidden 1024, "
        "24 layers [GDN x 3, attention] x 6, attention 8 heads x 256 with 2 KV heads, GDN 8 "
        "key / 16 value heads of 128, MLP 3072, Qwen's 151,936-row vocabulary, untied LM "
        "head), ~1.5 GB in bf16",
        dict(vocab_size=151_936, hidden_size=1024, num_hidden_layers=24,
             layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 6,
             num_attention_heads=8, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, intermediate_size=3072,
             tie_word_embeddings=False)),
}
