"""Tiny random models: a complete Hugging Face model directory (config.json, safetensors
weights, tokenizer.json, tokenizer_config.json with a chat template, generation_config.json)
small enough to build in about a second, for tests and CPU benchmarks.

The default shape is ../shared/TARGETS.md's: hidden 256, 8 layers [GDN, GDN, GDN, attention]
x 2, attention 2 heads x 64 with 1 KV head, GDN 2 key / 4 value heads of 64, conv 4, dense MLP
768, vocab 4,096, plus one MTP layer. The tokenizer is a real byte-level BPE trained on a
corpus generated here; it does not depend on `seed` (only the weights do). The same arguments
give byte-identical files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .bpe import ADDED, added_ids, tokenizer_config, train_bpe
from .config import ModelConfig, expected_tensors
from .presets import PRESETS
from .template import QWEN3_STYLE_TEMPLATE

_PADDING = 16  # vocab rows past the tokenizer's, as real checkpoints pad their embeddings

# --- the corpus ------------------------------------------------------------------------------

_SUBJECTS = ("the model", "a server", "the cache", "this request", "the user", "a token",
             "the scheduler", "our team", "the river", "a small cat", "the old library",
             "every student", "my neighbour", "the compiler", "a careful reader", "the engine")
_VERBS = ("reads", "writes", "finds", "keeps", "moves", "returns", "builds", "checks", "sends",
          "loses", "carries", "explains", "counts", "opens", "remembers", "prints")
_OBJECTS = ("the answer", "a long list", "three numbers", "the first line", "a quiet room",
            "the red box", "its own state", "the last message", "a bright idea", "the door",
            "every record", "the weather report", "a second chance", "the shared prefix")
_TAILS = ("before noon", "after the storm", "in the morning", "without a sound", "with care",
          "for the second time", "at the end of the day", "on page 12", "again and again")
_NAMES = ("count", "total", "items", "value", "index", "result", "buffer", "offset", "name",
          "text", "cache", "tokens", "state", "city", "query", "limit")
_WORLD = ("café", "naïve", "déjà vu", "Größe", "Straße", "niño", "Ærø", "日本語", "中文字符",
          "東京", "한국어", "Привет", "Ελληνικά", "😀", "🚀", "✓", "→", "€", "…", "½")


_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "br", "ch", "cl", "cr", "dr", "fl", "gr", "pl", "pr", "sh", "st", "str", "th", "tr")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "ou", "oo", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "sh", "ing", "ed")


def _lexicon(rng: random.Random, size: int = 5000) -> list[str]:
    """Pronounceable made-up words, so BPE has thousands of subwords to learn."""
    words = {"".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                     for _ in range(rng.choice((1, 1, 2, 2, 3)))) for _ in range(size)}
    return sorted(words)


def _sentence(rng: random.Random, lexicon: list[str] | None = None) -> str:
    if lexicon is None or rng.random() < 0.3:
        s = (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
             f"{rng.choice(_TAILS)}")
    else:  # Zipf-like: early words of the lexicon are far more frequent
        s = " ".join(lexicon[int(len(lexicon) * rng.random() ** 3)]
                     for _ in range(rng.randint(3, 12)))
    s += rng.choice(".......!?,;")
    return s[0].upper() + s[1:]


def _number(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return str(rng.randrange(10 ** rng.randint(1, 7)))
    if kind == 1:
        return f"{rng.uniform(-1000, 1000):.{rng.randint(1, 4)}f}"
    if kind == 2:
        return f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return f"{rng.randint(0, 23)}:{rng.randint(0, 59):02d}"


def _code(rng: random.Random) -> str:
    a, b, c = rng.sample(_NAMES, 3)
    return (f"def {a}_{b}({b}, {c}={_number(rng)}):\n    if {b} > {c}:\n"
            f"        return [{c} for {c} in range({b})]\n    return {{'{a}': {b} + {c}}}\n")


def _json(rng: random.Random) -> str:
    keys = rng.sample(_NAMES, rng.randint(1, 4))
    obj = {k: rng.choice([_number(rng), rng.choice(_OBJECTS), rng.random() < 0.5, None])
           for k in keys}
    if rng.random() < 0.5:
        return json.dumps({"name": f"get_{keys[0]}", "arguments": obj}, ensure_ascii=False)
    return json.dumps(obj, indent=rng.choice([None, 2]), ensure_ascii=False)


def corpus(lines: int = 8000) -> list[str]:
    """Deterministic training text: English-like sentences, numbers, code, JSON, a little
    non-Latin script and emoji, chat-like exchanges."""
    rng = random.Random(20250601)
    lexicon = _lexicon(rng)
    kinds = [
        lambda: " ".join(_sentence(rng, lexicon) for _ in range(rng.randint(1, 4))),
        lambda: " ".join(_sentence(rng, lexicon) for _ in range(rng.randint(1, 4))),
        lambda: " ".join(_number(rng) for _ in range(rng.randint(2, 8))),
        lambda: _code(rng),
        lambda: _json(rng),
        lambda: f"{_sentence(rng)} {' '.join(rng.sample(_WORLD, 3))} {_sentence(rng)}",
        lambda: f"user\nWhat does {rng.choice(_SUBJECTS)} do?\nassistant\n{_sentence(rng)}\n",
    ]
    return [rng.choice(kinds)() for _ in range(lines)]


@lru_cache(maxsize=4)
def train_tokenizer(bpe_size: int = 4096 - _PADDING - len(ADDED)) -> str:
    """tokenizer.json text: byte-level BPE with `bpe_size` tokens, then the Qwen-style added
    tokens after them (ids bpe_size...): three special, the tags not (decode keeps them)."""
    return train_bpe(corpus(), bpe_size)


# --- the model -------------------------------------------------------------------------------

def tiny_config(family: str = "qwen3_next", moe: bool = False, *, bos: int | None = None,
                eos: tuple[int, ...] = ()) -> ModelConfig:
    """The TARGETS.md shape; with `moe`, every layer's MLP is 8 experts (top 2) of 128 plus a
    shared expert of 256."""
    experts: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=128,
                                   shared_expert_intermediate_size=256) if moe else {}
    return ModelConfig(
        family=family, vocab_size=4096, hidden_size=256, num_hidden_layers=8,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25,
        rope_theta=10_000_000.0, rms_norm_eps=1e-6, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, intermediate_size=768, mtp_num_hidden_layers=1,
        max_position_embeddings=65536, bos_token_id=bos, eos_token_ids=eos, **experts)


def preset_config(preset: str, family: str = "qwen3_next", moe: bool = False,
                  **config_overrides: Any) -> ModelConfig:
    """The shape of `preset` (a key of PRESETS), with `config_overrides` over it."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}")
    return dataclasses.replace(tiny_config(family, moe),
                               **{**PRESETS[preset].overrides, **config_overrides})


