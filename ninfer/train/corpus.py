"""The training corpus: built once, on this machine, into a folder that is carried to the GPU
machine as it is (`ninfer train corpus OUT`), and read back with its checksums verified.

The folder:

    manifest.json   what was built from what: the Python version, the stdlib folder, every
                    source file (path, bytes, sha256, split) and their joint sha256, the
                    held-out modules, the counts, and the sha256 of each file below
    tokenizer.json  the byte-level BPE trained on the training text (`ninfer.model.bpe`)
    train.bin       the training token ids, uint16 little-endian: every training document
                    (a source file, or a rendered chat example) followed by <|endoftext|>,
                    in a seeded order
    heldout.bin     the held-out source files' ids the same way (the training loop's
                    held-out loss)
    heldout.json    what the evaluation reads: the held-out sources, 200 docstring prompts,
                    200 tool prompts, code-continuation prompts

The same Python, the same stdlib and the same arguments give byte-identical files, so
`Corpus.sha256` (the manifest's sha256) names the corpus.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from ..model.bpe import ADDED, added_ids, train_bpe
from ..model.template import (
    QWEN3_STYLE_TEMPLATE_THINKING_OFF,
    QWEN3_STYLE_TEMPLATE_THINKING_OFF_DESCRIPTION_FIRST,
    ChatTemplate,
)
from . import examples as ex
from .sources import EXCLUDED_FOLDERS, GENERATED_MARK, HELD_OUT, Function, functions, scan
from .sources import files_sha256 as joint_sha256

FORMAT_VERSION = 1
VOCAB_SIZE = 8192  # the BPE's tokens and the added ones; the model's embedding rows
EVAL_PROMPTS = 200
CONTINUATIONS = 16
CONTINUATION_CHARS = 1500
TOOL_EXAMPLES_PER_FUNCTION = 10
# the share of tool examples whose functions and parameters get made-up names
# (`--made-up-tools`): their calls are right only when copied from the listed tools (with
# real names alone the model learns the training functions' names by heart; bench/NOTES.md,
# stop 37)
MADE_UP_TOOLS = 0.5
MADE_UP_NAMES = ("syllables", "words")   # how they are made (`--made-up-names`)
MADE_UP_NAMING = "words"
# the share of tool examples whose other tools come from the target's module
# (`--near-tools`): the held-out prompts list tools of 16 modules, one in seven of them the
# target's own (alike descriptions), where training's random others almost never were (one
# in eighty); v7w's tool calls failed most by calling another listed tool (bench/NOTES.md,
# stop 43). Not in the recipe: v9w, trained with half its examples so, called tools no
# better (bench/NOTES.md, stop 44)
NEAR_TOOLS = 0.0
# how the template lists a tool (`--tool-order`): as given (its name, then its description)
# or its description first. v9w's calls failed most when the request only described the
# function (61% valid against 87% when it named it), choosing another listed tool even where
# the request repeated a description word for word: the name to copy came before the text
# that matched (bench/NOTES.md, stop 44)
TEMPLATES = {"name-first": QWEN3_STYLE_TEMPLATE_THINKING_OFF,
             "description-first": QWEN3_STYLE_TEMPLATE_THINKING_OFF_DESCRIPTION_FIRST}
TOOL_ORDER = "description-first"
# the manifest records a rule only where it differs from these, the first recipe's: so the
# corpora built before a default changed keep their names (sha256)
FIRST_RULES = {"made_up_tools": 0.0, "made_up_names": "syllables",
               "tool_examples_per_function": 6, "near_tools": 0.0, "tool_order": "name-first"}
FILES = ("tokenizer.json", "train.bin", "heldout.bin", "heldout.json")


class CorpusError(ValueError):
    """A corpus folder that is incomplete or does not match its manifest."""


def trained_template(tool_order: str = TOOL_ORDER) -> ChatTemplate:
    """The trained model's chat template: thinking off unless a request turns it on; tools
    listed in `tool_order` (`TEMPLATES`)."""
    return ChatTemplate(TEMPLATES[tool_order], special_tokens={},
                        source="the trained model's template")


# --- building --------------------------------------------------------------------------------

def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _ids_bytes(ids: Sequence[int]) -> bytes:
    out = array("H", ids)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


def _eval_items(held_out: list[Function], rng: random.Random) -> tuple[list, list]:
    """EVAL_PROMPTS docstring prompts and as many tool prompts, all from held-out functions
    (fewer when a slice has fewer)."""
    documented = [f for f in held_out if f.docstring and ex.answerable(f, ex.MAX_EVAL_ANSWER_CHARS)]
    chosen = rng.sample(documented, min(EVAL_PROMPTS, len(documented)))
    docstrings = [ex.docstring_prompt(f, rng) for f in chosen]
    pool = [f for f in held_out if ex.usable_as_tool(f)]
    tools = ex.tool_examples(pool, EVAL_PROMPTS, rng, complete=False) if pool else []
    return docstrings, tools


def _changed_rules(**rules: object) -> dict:
    """The example rules that differ from the first recipe's (`FIRST_RULES`)."""
    return {name: value for name, value in rules.items() if value != FIRST_RULES[name]}


