"""A stand-in for the embedded default model that answers briefly: for tests that run a real
client (an agent CLI) against `ninfer serve` started with no options, where the random
default model would write until an output limit and the client would report an incomplete
reply.

It is the default tiny model (same shape, tokenizer and template) with two changes to its
weights. Its token embeddings are scaled up a thousandfold, so that every layer's residual
stream is the current token's embedding (the layers read it through their norms, and what
they add is small beside it): the model's next token depends on its current one only. And
its LM head is zero but for rows that follow a chain: after the newline that ends the
generation prompt (with thinking off) it writes REPLY token by token, then `<|im_end|>`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ninfer.model.runtime import RANDOM_MODEL
from ninfer.model.tiny import make_tiny
from ninfer.model.tokenizer import Tokenizer

REPLY = "Hello from ninfer"
SCALE, MARGIN = 1000.0, 40.0   # the embeddings' scale; the chosen token's logit


def brief_model(home: Path) -> Path:
    """The default model's directory under `home` (a NINFER_HOME), made to answer REPLY."""
    target = home / RANDOM_MODEL
    make_tiny(target, seed=0, dtype="float32")
    tok = Tokenizer.from_dir(target)
    chain = [tok.encode("\n")[-1], *tok.encode(REPLY), tok.special.im_end]
    if len(set(chain)) != len(chain):
        raise ValueError(f"{REPLY!r}: a token repeats, so the next one is not determined")
    path = target / "model.safetensors"
    tensors = load_file(path)
    embed = tensors["model.embed_tokens.weight"]
    unit = embed / embed.norm(dim=1, keepdim=True)   # [V, hidden]
    head = torch.zeros_like(tensors["lm_head.weight"])
    scale = MARGIN / embed.shape[1] ** 0.5   # the final norm makes each state's norm sqrt(d)
    for current, following in zip(chain, chain[1:], strict=False):
        head[following] += scale * unit[current]
    tensors["model.embed_tokens.weight"] = embed * SCALE
    tensors["lm_head.weight"] = head
    save_file(tensors, str(path), metadata={"format": "pt"})
    return target
