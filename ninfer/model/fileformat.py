"""The `.ninfer` single-file model format: everything a server needs in one file.

Layout (integers little-endian):

    0        MAGIC, 8 bytes: b"\\x89NINFER\\n"
    8        N, the header's length in bytes (u64)
    16       the header: UTF-8 JSON, space-padded so that the payload starts at a multiple of 64
    16 + N   the payload: a safetensors file (its u64 header length, its JSON header padded
             so its data starts at a multiple of 64, then the tensors back to back, largest
             element size first so each starts aligned to its own element size)

Header fields: `format_version` (1), `config` (config.json as `ModelConfig.to_dict()` writes
it), `tokenizer_json` (tokenizer.json's text), `tokenizer_config` (tokenizer_config.json without
its template), `chat_template` (a string, or named templates), `generation_config` (may be
{}), `tensors` ({name: {dtype, shape, offset, nbytes}}, offsets from the payload's start),
`payload_bytes` and `payload_sha256`.

The payload is a standard safetensors file (any safetensors reader takes the bytes from
offset 16 + N on); the outer header indexes the same tensors by offset from the payload's
start, so they are memory-mapped and viewed without a copy. The checksum covers the whole
payload; `read_ninfer` checks it unless told not to, and checks every offset before touching
tensor data.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

MAGIC = b"\x89NINFER\n"  # the high byte and newline catch text-mode and 7-bit mangling
FORMAT_VERSION = 1
ALIGN = 64
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_HEADER_FIELDS = {"format_version": int, "config": dict, "tokenizer_json": str,
                  "tokenizer_config": dict, "chat_template": (str, dict),
                  "generation_config": dict, "tensors": dict, "payload_bytes": int,
                  "payload_sha256": str}


class LoadError(ValueError):
    """Model files that cannot be served; the message names the file and the field or
    tensors at fault."""


@dataclass(frozen=True)
class NinferFile:
    """A read `.ninfer`: its header (see the module docstring) and its tensors, which are
    copy-on-write views of the memory-mapped file."""

    path: Path
    header: dict
    tensors: dict[str, torch.Tensor]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _encode_header(header: dict) -> bytes:
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (_align(16 + len(raw)) - 16 - len(raw))


def write_ninfer(out_path: str | Path, *, config: dict, tokenizer_json: str,
                 tokenizer_config: dict, chat_template: str | dict, generation_config: dict,
                 tensors: dict[str, torch.Tensor], progress: bool = True) -> Path:
    """Write a `.ninfer` atomically: to `<out>.partial`, then renamed over `out_path`."""
    if sys.byteorder != "little":
        raise RuntimeError(".ninfer payloads are little-endian; this host is not")
    out = Path(out_path)
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot be stored")
    # largest elements first: back to back, every tensor stays aligned to its element size
    names = sorted(tensors, key=lambda n: -tensors[n].element_size())
    st_index, offset = {}, 0
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        st_index[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    st_header = json.dumps(st_index, separators=(",", ":")).encode("utf-8")
    st_header += b" " * (_align(8 + len(st_header)) - 8 - len(st_header))
    data_start = 8 + len(st_header)
    index = {name: {"dtype": e["dtype"], "shape": e["shape"],
                    "offset": data_start + e["data_offsets"][0],
                    "nbytes": e["data_offsets"][1] - e["data_offsets"][0]}
             for name, e in st_index.items()}
    offset += data_start
    header = {"format_version": FORMAT_VERSION, "config": config,
              "tokenizer_json": tokenizer_json, "tokenizer_config": tokenizer_config,
              "chat_template": chat_template, "generation_config": generation_config,
              "tensors": index, "payload_bytes": offset, "payload_sha256": "0" * 64}
    partial = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as f:
        # The checksum is known only after the payload: write a placeholder of the same
        # length, then rewrite the header in place.
        f.write(MAGIC + struct.pack("<Q", len(_encode_header(header))) + _encode_header(header))
        st_head = struct.pack("<Q", len(st_header)) + st_header
        f.write(st_head)
        digest.update(st_head)
        for name in tqdm(names, total=len(names), unit="tensor", desc=f"writing {out.name}",
                         disable=not progress):
            data = tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            f.write(data.numpy())
            digest.update(data.numpy())
        header["payload_sha256"] = digest.hexdigest()
        f.seek(16)
        f.write(_encode_header(header))
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, out)
    return out


def convert(hf_dir: str | Path, out_path: str | Path, progress: bool = True) -> Path:
    """Convert a Hugging Face model directory to one `.ninfer` file. The directory is fully
    validated first (`load_files`), so a bad checkpoint raises LoadError and writes nothing."""
    from .loader import load_files  # the loader reads .ninfer files through this module

    loaded = load_files(hf_dir)
    tokenizer_config = {k: v for k, v in loaded.tokenizer.tokenizer_config.items()
                        if k != "chat_template"}
    return write_ninfer(out_path, config=loaded.config.to_dict(),
                        tokenizer_json=loaded.tokenizer.json_text,
                        tokenizer_config=tokenizer_config,
                        chat_template=loaded.template.templates,
                        generation_config=loaded.generation, tensors=loaded.tensors,
                        progress=progress)


def _read_header(path: Path, f: Any, size: int) -> tuple[dict, int]:
    head = f.read(16)
    if len(head) < 16 or head[:8] != MAGIC:
        what = f"truncated ({size} bytes)" if len(head) < 16 else f"bad magic {head[:8]!r}"
        raise LoadError(f"{path}: not a .ninfer file: {what}")
    (n,) = struct.unpack("<Q", head[8:])
    if 16 + n > size:
        raise LoadError(f"{path}: header length {n} runs past the end of the file "
                        f"({size} bytes): truncated or corrupted")
    try:
        header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{path}: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise LoadError(f"{path}: header is not a JSON object")
    for key, kind in _HEADER_FIELDS.items():
        if not isinstance(header.get(key), kind):
            raise LoadError(f"{path}: header field '{key}' is missing or of the wrong type")
    if header["format_version"] != FORMAT_VERSION:
        raise LoadError(f"{path}: header field 'format_version': {header['format_version']} "
                        f"is not supported (this build reads {FORMAT_VERSION})")
    return header, 16 + n


def _check_entry(path: Path, name: str, entry: Any, payload_bytes: int) -> None:
    ok = (isinstance(entry, dict) and entry.get("dtype") in DTYPES
          and isinstance(entry.get("shape"), list)
          and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
          and isinstance(entry.get("offset"), int)
          and entry["offset"] % DTYPES[entry["dtype"]].itemsize == 0
          and isinstance(entry.get("nbytes"), int) and entry["offset"] >= 0)
    if ok:
        numel = 1
        for d in entry["shape"]:
            numel *= d
        size = DTYPES[entry["dtype"]].itemsize
        ok = entry["nbytes"] == numel * size and entry["offset"] + entry["nbytes"] <= payload_bytes
    if not ok:
        raise LoadError(f"{path}: header field 'tensors': entry for tensor {name!r} is invalid "
                        f"or lies outside the payload: {entry!r}")


def read_ninfer(path: str | Path, *, verify: bool = True) -> NinferFile:
    """Read and check a `.ninfer`: magic, header, every tensor entry inside the payload, the
    payload's length, and (with `verify`) its sha256. Raises LoadError naming what is wrong;
    the returned tensors share the file's pages (copy-on-write)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        header, start = _read_header(path, f, size)
        payload_bytes = header["payload_bytes"]
        if start + payload_bytes != size:
            raise LoadError(f"{path}: payload is {size - start} bytes, header field "
                            f"'payload_bytes' says {payload_bytes}: truncated or corrupted")
        for name, entry in header["tensors"].items():
            _check_entry(path, name, entry, payload_bytes)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # stays valid after close
    if verify:
        got = hashlib.sha256(memoryview(mm)[start:]).hexdigest()
        if got != header["payload_sha256"]:
            raise LoadError(f"{path}: payload checksum mismatch (sha256 {got}, header field "
                            f"'payload_sha256' says {header['payload_sha256']}): corrupted")
    tensors = {}
    for name, e in header["tensors"].items():
        dtype, shape = DTYPES[e["dtype"]], tuple(e["shape"])
        if e["nbytes"] == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mm, dtype=dtype, count=e["nbytes"] // dtype.itemsize,
                                offset=start + e["offset"])
        tensors[name] = flat.view(shape)
    return NinferFile(path=path, header=header, tensors=tensors)
