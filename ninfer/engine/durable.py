"""Durable endpoints (`--persist-endpoints DIR`): published checkpoints written to disk, off
the engine thread, and restored at a restart so a conversation resumes with reuse.

One standard safetensors file per checkpoint, `<DIR>/<checkpoint id>.safetensors`, mode 0600
(its KV derives from users' prompts). The metadata names the format, the checkpoint, the
model identity and dtypes, the positions its parts cover, and the SHA-256 of its tensors'
bytes. A file that does not parse, whose checksum or identity does not match, or that
covers other positions than the journal's facts is refused with a reason (the engine then
emits `EndpointLost`) and deleted; it is never loaded.

The engine thread only copies the parts out of the pools (`Model.export_parts`, a device
copy) and enqueues them; a writer thread hashes and writes, in order with deletions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..lifecycle.facts import CheckpointFacts
from ..lifecycle.hashing import block_hashes, prefix_hash
from ..model.protocol import Model, ModelLost
from .runner import Held, Runner

FORMAT = "ninfer-checkpoint-v1"
JSON_PREFIX = "json:"  # a part that is not a tensor (SimModel's integers), stored as UTF-8
log = logging.getLogger("ninfer.durable")


class FileRefused(Exception):
    """A checkpoint file that must not be loaded; the message says why."""


def _file_name(checkpoint_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in checkpoint_id)
    digest = hashlib.blake2b(checkpoint_id.encode(), digest_size=4).hexdigest()
    return f"{safe}-{digest}.safetensors"  # the digest keeps distinct ids distinct


def _encode(parts: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in parts.items():
        if isinstance(value, torch.Tensor):
            out[name] = value.detach().to("cpu").contiguous()
        else:
            raw = json.dumps(value, separators=(",", ":")).encode()
            out[JSON_PREFIX + name] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def _decode(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if name.startswith(JSON_PREFIX):
            out[name.removeprefix(JSON_PREFIX)] = json.loads(t.numpy().tobytes())
        else:
            out[name] = t
    return out


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _metadata(raw: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's bytes (FileRefused if unreadable)."""
    if len(raw) < 8:
        raise FileRefused("file damaged: shorter than its header")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise FileRefused("file damaged: cut short inside its header")
    try:
        return json.loads(raw[8:8 + n]).get("__metadata__") or {}
    except ValueError as e:
        raise FileRefused(f"file damaged: header is not JSON ({e})") from None


class EndpointFiles:
    """The directory of durable checkpoints. `save` and `delete` are called on the engine
    thread and return at once; `restore` runs at recovery, before serving."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="ninfer-durable",
                                        daemon=True)
        self._writer.start()
        self.errors: list[str] = []  # writes that failed (logged; the endpoint stays in memory)

    def path(self, checkpoint_id: str) -> Path:
        return self.dir / _file_name(checkpoint_id)

    # --- the engine thread -------------------------------------------------------------

    def save(self, model: Model, held: Held) -> None:
        """Copy `held`'s parts out of the pools now (they are fenced: it was published) and
        write them in the background."""
        parts = model.export_parts(held)
        parts["tokens"] = list(held.tokens)
        meta = {"format": FORMAT, "checkpoint": held.id, "model": model.identity,
                "dtypes": model.dtypes, "position": str(held.position),
                "mtp_kv": str(held.mtp_kv),
                "hidden_at": "" if held.hidden_at is None else str(held.hidden_at)}
        self._queue.put(("save", held.id, parts, meta))

    def delete(self, checkpoint_id: str) -> None:
        self._queue.put(("delete", checkpoint_id, None, None))

    def flush(self) -> None:
        """Wait until every queued write and deletion is on disk."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(5)

    # --- the writer thread -------------------------------------------------------------

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            op, checkpoint_id, parts, meta = item
            try:
                if op == "save":
                    self._write(checkpoint_id, parts, meta)
                else:
                    self.path(checkpoint_id).unlink(missing_ok=True)
            except Exception as exc:  # a full disk must not stop the engine
                self.errors.append(f"{op} {checkpoint_id}: {exc}")
                log.error("durable endpoint %s: %s failed: %s", checkpoint_id, op, exc)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, checkpoint_id: str, parts: dict, meta: dict[str, str]) -> None:
        tensors = _encode(parts)
        raw = st_save(tensors, metadata=meta | {"sha256": _checksum(tensors)})
        target = self.path(checkpoint_id)
        tmp = target.with_name(f".{target.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)  # a reader sees the whole file or none
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # --- recovery ----------------------------------------------------------------------

    def restore(self, model: Model, runner: Runner, facts: CheckpointFacts) -> Held:
        """Load the checkpoint `facts` describes into fresh blocks and a slot. Raises
        FileRefused (and deletes the file) when it is missing, damaged or mismatched, or
        OutOfMemory when the pools cannot hold it."""
        path = self.path(facts.id)
        try:
            parts, meta = self._read(path, model, facts)
        except FileRefused:
            path.unlink(missing_ok=True)
            raise
        tokens = tuple(parts.pop("tokens"))
        hidden_at = int(meta["hidden_at"]) if meta["hidden_at"] else None
        held = runner.allocate_held(facts.id, tokens, int(meta["mtp_kv"]), hidden_at)
        try:
            model.import_parts(held, parts)
        except ModelLost:
            runner.release_held(held)
            raise
        except Exception as e:  # parts of another shape: refused, and nothing held
            runner.release_held(held)
            path.unlink(missing_ok=True)
            raise FileRefused(f"file's parts do not fit the model: {e}") from None
        held.fence = model.fence()
        return held

    def _read(self, path: Path, model: Model, facts: CheckpointFacts) -> tuple[dict, dict]:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise FileRefused("no checkpoint file survived the restart") from None
        meta = _metadata(raw)
        if meta.get("format") != FORMAT:
            raise FileRefused(f"file format {meta.get('format')!r} is not {FORMAT!r}")
        expected = {"checkpoint": facts.id, "model": model.identity, "dtypes": model.dtypes,
                    "position": str(facts.position)}
        for key, want in expected.items():
            if meta.get(key) != want:
                raise FileRefused(f"file's {key} {meta.get(key)!r} is not {want!r}")
        try:
            tensors = st_load(raw)
        except Exception as e:
            raise FileRefused(f"file damaged: {e}") from None
        if _checksum(tensors) != meta.get("sha256"):
            raise FileRefused("file damaged: checksum mismatch")
        parts = _decode(tensors)
        tokens = parts.get("tokens")
        if not isinstance(tokens, list) or len(tokens) != facts.position or prefix_hash(
                tokens, facts.position, block_hashes(tokens)) != facts.prefix_hash:
            raise FileRefused("file's tokens are not the checkpoint's")
        return parts, meta

    def prune(self, keep: Iterable[str]) -> int:
        """Delete files of checkpoints the store does not hold (written after the last
        journal commit, or left by a crash mid-write); return how many."""
        wanted = {_file_name(c) for c in keep}
        removed = 0
        for f in self.dir.iterdir():
            if f.name.endswith(".safetensors") and f.name not in wanted or f.name.endswith(
                    ".tmp"):
                f.unlink(missing_ok=True)
                removed += 1
        return removed
