"""Load a model's files: a Hugging Face directory (one model.safetensors, or shards listed in
model.safetensors.index.json) or a `.ninfer` file, into config, tensors, tokenizer and template.

Contract: everything is checked before anything is returned, so a caller never holds a
half-loaded model. Refused with `LoadError` (the message names the file and the field or the
tensors): an unreadable or unsupported config.json (wrapping ConfigError), tensors missing,
unexpected or mis-shaped against `expected_tensors(config)` or of a dtype other than
F64/F32/F16/BF16, a shard the index lists but the directory lacks, a tokenizer whose ids do not
fit `vocab_size`, a chat template that does not compile, a truncated or corrupted `.ninfer`.
Tensors keep the dtype they are stored in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .config import ConfigError, ModelConfig, expected_tensors
from .fileformat import DTYPES, LoadError, read_ninfer
from .template import ChatTemplate, ChatTemplateError, special_token_variables
from .tokenizer import Tokenizer

__all__ = ["LoadError", "LoadedFiles", "load_files"]

_SHOWN = 4  # names listed per kind of tensor problem; the count says how many in all
_WRAPPERS = ("qwen3_5", "qwen3_5_moe")  # multimodal configs: text tensors under language_model


@dataclass(frozen=True)
class LoadedFiles:
    """A checked model: `source` is the directory or file it came from; `generation` is
    generation_config.json ({} when absent)."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    template: ChatTemplate
    source: str
    generation: dict = field(default_factory=dict)


def load_files(path: str | Path, *, verify: bool = True) -> LoadedFiles:
    """Load and check an HF model directory or a `.ninfer` file (`verify`: check the
    `.ninfer` payload checksum, which reads every byte)."""
    path = Path(path)
    if path.is_dir():
        return _load_hf_dir(path)
    if path.is_file():
        return _load_ninfer(path, verify)
    raise LoadError(f"{path}: no such file or directory")


