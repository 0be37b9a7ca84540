"""Training a Qwen-style byte-level BPE tokenizer, and the tokenizer_config.json that goes with
it. Torch-free: the tiny random models (`tiny.py`) and the trained default model's corpus
builder (`ninfer.train`) both make their tokenizers here.

The tokenizer: NFC, the split Qwen2/3 apply before byte-level BPE, the byte-level alphabet
always in the vocabulary (any text encodes), then the added tokens after the BPE ids: three
special ones (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, which `skip_special_tokens`
drops) and the tags the chat template and the output parser use (not special: decode keeps
them). The same texts give a byte-identical tokenizer.json.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
        "</tool_response>")
ADDED = SPECIAL + TAGS
# The split Qwen2/3 tokenizers apply before byte-level BPE (as transformers' Qwen2Tokenizer
# rebuilds it, so both tokenize alike).
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe(texts: Iterable[str], bpe_size: int) -> str:
    """tokenizer.json text: a byte-level BPE of exactly `bpe_size` tokens learnt from `texts`,
    then the added tokens at ids bpe_size... in the order of ADDED. Raises RuntimeError when
    the texts are too small to yield `bpe_size` tokens (the added tokens' ids must not move)."""
    tok = BackendTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != bpe_size:
        raise RuntimeError(f"the texts yield {tok.get_vocab_size()} BPE tokens, not {bpe_size}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return tok.to_str(pretty=True)


def added_ids(tokenizer_json: str) -> dict[str, int]:
    """The id of each token of ADDED in a tokenizer made by `train_bpe`."""
    tok = BackendTokenizer.from_str(tokenizer_json)
    return {t: tok.token_to_id(t) for t in ADDED}


def tokenizer_config(tokenizer_json: str, chat_template: str, max_length: int) -> dict:
    """tokenizer_config.json for a tokenizer made by `train_bpe`, as Qwen checkpoints write it:
    `<|im_end|>` ends a turn, `<|endoftext|>` pads, no BOS, the chat template inline."""
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t in SPECIAL}
             for t, i in added_ids(tokenizer_json).items()}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
            "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "unk_token": None, "clean_up_tokenization_spaces": False, "errors": "replace",
            "model_max_length": max_length, "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer", "chat_template": chat_template}
