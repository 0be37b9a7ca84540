"""From files to a running model: load and check, build the torch model, size the pools.

`open_model(path)` takes an HF directory or a `.ninfer` file; with no path it uses the
default model (`default_model`): the small model trained on the Python standard library,
shipped in the package (ninfer/data/), so a fresh machine needs no download; or what
$NINFER_MODEL names: a path, or `tiny-qwen3-next-v1`, the random tiny model that tests and
benchmarks use (deterministic and fast), generated on first use into the cache directory
($NINFER_HOME, else ~/.cache/ninfer).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..flags import FLAGS
from .config import ModelConfig
from .hybrid import loaded_model
from .loader import LoadedFiles, load_files
from .pools import BlockPool, SlotPool
from .shard import Collectives, Shard, ShardError, build_shard, check_shardable
from .template import ChatTemplate
from .tensor_parallel import ShardedModel
from .tokenizer import Tokenizer
from .torch_model import TorchModel

log = logging.getLogger("ninfer.model")

if TYPE_CHECKING:
    from .ranks import Ranks

RANDOM_MODEL = "tiny-qwen3-next-v1"      # random weights, made on first use
DEFAULT_MODEL = "ninfer-stdlib-8m"       # trained (`ninfer train`), shipped in the package
DEFAULT_FILE = Path(__file__).resolve().parent.parent / "data" / f"{DEFAULT_MODEL}.ninfer"
# the shipped file's sha256 (bench/results/train-h100-v12w.json: its training report)
DEFAULT_SHA256 = "62a527f2070db0e1b22c18a8bb6b3387f05bdafaecb1659452d89f34fa6e3a28"
MODEL_ENV = "NINFER_MODEL"
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def cache_dir() -> Path:
    return Path(os.environ.get("NINFER_HOME") or Path.home() / ".cache" / "ninfer")


def default_model() -> tuple[Path, str]:
    """The model used when none is named, and its name: $NINFER_MODEL's (a path, or
    RANDOM_MODEL for the random tiny model), else the trained default in the package."""
    chosen = os.environ.get(MODEL_ENV)
    if chosen == RANDOM_MODEL:
        return random_model_dir(), RANDOM_MODEL
    if chosen:
        return Path(chosen), Path(chosen).name.removesuffix(".ninfer")
    return DEFAULT_FILE, DEFAULT_MODEL


def benchmark_on_the_random_model() -> None:
    """Benchmarks measure the random tiny model (the shape their baselines and TARGETS.md's
    peers were measured on) unless $NINFER_MODEL or their own argument names another."""
    os.environ.setdefault(MODEL_ENV, RANDOM_MODEL)


def random_model_dir() -> Path:
    """The random tiny model's directory, generated (once, atomically) if absent."""
    target = cache_dir() / RANDOM_MODEL
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


def model_config(path: str | Path | None) -> ModelConfig:
    """The config of a model directory or file, without its weights where it can (an HF
    directory's config.json)."""
    source = Path(path) if path is not None else default_model()[0]
    if source.is_dir():
        import json
        return ModelConfig.from_dict(json.loads((source / "config.json").read_text()),
                                     str(source / "config.json"))
    return load_files(source, verify=False).config


def shard_refusal(path: str | Path | None, world: int) -> str | None:
    """Why the model at `path` cannot be split over `world` ranks (None: it can)."""
    try:
        check_shardable(model_config(path), world)
    except ShardError as exc:
        return str(exc)
    return None


def launch_ranks(world: int, *, timeout: float, threads: int, device: str) -> Ranks:
    """Rank 0 of a tensor-parallel run: the followers spawned and joined (`ranks.launch`)."""
    from .ranks import launch
    return launch(world, timeout=timeout, threads=threads, device=device)


@dataclass(frozen=True)
class OpenModel:
    model: TorchModel | ShardedModel
    blocks: BlockPool
    slots: SlotPool
    tokenizer: Tokenizer
    template: ChatTemplate
    files: LoadedFiles
    name: str


def tp_identity(base: str, world: int) -> str:
    """The identity of a model sharded over `world` ranks: its parts are per rank, so a
    checkpoint of one degree is not another's (a restart with another degree loses them)."""
    return base if world == 1 else f"{base}-tp{world}"


