"""The tokenizer of a checkpoint: `tokenizer.json` (a byte-level BPE, as every model of the
family ships) plus the special tokens named in `tokenizer_config.json`.

Contracts:
- `encode(text)` adds nothing (no BOS, no post-processor) and matches added tokens written in
  the text, exactly as `apply_chat_template(..., tokenize=True)` does: rendering a chat and
  encoding it gives the ids the model computed on.
- `decode(ids)` equals `tokenizers`' decode with the same `skip_special_tokens`.
- `DetokenizeStream` turns ids into text deltas as they arrive; the deltas joined (with the
  final `finish()`) equal `decode(ids)`, and a delta never ends inside a multi-byte UTF-8
  character: the bytes of every id are known exactly, so no guessing from U+FFFD.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import tokenizers


def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet: printable latin-1 bytes stand for themselves, the others are
    moved to code points 256 and up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_OF = _byte_decoder()


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the tokens the server treats specially; None where the vocabulary lacks one."""

    eos: int | None  # tokenizer_config's eos_token
    pad: int | None
    bos: int | None
    endoftext: int | None
    im_start: int | None
    im_end: int | None
    think_start: int | None
    think_end: int | None
    tool_call_start: int | None
    tool_call_end: int | None
    tool_response_start: int | None
    tool_response_end: int | None

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a generated turn: eos, `<|im_end|>` and `<|endoftext|>`."""
        return frozenset(i for i in (self.eos, self.im_end, self.endoftext) if i is not None)


_NAMED = {"endoftext": "<|endoftext|>", "im_start": "<|im_start|>", "im_end": "<|im_end|>",
          "think_start": "<think>", "think_end": "</think>", "tool_call_start": "<tool_call>",
          "tool_call_end": "</tool_call>", "tool_response_start": "<tool_response>",
          "tool_response_end": "</tool_response>"}


class Tokenizer:
    """A byte-level BPE tokenizer and its special tokens. Raises ValueError (naming `source`)
    for a tokenizer.json that is not byte-level, or a special token absent from the vocab."""

    def __init__(self, tokenizer_json: str, tokenizer_config: dict, *, source: str) -> None:
        self.source = source
        self.json_text = tokenizer_json
        self.tokenizer_config = tokenizer_config
        try:
            spec = json.loads(tokenizer_json)
            self._backend = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # the Rust parser's errors carry no common type
            raise ValueError(f"{source}: not a valid tokenizer.json: {e}") from e
        decoder = (spec.get("decoder") or {}).get("type")
        if decoder != "ByteLevel":
            raise ValueError(f"{source}: field 'decoder': only byte-level BPE tokenizers are "
                             f"supported, got {decoder!r}")
        self._added = self._backend.get_added_tokens_decoder()
        self.special = self._read_special()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json and (if present) tokenizer_config.json of an HF model directory."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        return cls(tok_file.read_text("utf-8"), read_tokenizer_config(path), source=str(tok_file))

    def _read_special(self) -> SpecialTokens:
        ids: dict[str, int | None] = {k: self.token_to_id(v) for k, v in _NAMED.items()}
        for key in ("eos", "pad", "bos"):
            content = _token_content(self.tokenizer_config.get(f"{key}_token"))
            ids[key] = None if content is None else self.token_to_id(content)
            if content is not None and ids[key] is None:
                raise ValueError(f"{self.source}: field '{key}_token': {content!r} is not in the "
                                 f"vocabulary")
        return SpecialTokens(**ids)

    # --- vocabulary -----------------------------------------------------------------------

    @cached_property
    def vocab_size(self) -> int:
        """One past the largest id, added tokens included: the rows the embedding needs."""
        return max(self._backend.get_vocab(with_added_tokens=True).values()) + 1

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Added tokens marked special: the ones `skip_special_tokens` drops."""
        return frozenset(i for i, t in self._added.items() if t.special)

    @cached_property
    def added_tokens(self) -> dict[int, str]:
        """Every added token (special or not, e.g. `<think>`) by id."""
        return {i: t.content for i, t in self._added.items()}

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @cached_property
    def _bytes(self) -> list[bytes]:
        out = [b""] * self.vocab_size  # ids the vocabulary skips decode to nothing
        for token, i in self._backend.get_vocab(with_added_tokens=False).items():
            if all(c in _BYTE_OF for c in token):
                out[i] = bytes(_BYTE_OF[c] for c in token)
            else:  # not byte-level text: tokenizers' ByteLevel decoder keeps it as written
                out[i] = token.encode("utf-8")
        for i, t in self._added.items():
            out[i] = t.content.encode("utf-8")  # added tokens decode as written
        return out

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one id (b"" for an id outside the vocabulary)."""
        return self._bytes[token_id] if 0 <= token_id < self.vocab_size else b""

    # --- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, added tokens in it matched, nothing added around it. Through
        `tokenizers`' batch call, which lets go of the interpreter lock while it works:
        its one-text call holds it nearly throughout (the server tokenizes a cold prompt
        on its event loop: 56K tokens of code took 135 ms on this machine's CPU, during
        which the engine thread could hardly step). The same ids in the same time."""
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    @cached_property
    def _added_pattern(self) -> re.Pattern | None:
        """The added tokens as they are found in a text (the longest at a position first),
        where each splits the text into parts encoded on their own; None where an added
        token strips, is normalised or must be a whole word (the parts are then not
        independent)."""
        tokens = list(self._added.values())
        if not tokens or any(t.lstrip or t.rstrip or t.single_word or t.normalized
                             for t in tokens):
            return None
        contents = sorted({t.content for t in tokens}, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, contents)))

    def encode_head(self, head: str, text: str, ids: Sequence[int]) -> list[int]:
        """`encode(head)` for a head of `text`, whose `encode` is `ids`, encoding only the
        head's part after its last added token: added tokens split a text into parts
        encoded on their own, so up to that token the head's ids are `ids`' own. A chat
        prompt's message boundaries are found so (`render_chat`): encoding each head whole
        cost a cold long prompt several times its own encoding."""
        pattern = self._added_pattern
        if pattern is None or not text.startswith(head):
            return self.encode(head)
        found = list(pattern.finditer(head))
        if not found:
            return self.encode(head)
        last = found[-1]
        # that token's place in ids, counted from ids' nearer end (a system prompt's head is
        # near the start, a last message's near the end): the added tokens up to it, or
        # from it to the text's end
        further = sum(1 for _ in pattern.finditer(text, last.start()))
        order = range(len(ids)) if len(found) <= further else range(len(ids) - 1, -1, -1)
        left = min(len(found), further)
        for k in order:
            token = self._added.get(ids[k])
            if token is not None:
                left -= 1
                if left == 0:
                    # another token there: a longer added token running past the head's end
                    # (the text splits otherwise than the head), or ids not `encode(text)`'s
                    if token.content != last.group():
                        break
                    rest = head[last.end():]
                    return [*ids[:k + 1], *(self.encode(rest) if rest else ())]
        return self.encode(head)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self, *, skip_special_tokens: bool = False) -> DetokenizeStream:
        return DetokenizeStream(self, skip_special_tokens=skip_special_tokens)


class DetokenizeStream:
    """Incremental detokenization of one sequence of ids.

    `push(ids)` returns the text that became complete (possibly ""); `finish()` returns what
    is left (an incomplete UTF-8 tail becomes U+FFFD, as `decode` renders it). O(1) per id."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._table = tokenizer._bytes   # token_bytes' table, read inline (once per token)
        self.ids: list[int] = []

    def push(self, ids: int | Iterable[int]) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        self.ids.extend(ids)
        table, skip = self._table, self._skip
        n = len(table)
        data = b"".join([table[i] if 0 <= i < n else b"" for i in ids if i not in skip])
        return self._utf8.decode(data)

    def finish(self) -> str:
        return self._utf8.decode(b"", final=True)


def read_tokenizer_config(path: str | Path) -> dict:
    """An HF directory's tokenizer_config.json ({} when absent)."""
    config_file = Path(path) / "tokenizer_config.json"
    return json.loads(config_file.read_text("utf-8")) if config_file.exists() else {}
