"""Model files: the tiny-model maker, the loader (HF directories, sharded or not, and .ninfer
files) and the refusals of bad input, each naming the file and the thing at fault."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ninfer.model import tiny
from ninfer.model.config import ModelConfig, expected_tensors
from ninfer.model.fileformat import MAGIC, convert, read_ninfer
from ninfer.model.loader import LoadError, load_files
from ninfer.model.tiny import make_tiny

SAMPLE = "<|im_start|>user\nHello, café 😀 {\"a\": 1}<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.fixture(scope="module")
def tiny_ninfer(tiny_dir, tmp_path_factory):
    return convert(tiny_dir, tmp_path_factory.mktemp("conv") / "tiny.ninfer", progress=False)


@pytest.fixture
def copy(tiny_dir, tmp_path):
    return shutil.copytree(tiny_dir, tmp_path / "copy")


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_model(a, b):
    assert a.config == b.config
    assert list(a.tensors) == list(b.tensors) == list(expected_tensors(a.config))
    for name, t in a.tensors.items():
        assert t.dtype == b.tensors[name].dtype and _bits(t) == _bits(b.tensors[name]), name
    assert a.tokenizer.encode(SAMPLE) == b.tokenizer.encode(SAMPLE)
    assert a.tokenizer.special == b.tokenizer.special
    messages = [{"role": "user", "content": "hi"}]
    assert a.template.render(messages, add_generation_prompt=True) == b.template.render(
        messages, add_generation_prompt=True)
    assert a.generation == b.generation


def test_make_tiny_is_deterministic(tmp_path):
    a = make_tiny(tmp_path / "a", seed=3)
    tiny.train_tokenizer.cache_clear()  # retrain: the BPE trainer must not vary either
    b = make_tiny(tmp_path / "b", seed=3)
    c = make_tiny(tmp_path / "c", seed=4)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    # another seed changes the weights only
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    with pytest.raises(FileExistsError):
        make_tiny(a)


def test_tiny_shape_and_scales(tiny_dir):
    config = ModelConfig.from_dict(json.loads((tiny_dir / "config.json").read_text()))
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (256, 8, 4096)
    assert config.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert config.mtp_num_hidden_layers == 1
    t = load_files(tiny_dir).tensors
    assert t["model.layers.0.linear_attn.norm.weight"].float().mean().item() == pytest.approx(
        1.0, abs=0.05)  # a plain RMSNorm weight sits near 1
    assert t["model.norm.weight"].float().abs().mean().item() < 0.15  # a (1 + w) one near 0
    decay = t["model.layers.0.linear_attn.A_log"].float().exp()
    assert decay.min() >= 0.09 and decay.max() <= 4.1 and decay.std() > 0
    n_params = sum(x.numel() for x in t.values())
    assert round(n_params / 1e6, 1) == 9.5  # TARGETS.md's count (the MTP layer included)


@pytest.mark.parametrize("kwargs", [{"moe": True}, {"family": "qwen3_5"},
                                    {"mtp_num_hidden_layers": 0}])
def test_variants_load_and_convert(tmp_path, kwargs):
    loaded = load_files(make_tiny(tmp_path / "m", **kwargs))
    assert set(loaded.tensors) == set(expected_tensors(loaded.config))
    assert_same_model(loaded, load_files(convert(tmp_path / "m", tmp_path / "m.ninfer",
                                                 progress=False)))


def test_hf_dir_and_ninfer_load_the_same(tiny_dir, tiny_ninfer):
    hf, nf = load_files(tiny_dir), load_files(tiny_ninfer)
    assert_same_model(hf, nf)
    assert nf.source == str(tiny_ninfer)
    header = read_ninfer(tiny_ninfer).header
    assert header["format_version"] == 1 and "chat_template" not in header["tokenizer_config"]


def test_sharded_round_trip(tiny_dir, tmp_path):
    sharded = make_tiny(tmp_path / "sharded", max_shard_bytes=2 << 20)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 5 and not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert_same_model(load_files(sharded), load_files(tiny_dir))
    assert_same_model(load_files(convert(sharded, tmp_path / "s.ninfer", progress=False)),
                      load_files(tiny_dir))


def _edit_json(path, edit):
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def _edit_tensors(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _refused(path, *fragments):
    with pytest.raises(LoadError) as e:
        load_files(path)
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)
    return str(e.value)


def test_refuses_bad_config(copy):
    _edit_json(copy / "config.json", lambda d: d.update(model_type="llama"))
    _refused(copy, "config.json", "model_type", "llama")
    _edit_json(copy / "config.json", lambda d: (d.update(model_type="qwen3_next"),
                                                d.pop("hidden_size")))
    _refused(copy, "config.json", "hidden_size", "missing")
    (copy / "config.json").write_text("{not json")
    _refused(copy, "config.json", "not valid JSON")


def test_refuses_missing_extra_and_misshaped_tensors(copy):
    weights = copy / "model.safetensors"
    _edit_tensors(weights, lambda t: t.pop("model.layers.3.self_attn.k_proj.weight"))
    _refused(copy, str(copy), "missing tensors (1)", "model.layers.3.self_attn.k_proj.weight")
    _edit_tensors(weights, lambda t: t.update({
        "model.layers.3.self_attn.k_proj.weight": torch.zeros(64, 256),
        "model.layers.0.extra.weight": torch.zeros(2), "mtp.bias": torch.zeros(2),
        "model.norm.weight": torch.zeros(255)}))
    message = _refused(copy, "unexpected tensors (2): model.layers.0.extra.weight, mtp.bias",
                       "model.norm.weight [255] (config wants [256])")
    assert "missing tensors" not in message
    _edit_tensors(weights, lambda t: t.update({f"extra.{i}": torch.zeros(1) for i in range(9)}))
    _refused(copy, "unexpected tensors (11)", "and 7 more")


def test_refuses_unsupported_dtype(copy):
    _edit_tensors(copy / "model.safetensors", lambda t: t.update({
        "model.norm.weight": torch.zeros(256, dtype=torch.int32)}))
    _refused(copy, "unsupported dtype", "model.norm.weight I32")


def test_refuses_a_vocabulary_beyond_vocab_size(copy):
    _edit_json(copy / "config.json", lambda d: d.update(vocab_size=4000))
    _refused(copy, "tokenizer.json", "4079", "vocab_size 4000")


def test_refuses_bad_tokenizer_and_template(copy):
    _edit_json(copy / "tokenizer_config.json", lambda d: d.update(chat_template="{% if %}"))
    _refused(copy, "tokenizer_config.json", "chat template")
    (copy / "chat_template.jinja").write_text("{{ }}")
    _refused(copy, "chat_template.jinja")
    (copy / "tokenizer.json").unlink()
    _refused(copy, "tokenizer.json", "missing")


def test_refuses_broken_shards(tiny_dir, tmp_path):
    sharded = make_tiny(tmp_path / "s", max_shard_bytes=2 << 20)
    index_file = sharded / "model.safetensors.index.json"
    index = index_file.read_text()
    first = sorted(sharded.glob("model-*.safetensors"))[0].name
    _edit_json(index_file, lambda d: d["weight_map"].update({"model.ghost.weight": first}))
    _refused(sharded, "model.safetensors.index.json", "model.ghost.weight",
             f"listed in {first} but not in it")
    index_file.write_text(index)
    victim = sorted(sharded.glob("model-*.safetensors"))[2]
    victim.write_bytes(victim.read_bytes()[:-10])  # truncated inside its data
    _refused(sharded, victim.name, "not a readable safetensors file")
    victim.unlink()
    _refused(sharded, "model.safetensors.index.json", "shards listed but absent", victim.name)
    _refused(tmp_path / "nowhere", "no such file")


def _damaged(src, tmp_path, damage):
    data = bytearray(src.read_bytes())
    out = tmp_path / "bad.ninfer"
    out.write_bytes(bytes(damage(data)))
    return out


@pytest.mark.parametrize("damage, fragments", [
    (lambda d: d[:10], ["not a .ninfer file", "truncated (10 bytes)"]),
    (lambda d: b"PK\x03\x04" + d[4:], ["bad magic"]),
    (lambda d: d[:2000], ["header length", "runs past the end"]),
    (lambda d: d[:-1000], ["payload_bytes", "truncated"]),
    (lambda d: d[:-7] + bytes([d[-7] ^ 1]) + d[-6:], ["checksum mismatch", "payload_sha256"]),
])
def test_refuses_damaged_ninfer(tiny_ninfer, tmp_path, damage, fragments):
    bad = _damaged(tiny_ninfer, tmp_path, damage)
    _refused(bad, str(bad), *fragments)


def test_ninfer_header_problems(tiny_ninfer, tmp_path):
    def set_header(data, edit):
        n = int.from_bytes(data[8:16], "little")
        header = json.loads(data[16:16 + n])
        edit(header)
        raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
        assert len(raw) <= n
        return data[:16] + raw + b" " * (n - len(raw)) + data[16 + n:]

    def shift(h):
        h["tensors"]["model.norm.weight"]["offset"] = h["payload_bytes"]

    bad = _damaged(tiny_ninfer, tmp_path, lambda d: set_header(d, shift))
    _refused(bad, "'tensors'", "model.norm.weight", "outside the payload")
    bad = _damaged(tiny_ninfer, tmp_path, lambda d: set_header(
        d, lambda h: h.update(format_version=99)))
    _refused(bad, "format_version", "99")
    bad = _damaged(tiny_ninfer, tmp_path, lambda d: set_header(
        d, lambda h: h["config"].update(vocab_size=4000)))
    _refused(bad, "header field 'tokenizer_json'", "vocab_size 4000")
    # a flipped payload byte passes only when verification is off
    flipped = _damaged(tiny_ninfer, tmp_path, lambda d: d[:-7] + bytes([d[-7] ^ 1]) + d[-6:])
    assert load_files(flipped, verify=False).config.vocab_size == 4096
    assert read_ninfer(tiny_ninfer).header["payload_sha256"] != "0" * 64
    assert tiny_ninfer.read_bytes()[:8] == MAGIC


def test_convert_refuses_before_writing(copy, tmp_path):
    (copy / "model.safetensors").unlink()
    out = tmp_path / "out.ninfer"
    with pytest.raises(LoadError, match="model.safetensors"):
        convert(copy, out, progress=False)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_the_payload_is_a_safetensors_file(tiny_dir, tiny_ninfer):
    """Any safetensors reader takes the payload as it stands."""
    import struct

    from safetensors.torch import load

    raw = tiny_ninfer.read_bytes()
    (n,) = struct.unpack("<Q", raw[8:16])
    tensors = load(raw[16 + n:])
    expected = load_files(tiny_dir).tensors
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[k], expected[k]) for k in expected)