def open_model(path: str | Path | None = None, *, dtype: str = "float32", device: str = "cpu",
               kv_capacity: int | None = 65_536, block_size: int = 16, num_slots: int = 64,
               mtp: bool = True, ranks: Ranks | None = None) -> OpenModel:
    """Load, check and build. `kv_capacity` is the number of KV positions the block pool
    holds (attention and MTP KV draw from it; None: sized from the GPU's free memory once
    the weights are on it, `ninfer.model.memory`, or DEFAULT_KV_CAPACITY off a single
    GPU); `num_slots` the recurrent-state snapshots.
    `ranks` (rank 0 of `ranks.launch`): the model sharded over its ranks, every follower
    opening its shard alike (`shard_model`); the model is then a `ShardedModel`."""
    source, default_name = (Path(path), None) if path is not None else default_model()
    files = load_files(source)
    if kv_capacity is None and (ranks is not None and ranks.world > 1
                                or torch.device(device).type != "cuda"):
        kv_capacity = DEFAULT_KV_CAPACITY   # (every rank must hold the same pool)
    options = dict(path=str(source), dtype=dtype, device=device,
                   kv_capacity=kv_capacity, block_size=block_size, num_slots=num_slots,
                   mtp=mtp)
    model: TorchModel | ShardedModel
    if ranks is None or ranks.world == 1:
        model = shard_model(None, files=files, **options)
    else:
        model = ranks.open(SHARD_FACTORY, options,
                           local=lambda: shard_model(ranks, files=files, **options))
    # the pool's blocks (the scratch block past them), as sized where the model was built
    num_blocks = (model.local if isinstance(model, ShardedModel) else model).scratch_block
    name = default_name or source.name.removesuffix(".ninfer")
    return OpenModel(model, BlockPool(num_blocks, block_size), SlotPool(num_slots),
                     files.tokenizer, files.template, files, name)


def watch_compiles(device: str):
    """On a GPU, a `kernels.compiles.CompileWatch` installed as Triton's cache hook: the
    kernel specialisations met before its `ready()` are counted, each one after it logged
    (None off a GPU, or with a Triton that has no such hook)."""
    if torch.device(device).type != "cuda":
        return None
    from kernels.compiles import watch
    return watch()


SHARD_FACTORY = "ninfer.model.runtime:shard_model"
DEFAULT_KV_CAPACITY = 131_072   # KV positions where the pool is not sized from a GPU


def shard_model(ranks: Ranks | None, *, path: str | None, dtype: str, device: str,
                kv_capacity: int | None, block_size: int, num_slots: int, mtp: bool,
                files: LoadedFiles | None = None) -> TorchModel:
    """This rank's TorchModel: the whole model without `ranks` (or with one rank), else
    its shard (every rank of a run calls this alike)."""
    if files is None:
        files = load_files(Path(path) if path is not None else default_model()[0])
    world = ranks.world if ranks is not None else 1
    check_shardable(files.config, world)
    if world > 1 and torch.device(device).type == "cuda":
        device = f"cuda:{ranks.rank}"  # one GPU per rank, in rank order
        FLAGS.skinny_rows = 0  # the fused residual GEMMs would sum the residual N times
    net = loaded_model(files.config, files.tensors, mtp=mtp, device=device,
                       dtype=DTYPES[dtype])
    if kv_capacity is None:  # one GPU: from its memory free now, the weights on it
        from .memory import kv_capacity_for
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        kv_capacity = kv_capacity_for(free, files.config, mtp=net.has_mtp,
                                      dtype_bytes=DTYPES[dtype].itemsize,
                                      num_slots=num_slots, block_size=block_size)
        log.info("KV pool: %s positions (%.1f GiB free on %s with the weights loaded)",
                 f"{kv_capacity:,}", free / 2**30, device)
    num_blocks = -(-kv_capacity // block_size)
    ident = tp_identity(identity(files), world)
    if ranks is None or world == 1:
        return TorchModel(net, num_blocks=num_blocks, block_size=block_size,
                          num_slots=num_slots, identity=ident, device=device)
    shard = build_shard(net, Shard(ranks.rank, world), Collectives(ranks.wire.compute, world))
    return TorchModel(shard, num_blocks=num_blocks, block_size=block_size,
                      num_slots=num_slots, identity=ident, device=device, graphs=False)
