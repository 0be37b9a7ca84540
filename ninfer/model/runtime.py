"""From files to a running model: load and check, build the torch model, size the pools.

`open_model(path)` takes an HF directory or a `.ninfer` file; with no path it uses the
embedded default, the tiny model, generated deterministically on first use into the cache
directory ($NINFER_HOME, else ~/.cache/ninfer), so a fresh machine needs no download.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .hybrid import HybridModel, load_weights
from .loader import LoadedFiles, load_files
from .pools import BlockPool, SlotPool
from .template import ChatTemplate
from .tokenizer import Tokenizer
from .torch_model import TorchModel

DEFAULT_MODEL = "tiny-qwen3-next-v1"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def cache_dir() -> Path:
    return Path(os.environ.get("NINFER_HOME") or Path.home() / ".cache" / "ninfer")


def default_model_dir() -> Path:
    """The embedded default model's directory, generated (once, atomically) if absent."""
    target = cache_dir() / DEFAULT_MODEL
    if (target / "config.json").exists():
        return target
    from .tiny import make_tiny
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        make_tiny(staging, seed=0, dtype="float32")
        try:
            staging.rename(target)
        except OSError:  # another process made it first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def identity(files: LoadedFiles) -> str:
    """Model identity for checkpoints: family, config and a digest of every tensor's name,
    shape, dtype and first and last bytes (cheap, and changes with any retrained weight)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(sorted(files.config.to_dict().items())).encode())
    for name in sorted(files.tensors):
        t = files.tensors[name]
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        raw = t.detach().contiguous().view(-1).view(torch.uint8) if t.numel() else t
        h.update(raw[:64].numpy().tobytes() + raw[-64:].numpy().tobytes())
    return f"{files.config.family}-{h.hexdigest()}"


@dataclass(frozen=True)
class OpenModel:
    model: TorchModel
    blocks: BlockPool
    slots: SlotPool
    tokenizer: Tokenizer
    template: ChatTemplate
    files: LoadedFiles
    name: str


def open_model(path: str | Path | None = None, *, dtype: str = "float32", device: str = "cpu",
               kv_capacity: int = 65_536, block_size: int = 16, num_slots: int = 64,
               mtp: bool = True) -> OpenModel:
    """Load, check and build. `kv_capacity` is the number of KV positions the block pool
    holds (attention and MTP KV draw from it); `num_slots` the recurrent-state snapshots."""
    source = Path(path) if path is not None else default_model_dir()
    files = load_files(source)
    net = HybridModel(files.config, mtp=mtp)
    load_weights(net, files.tensors)
    net = net.to(device=device, dtype=DTYPES[dtype])
    num_blocks = -(-kv_capacity // block_size)
    model = TorchModel(net, num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                       identity=identity(files), device=device)
    name = DEFAULT_MODEL if path is None else source.name.removesuffix(".ninfer")
    return OpenModel(model, BlockPool(num_blocks, block_size), SlotPool(num_slots),
                     files.tokenizer, files.template, files, name)
