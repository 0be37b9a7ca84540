"""The embedded default model (the tiny Qwen3-Next with a real byte-level BPE of 4,096
tokens), loaded once in float64, for token-level tests of constrained decoding: a model
with logits and a tokenizer grammars compile for. Deterministic and random: later default
models change nothing here."""

from __future__ import annotations

import functools

import torch

from ninfer.engine.grammar import Grammars
from ninfer.model.runtime import open_model, random_model_dir
from ninfer.model.torch_model import TorchModel
from ninfer.server.reply_grammar import OutputFormat, reply_grammar

torch.set_num_threads(1)  # a tiny model: more threads only spin against each other (CI: 2 cores)


@functools.cache
def opened():
    return open_model(random_model_dir(), dtype="float64", kv_capacity=16, num_slots=1)


def tokenizer():
    return opened().tokenizer


@functools.cache
def grammars() -> Grammars:
    return Grammars.for_tokenizer(tokenizer(), opened().model.vocab_size)


def model_factory(num_blocks: int, block_size: int, num_slots: int) -> TorchModel:
    """For `Harness(model_factory=...)`: the embedded weights over fresh pools."""
    model = opened().model
    return TorchModel(model.net, num_blocks=num_blocks, block_size=block_size,
                      num_slots=num_slots, identity=model.identity)


def end_tokens() -> tuple[int, ...]:
    return grammars().end_tokens


def chat_prompt(content: str, thinking: bool = False) -> tuple[int, ...]:
    """A user turn rendered by the model's template, the generation prompt after it (a
    reasoning block left open when `thinking`)."""
    text = opened().template.render([{"role": "user", "content": content}],
                                    add_generation_prompt=True, enable_thinking=thinking)
    return tuple(tokenizer().encode(text))


def json_grammar(schema: dict, strict: bool = True, after_reasoning: bool = False) -> str:
    return reply_grammar(OutputFormat("json_schema", schema, strict),
                         after_reasoning=after_reasoning)