def random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Float32 weights for one checkpoint tensor, seeded by (seed, name) so that a tensor does
    not change when others are added. Scales: zero-centred norms (scaled by 1 + w) near 0, the
    GDN output norm near 1, decay parameters spread over slow and fast heads, matrices
    N(0, 1/fan_in)."""
    # torch's CPU generator keeps only 32 bits of a seed: hash seed and name into 32 bits
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))
    if name.endswith(".A_log"):  # per-head decay rate A in [0.1, 4]
        return torch.empty(shape).uniform_(0.1, 4.0, generator=g).log()
    if name.endswith(".dt_bias"):
        return torch.empty(shape).uniform_(-2.0, 1.0, generator=g)
    noise = torch.randn(shape, generator=g)
    if name.endswith(".linear_attn.norm.weight"):  # a plain RMSNorm weight (identity: 1)
        return 1.0 + 0.1 * noise
    if name.endswith("norm.weight"):  # Qwen3-Next's (1 + w) RMSNorm (identity: 0)
        return 0.1 * noise
    if name == "model.embed_tokens.weight":
        return noise
    return noise * shape[-1] ** -0.5  # conv1d: fan_in is the kernel width


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Names packed in order into shards of at most max_shard_bytes (a bigger tensor gets a
    shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_weights(out: Path, tensors: dict[str, torch.Tensor],
                   max_shard_bytes: int | None) -> None:
    if max_shard_bytes is None:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return
    shards = _shards(tensors, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out / "model.safetensors.index.json", index)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_tiny(out_dir: str | Path, *, family: str = "qwen3_next", moe: bool = False,
              seed: int = 0, dtype: torch.dtype | str = torch.bfloat16,
              max_shard_bytes: int | None = None, preset: str = "tiny",
              text_head: bool = False, **config_overrides: Any) -> Path:
    """Write a random model directory of the shape `preset` (a key of PRESETS; the default
    is the tiny shape) at `out_dir` (absent or empty) and return it.

    `family` is "qwen3_next" or "qwen3_5" (text-only config); `config_overrides` replace
    ModelConfig fields of the preset's shape (e.g. `mtp_num_hidden_layers=0`). `dtype` (a
    torch dtype or its name, e.g. "float32") is the stored weights'. With `max_shard_bytes`
    the weights are sharded with a model.safetensors.index.json. With `text_head`, the LM
    head's rows past the tokenizer's ids are zero: their logits (0) lose to the largest of
    the real rows' (~N(0, 1) each), so greedy decoding writes only tokens the tokenizer
    decodes, as a trained model does, and a client sees text (anchor-1b's head has 151,936
    rows for 4,080 tokens: otherwise nearly every token it writes decodes to nothing)."""
    weight_dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if weight_dtype not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be a floating point torch dtype, got {dtype!r}")
    tokenizer_json = train_tokenizer()
    ids = added_ids(tokenizer_json)
    endoftext, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    config = preset_config(preset, family, moe, **{"bos_token_id": endoftext,
                                                   "eos_token_ids": (im_end,),
                                                   **config_overrides})
    if max(ids.values()) >= config.vocab_size:
        raise ValueError(f"vocab_size {config.vocab_size} < the tokenizer's "
                         f"{max(ids.values()) + 1}")
    config_json = {**config.to_dict(), "dtype": str(weight_dtype).removeprefix("torch."),
                   "initializer_range": 0.02}
    ModelConfig.from_dict(config_json)  # overrides that break the config fail here, early
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config_json)
    _write_json(out / "generation_config.json", {
        "bos_token_id": endoftext, "eos_token_id": [im_end, endoftext],
        "pad_token_id": endoftext, "do_sample": True, "temperature": 0.6, "top_k": 20,
        "top_p": 0.95})

    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(
        tokenizer_json, QWEN3_STYLE_TEMPLATE, config.max_position_embeddings))

    tensors = {name: random_tensor(name, shape, seed).to(weight_dtype)
               for name, shape in expected_tensors(config).items()}
    if text_head:
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        tensors[head][max(ids.values()) + 1:] = 0
    _write_weights(out, tensors, max_shard_bytes)
    return out
