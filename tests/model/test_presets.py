"""`ninfer make-tiny --preset`: the anchor-1b preset is the GPU benchmarks' shape, and the GPU
bench writes its model from the same preset. The weights are not written (0.75B random
floats): the tensors are stubbed, the config and tokenizer files are real."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ninfer import cli
from ninfer.bench import gpu_engine
from ninfer.model import tiny
from ninfer.model.config import expected_tensors


@pytest.fixture
def no_weights(monkeypatch):
    """make_tiny without its weights: every tensor a scalar, nothing written."""
    monkeypatch.setattr(tiny, "random_tensor", lambda name, shape, seed: torch.zeros(()))
    monkeypatch.setattr(tiny, "_write_weights", lambda out, tensors, max_shard_bytes: None)


def test_the_anchor_preset_is_the_anchor_shape():
    config = tiny.preset_config("anchor-1b")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (1024, 24, 151_936)
    assert config.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 6
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 256)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (8, 16)
    assert config.intermediate_size == 3072 and not config.tie_word_embeddings
    shapes = expected_tensors(config)
    main = sum(math.prod(s) for name, s in shapes.items() if not name.startswith("mtp."))
    assert 0.72e9 < main < 0.74e9   # "0.73B"
    assert tiny.preset_config("tiny") == tiny.tiny_config()


def test_an_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="anchor-1b"):
        tiny.preset_config("anchor-2b")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["make-tiny", "--preset", "anchor-2b", "out"])


def test_make_tiny_writes_the_preset_and_the_gpu_bench_uses_it(tmp_path, monkeypatch,
                                                                no_weights, capsys):
    assert cli.main(["make-tiny", "--preset", "anchor-1b", str(tmp_path / "made")]) == 0
    made = json.loads((tmp_path / "made" / "config.json").read_text())
    assert made["hidden_size"] == 1024 and made["vocab_size"] == 151_936
    assert made["dtype"] == "bfloat16" and made["mtp_num_hidden_layers"] == 1
    assert made["eos_token_id"] is not None   # the tokenizer's, as the tiny model's
    monkeypatch.setattr(gpu_engine, "ANCHOR_DIR", tmp_path / "bench")
    written = gpu_engine.anchor_dir()
    assert json.loads((written / "config.json").read_text()) == made


def test_the_help_lists_the_presets(capsys):
    with pytest.raises(SystemExit):
        cli.main(["make-tiny", "--help"])
    out = capsys.readouterr().out
    assert "anchor-1b: the GPU benchmarks' model" in out and "tiny: the default shape" in out


def test_a_text_head_writes_only_tokens_the_tokenizer_decodes(tmp_path):
    """--text-head: the LM head's rows past the tokenizer's ids are zero (here 4,080 ids of a
    head of 8,192 rows); the rows of real tokens keep their random weights."""
    from safetensors.torch import load_file

    from ninfer.model.tokenizer import Tokenizer
    out = tiny.make_tiny(tmp_path / "m", vocab_size=8192, text_head=True, dtype="float32")
    head = load_file(out / "model.safetensors")["lm_head.weight"]
    tokens = Tokenizer.from_dir(out).vocab_size
    assert head.shape[0] == 8192 and tokens < 8192
    assert not head[tokens:].any() and head[:tokens].abs().sum(dim=1).min() > 0
    hidden = torch.randn(64, head.shape[1])
    assert (hidden @ head.T).argmax(dim=1).max() < tokens   # greedy: a real token each time