def _read_json(file: Path, required: bool = True) -> dict:
    if not file.exists():
        if required:
            raise LoadError(f"{file}: missing")
        return {}
    try:
        d = json.loads(file.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{file}: not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise LoadError(f"{file}: not a JSON object")
    return d


def _config(d: Any, source: str) -> ModelConfig:
    try:
        return ModelConfig.from_dict(d, source=source)
    except ConfigError as e:
        raise LoadError(str(e)) from e


def _tokenizer(text: str, tokenizer_config: dict, source: str) -> Tokenizer:
    try:
        return Tokenizer(text, tokenizer_config, source=source)
    except ValueError as e:
        raise LoadError(str(e)) from e


def _template(make: Any) -> ChatTemplate:
    try:
        return make()
    except ChatTemplateError as e:
        raise LoadError(str(e)) from e


def _listing(what: str, items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return f"{what} ({len(items)}): {', '.join(items[:_SHOWN])}{more}"


def _check_tensors(config: ModelConfig, found: dict[str, tuple[tuple[int, ...], str]],
                   source: str) -> None:
    """`found`: name -> (shape, dtype name). One LoadError listing every kind of problem."""
    expected = expected_tensors(config)
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    shaped = sorted(f"{n} {list(found[n][0])} (config wants {list(s)})"
                    for n, s in expected.items() if n in found and tuple(found[n][0]) != s)
    typed = sorted(f"{n} {d}" for n, (_, d) in found.items() if d not in DTYPES)
    problems = [_listing(what, items) for what, items in (
        ("missing tensors", missing), ("unexpected tensors", extra),
        ("mis-shaped tensors", shaped), ("tensors of an unsupported dtype", typed)) if items]
    if problems:
        raise LoadError(f"{source}: " + "; ".join(problems))


def _check_vocab(config: ModelConfig, tokenizer: Tokenizer, config_source: str) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise LoadError(f"{tokenizer.source}: the vocabulary has ids up to "
                        f"{tokenizer.vocab_size - 1}, beyond {config_source}'s vocab_size "
                        f"{config.vocab_size}")
    ids = [*config.eos_token_ids, *([] if config.bos_token_id is None else [config.bos_token_id])]
    if any(not 0 <= i < config.vocab_size for i in ids):
        raise LoadError(f"{config_source}: bos/eos token ids {ids} are not all below "
                        f"vocab_size {config.vocab_size}")


def _text_name(name: str, wrapper: bool) -> str | None:
    """A checkpoint tensor's name as `expected_tensors` spells it; None: not the text model."""
    if not wrapper:
        return name
    if name.startswith(("model.visual.", "visual.")):
        return None
    return name.replace("model.language_model.", "model.", 1)


def _shard_files(path: Path) -> dict[str, list[str]]:
    """Safetensors files -> the names the index assigns them ([] when there is no index)."""
    index_file = path / "model.safetensors.index.json"
    if not index_file.exists():
        if not (path / "model.safetensors").exists():
            raise LoadError(f"{path}: neither model.safetensors nor "
                            f"model.safetensors.index.json")
        return {"model.safetensors": []}
    weight_map = _read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise LoadError(f"{index_file}: field 'weight_map' is missing or empty")
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        # a shard is a file beside the index, never a path elsewhere
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", "..", "."):
            raise LoadError(f"{index_file}: field 'weight_map': tensor {name!r} names shard "
                            f"{shard!r}, not a file name")
        shards.setdefault(shard, []).append(name)
    absent = sorted(s for s in shards if not (path / s).is_file())
    if absent:
        raise LoadError(f"{index_file}: {_listing('shards listed but absent', absent)}")
    return shards


def _load_hf_dir(path: Path) -> LoadedFiles:
    config_file = path / "config.json"
    raw_config = _read_json(config_file)
    config = _config(raw_config, str(config_file))
    wrapper = raw_config.get("model_type") in _WRAPPERS

    tok_file = path / "tokenizer.json"
    if not tok_file.exists():
        raise LoadError(f"{tok_file}: missing")
    tokenizer_config = _read_json(path / "tokenizer_config.json", required=False)
    tokenizer = _tokenizer(tok_file.read_text("utf-8"), tokenizer_config, str(tok_file))
    template = _template(lambda: ChatTemplate.from_dir(path))
    generation = _read_json(path / "generation_config.json", required=False)
    _check_vocab(config, tokenizer, str(config_file))

    # First pass: headers only, so nothing is read from a checkpoint that will be refused.
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    where: dict[str, tuple[str, str]] = {}  # text name -> (shard, name in the file)
    for shard, listed in _shard_files(path).items():
        try:
            with safe_open(path / shard, "pt") as f:
                names = set(f.keys())
                for name in names:
                    text = _text_name(name, wrapper)
                    if text is not None:
                        s = f.get_slice(name)
                        found[text] = (tuple(s.get_shape()), s.get_dtype())
                        where[text] = (shard, name)
        except Exception as e:  # safetensors raises its own error type, or OSError
            raise LoadError(f"{path / shard}: not a readable safetensors file: {e}") from e
        lost = sorted(set(listed) - names)
        if lost:
            raise LoadError(f"{path / 'model.safetensors.index.json'}: "
                            f"{_listing(f'tensors listed in {shard} but not in it', lost)}")
    _check_tensors(config, found, str(path))

    tensors = {}
    for shard in sorted({s for s, _ in where.values()}):
        with safe_open(path / shard, "pt") as f:
            for text, (s, name) in where.items():
                if s == shard:
                    tensors[text] = f.get_tensor(name)
    tensors = {name: tensors[name] for name in expected_tensors(config)}  # canonical order
    return LoadedFiles(config=config, tensors=tensors, tokenizer=tokenizer, template=template,
                       source=str(path), generation=generation)


def _load_ninfer(path: Path, verify: bool) -> LoadedFiles:
    nf = read_ninfer(path, verify=verify)
    h = nf.header
    config = _config(h["config"], f"{path}: header field 'config'")
    tokenizer = _tokenizer(h["tokenizer_json"], h["tokenizer_config"],
                           f"{path}: header field 'tokenizer_json'")
    template = _template(lambda: ChatTemplate(
        h["chat_template"], special_tokens=special_token_variables(h["tokenizer_config"]),
        source=f"{path}: header field 'chat_template'"))
    _check_vocab(config, tokenizer, f"{path}: header field 'config'")
    found = {name: (tuple(t.shape), h["tensors"][name]["dtype"])
             for name, t in nf.tensors.items()}
    _check_tensors(config, found, str(path))
    return LoadedFiles(config=config, tensors=dict(nf.tensors), tokenizer=tokenizer,
                       template=template, source=str(path), generation=h["generation_config"])
