"""Chat prompts of a chosen length in tokens, for benchmarks that measure the server from
outside: real text (this Python's standard library's source) cut so that the served model's
chat template and tokenizer make the whole prompt `n` tokens, give or take the few a cut's
re-tokenising moves. The server's `usage.prompt_tokens` is the count a bench records."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

SOURCE_CHARS = 4_000_000   # enough text for every prompt of a run to be its own


class PromptMaker:
    """Prompts for one model: `messages(n, key)` is a one-message conversation of `n`
    tokens whose text no other key's shares; `follow_up(history, n, key)` a short new user
    message of about `n` tokens appended to `history`."""

    def __init__(self, tokenizer, template) -> None:
        self.tokenizer, self.template = tokenizer, template

    @classmethod
    def for_model(cls, model: str | None) -> PromptMaker:
        """The tokenizer and chat template of a model directory or .ninfer file (None: the
        default model, as `ninfer serve` opens it)."""
        from ..model.runtime import default_model
        path = Path(model) if model else default_model()[0]
        if path.is_dir():
            from ..model.template import ChatTemplate
            from ..model.tokenizer import Tokenizer
            return cls(Tokenizer.from_dir(path), ChatTemplate.from_dir(path))
        from ..model.loader import load_files
        files = load_files(path, verify=False)
        return cls(files.tokenizer, files.template)

    @cached_property
    def source(self) -> str:
        """The standard library's modules in path order, up to SOURCE_CHARS."""
        from ..train.sources import stdlib_root
        parts, size = [], 0
        for path in sorted(stdlib_root().glob("*.py")):
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
            size += len(parts[-1])
            if size >= SOURCE_CHARS:
                break
        return "".join(parts)

    def count(self, messages: list[dict], *, generation: bool = True) -> int:
        """Prompt tokens of `messages` as the server renders them (thinking off; without
        `generation`, the conversation so far, no assistant turn opened)."""
        text = self.template.render(messages, add_generation_prompt=generation,
                                    enable_thinking=False)
        return len(self.tokenizer.encode(text))

    def _text(self, n: int, key: int, before: list[dict]) -> str:
        """Text that makes `before` + one user message `n` tokens long, at an offset of the
        source that `key` chooses (distinct keys, distinct text)."""
        overhead = self.count([*before, {"role": "user", "content": ""}])
        chars = 8 * n + 64
        start = (key * 40_009) % max(1, len(self.source) - chars)
        ids = self.tokenizer.encode(self.source[start:start + chars])
        head = f"Text {key}:\n"
        take = n - overhead - len(self.tokenizer.encode(head))
        text = head
        for _ in range(4):   # a cut re-tokenises a little differently: aim again
            text = head + self.tokenizer.decode(ids[:max(0, take)])
            got = self.count([*before, {"role": "user", "content": text}])
            if got == n:
                break
            take += n - got
        return text

    def messages(self, n: int, key: int) -> list[dict]:
        """A conversation of one user message, `n` prompt tokens in all."""
        return [{"role": "user", "content": self._text(n, key, [])}]

    def follow_up(self, history: list[dict], n: int, key: int) -> list[dict]:
        """`history` and a new user message: `n` tokens more than `history` rendered as it
        stands (the next turn's delta: the message, its turn markers and the assistant's
        opening)."""
        total = self.count(history, generation=False) + n
        return [*history, {"role": "user", "content": self._text(total, key, history)}]