def _continuation(text: str) -> str:
    """About CONTINUATION_CHARS of a file from the first line start past its third."""
    start = text.find("\n", len(text) // 3) + 1
    end = text.find("\n", start + CONTINUATION_CHARS)
    return text[start:end + 1 if end >= 0 else len(text)]


def build(out_dir: str | Path, *, modules: Sequence[str] | None = None, seed: int = 0,
          vocab_size: int = VOCAB_SIZE, made_up_tools: float = MADE_UP_TOOLS,
          tool_examples: int = TOOL_EXAMPLES_PER_FUNCTION, made_up_names: str = MADE_UP_NAMING,
          near_tools: float = NEAR_TOOLS, tool_order: str = TOOL_ORDER,
          root: Path | None = None,
          progress: Callable[[str], None] = lambda _: None) -> Path:
    """Build the corpus into `out_dir` (absent or empty). `modules`: only these top-level
    stdlib modules (a slice, for tests, with a smaller `vocab_size`); `root`: another stdlib
    folder. `made_up_names`: "syllables" or "words" (real names' parts recombined,
    `examples.renamed`). `near_tools`: the share of tool examples listing the target's
    module's functions (`examples.tool_examples`). `tool_order`: how the chats' template
    lists tools (`TEMPLATES`; the trained model's file gets that template). `progress` is
    told each stage as it starts."""
    if made_up_names not in MADE_UP_NAMES:
        raise CorpusError(f"made-up names: one of {', '.join(MADE_UP_NAMES)}")
    if tool_order not in TEMPLATES:
        raise CorpusError(f"tool order: one of {', '.join(TEMPLATES)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: not empty")
    rng = random.Random(seed)
    progress("reading the standard library")
    files = scan(root, modules)
    if not files:
        raise CorpusError("no source files: check --modules")
    train_files = [f for f in files if f.split == "train"]
    held_files = [f for f in files if f.split == "held_out"]
    progress("making chat examples")
    train_fns = [fn for f in train_files if not f.suite for fn in functions(f)]
    held_fns = [fn for f in held_files for fn in functions(f)]
    template = trained_template(tool_order)
    chats = [ex.docstring_example(fn, rng) for fn in train_fns if ex.answerable(fn)]
    pool = [fn for fn in train_fns if ex.usable_as_tool(fn)]
    chats += ex.tool_examples(pool, tool_examples * len(pool), rng,
                              made_up=made_up_tools,
                              naming=random.Random(f"made-up names {seed}"),
                              pieces=ex.name_pieces(pool) if made_up_names == "words"
                              else None, near=near_tools,
                              nearby=random.Random(f"near tools {seed}")) if pool else []
    documents = [f.text for f in train_files] + [ex.render(template, c) for c in chats]
    rng.shuffle(documents)
    eval_docstrings, eval_tools = _eval_items(held_fns, rng)
    continuations = [{"path": f.path, "prompt": _continuation(f.text)}
                     for f in sorted(held_files, key=lambda f: -len(f.text))[:CONTINUATIONS]]

    progress(f"training the tokenizer on {sum(len(d) for d in documents) / 1e6:.1f}M chars")
    tokenizer_json = train_bpe(documents, vocab_size - len(ADDED))
    backend = BackendTokenizer.from_str(tokenizer_json)
    eot = added_ids(tokenizer_json)["<|endoftext|>"]

    def stream(texts: list[str]) -> list[int]:
        ids: list[int] = []
        for encoding in backend.encode_batch(texts, add_special_tokens=False):
            ids += encoding.ids
            ids.append(eot)
        return ids

    progress(f"tokenizing {len(documents)} documents")
    train_ids, held_ids = stream(documents), stream([f.text for f in held_files])
    heldout = {"sources": [{"path": f.path, "text": f.text} for f in held_files],
               "docstring_prompts": [c._asdict() for c in eval_docstrings],
               "tool_prompts": [c._asdict() for c in eval_tools],
               "continuations": continuations}
    blobs = {"tokenizer.json": tokenizer_json.encode(), "train.bin": _ids_bytes(train_ids),
             "heldout.bin": _ids_bytes(held_ids),
             "heldout.json": json.dumps(heldout, ensure_ascii=False, indent=1).encode()}
    manifest = {
        "format_version": FORMAT_VERSION,
        "python": platform.python_version(),
        "rules": {"excluded_folders": sorted(EXCLUDED_FOLDERS), "generated_mark": GENERATED_MARK,
                  "held_out_modules": list(HELD_OUT), "modules": list(modules or []) or None,
                  **_changed_rules(made_up_tools=made_up_tools, made_up_names=made_up_names,
                                   tool_examples_per_function=tool_examples,
                                   near_tools=near_tools, tool_order=tool_order)},
        "seed": seed,
        "files_sha256": joint_sha256(files),
        "counts": {"source_files": len(files), "train_files": len(train_files),
                   "held_out_files": len(held_files), "functions": len(train_fns),
                   "docstring_examples": sum(c.kind == "docstring" for c in chats),
                   "tool_examples": sum(c.kind == "tools" for c in chats),
                   "eval_docstring_prompts": len(eval_docstrings),
                   "eval_tool_prompts": len(eval_tools), "continuations": len(continuations),
                   "train_tokens": len(train_ids), "heldout_tokens": len(held_ids),
                   "train_bytes": sum(len(d.encode()) for d in documents),
                   "heldout_bytes": sum(len(f.text.encode()) for f in held_files)},
        "vocab_size": vocab_size,
        "sha256": {name: _sha256(data) for name, data in blobs.items()},
        "files": [{"path": f.path, "bytes": len(f.text.encode()), "sha256": f.sha256,
                   "split": f.split} for f in files],
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, data in blobs.items():
        (out / name).write_bytes(data)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return out


# --- reading ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    """A corpus folder whose files match its manifest (checked when opened)."""

    path: Path
    manifest: dict
    sha256: str  # of manifest.json: the corpus's name in reports

    @classmethod
    def open(cls, path: str | Path) -> Corpus:
        path = Path(path)
        manifest_file = path / "manifest.json"
        if not manifest_file.is_file():
            raise CorpusError(f"{path}: no manifest.json (build it with `ninfer train corpus`)")
        raw = manifest_file.read_bytes()
        manifest = json.loads(raw)
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CorpusError(f"{manifest_file}: format_version {manifest.get('format_version')}"
                              f" is not {FORMAT_VERSION}")
        for name in FILES:
            file = path / name
            if not file.is_file():
                raise CorpusError(f"{file}: missing")
            if _sha256(file.read_bytes()) != manifest["sha256"][name]:
                raise CorpusError(f"{file}: sha256 does not match manifest.json")
        return cls(path, manifest, _sha256(raw))

    @property
    def chat_template(self) -> str:
        """The template its chats were rendered with: the trained model's."""
        return TEMPLATES[self.manifest["rules"].get("tool_order", FIRST_RULES["tool_order"])]

    @cached_property
    def tokenizer_json(self) -> str:
        return (self.path / "tokenizer.json").read_text("utf-8")

    def ids(self, name: str) -> array:
        """`train.bin` or `heldout.bin` as an array of ids."""
        out = array("H")
        out.frombytes((self.path / name).read_bytes())
        if sys.byteorder != "little":
            out.byteswap()
        return out

    @cached_property
    def heldout(self) -> dict[str, Any]:
        return json.loads((self.path / "heldout.json").read_text("utf-8"))

    def eval_items(self, kind: str) -> list[ex.Example]:
        """`docstring_prompts` or `tool_prompts` as Examples."""
        return [ex.Example(**item) for item in self.heldout[kind]]
