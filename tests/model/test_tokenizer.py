"""The tokenizer wrapper: ids as transformers computes them, special tokens, exact decoding,
and streaming detokenization that never splits a UTF-8 character."""

import json
import random

import pytest

from ninfer.model.tokenizer import Tokenizer

TEXTS = [
    "Hello world! The model reads the answer.",
    "café naïve Größe 日本語 中文字符 한국어 Привет 😀🚀 ½ → €…",
    'def f(x):\n    return {"name": "get_city", "arguments": {"city": "Zürich"}}\n',
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>",
    "  leading spaces, tabs\tand\n\n\nnewlines  ",
    "<tool_call>\n{}\n</tool_call><tool_response>\n42\n</tool_response><|endoftext|>",
]


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


def test_ids_match_transformers(tiny_dir, tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(ids) == text  # NFC text round-trips exactly
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True)


def test_special_tokens(tok):
    s = tok.special
    assert s.eos == s.im_end == tok.token_to_id("<|im_end|>")
    assert s.pad == s.endoftext == tok.token_to_id("<|endoftext|>")
    assert s.bos is None
    assert tok.encode("<think></think><tool_call></tool_call>") == [
        s.think_start, s.think_end, s.tool_call_start, s.tool_call_end]
    assert s.stop_ids == {s.im_end, s.endoftext}
    # only the three chat-control tokens are special: decoding keeps think/tool tags
    assert tok.special_ids == {s.endoftext, s.im_start, s.im_end}
    assert tok.vocab_size == 4080


def test_every_byte_has_a_token(tok):
    byte_ids = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    assert all(bytes([b]) in byte_ids for b in range(256))
    assert tok.token_bytes(10**6) == b""


def _stream_deltas(tok, ids, **kw):
    stream = tok.stream(**kw)
    deltas = [stream.push(i) for i in ids]
    return deltas, stream.finish()


def test_stream_reassembles_multibyte_text(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        deltas, tail = _stream_deltas(tok, ids)
        assert "".join(deltas) + tail == text
        assert tail == ""
        # every delta is whole characters: each running concatenation is a prefix of the text
        # and no replacement character ever shows up
        acc = ""
        for d in deltas:
            acc += d
            assert text.startswith(acc) and "\ufffd" not in acc
    # a 4-byte emoji the vocabulary splits over tokens appears in one delta, once complete
    ids = tok.encode("x 🦜")
    assert len(ids) > 3
    deltas, _ = _stream_deltas(tok, ids)
    assert deltas[-2:] == ["", "🦜"]


def test_stream_equals_decode_on_arbitrary_ids(tok):
    # random ids include cut-off UTF-8 sequences, and ids past the tokenizer's vocabulary (the
    # embedding's padding rows, which a random model can emit): the stream renders them as
    # decode does
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size + 20) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            deltas, tail = _stream_deltas(tok, ids, skip_special_tokens=skip)
            assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip), ids


def test_stream_skips_special_tokens_only(tok):
    ids = tok.encode("<think>\nx\n</think>\n\nyes<|im_end|>")
    stream = tok.stream(skip_special_tokens=True)
    assert stream.push(ids) + stream.finish() == "<think>\nx\n</think>\n\nyes"
    assert stream.ids == ids


def test_rejects_a_tokenizer_that_is_not_byte_level(tiny_dir):
    spec = json.loads((tiny_dir / "tokenizer.json").read_text())
    spec["decoder"] = None
    with pytest.raises(ValueError, match="decoder"):
        Tokenizer(json.dumps(spec), {}, source="x/tokenizer.json")
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer((tiny_dir / "tokenizer.json").read_text(), {"eos_token": "<nope>"},
                  source="x/tokenizer.json")


def test_encoding_a_long_text_lets_other_threads_run(tok):
    """The server tokenizes a cold prompt on its event loop while the engine thread steps:
    an encode that held the interpreter lock stopped the engine for most of it (tens of ms
    for a long prompt). While one thread encodes ~1 MB of text, this one runs at a good
    part of its pace alone (measured 80x fewer turns with `tokenizers`' one-text call)."""
    import threading
    import time

    def pace(seconds: float, busy: threading.Thread | None = None) -> float:
        """Turns of a small loop per second, for `seconds` or while `busy` runs."""
        turns, began = 0, time.perf_counter()
        while (busy.is_alive() if busy else time.perf_counter() - began < seconds):
            sum(range(200))
            turns += 1
        return turns / (time.perf_counter() - began)

    text = TEXTS[2] * 24_000   # ~1.4 MB of code-like text
    alone = pace(0.2)
    done: list[list[int]] = []
    worker = threading.Thread(target=lambda: done.append(tok.encode(text)))
    worker.start()
    during = pace(0, worker)
    worker.join()
    assert done and done[0][:len(tok.encode(TEXTS[2]))] == tok.encode(TEXTS[2])
    assert during > alone / 5, (during, alone)


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_a_heads_ids_are_those_of_encoding_it_whole(tiny_dir, which):
    """`encode_head(head, text, encode(text))` equals `encode(head)` for every head of
    texts mixing added tokens, multi-byte characters, spaces and newlines, cut anywhere
    (inside an added token and inside a character's pieces too)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    if which == "tiny":
        tok = Tokenizer.from_dir(tiny_dir)
    else:
        from ninfer.model.runtime import open_model
        tok = open_model(None, kv_capacity=64, num_slots=1).tokenizer
    assert tok._added_pattern is not None
    added = sorted(tok.added_tokens.values())
    pieces = st.sampled_from([*added, "\n", " ", "  ", "e\u0301", "é", "日本", "😀", "def f(x):",
                              "<", ">", "|", "im_end", "think", "_call", "ab", "\t"])

    @settings(max_examples=60, deadline=None)
    @given(st.lists(pieces, max_size=24), st.data())
    def check(parts, data):
        text = "".join(parts)
        ids = tok.encode(text)
        cut = data.draw(st.integers(0, len(text)))
        head = text[:cut]
        assert tok.encode_head(head, text, ids) == tok.encode(head), (text, cut)

    check()
    text = "<|im_start|>system\nhi<|im_end|>\n<|im_start|>user\n" + "word " * 400 + "<|im_end|>\n"
    ids = tok.encode(text)
    for head in (text[:text.rindex("<|im_end|>") + len("<|im_end|>\n")],   # near the end
                 text[:text.index("<|im_end|>") + len("<|im_end|>\n")]):   # near the start
        encoded: list[str] = []
        whole = tok.encode
        tok.encode = lambda t, into=encoded, whole=whole: (into.append(t), whole(t))[1]
        try:
            assert tok.encode_head(head, text, ids) == whole(head)
        finally:
            del tok.encode
        assert encoded == ["\n"]   # only the part after the head's last added token


def test_a_head_ending_where_a_longer_added_token_starts_is_encoded_whole(tiny_dir):
    """With an added token that begins with another ("<think>\n" and "<think>"), a head
    ending in the shorter one splits otherwise than the text that goes on with the longer:
    its ids are not the text's, and `encode_head` encodes it whole."""
    import json as json_

    data = json_.loads((tiny_dir / "tokenizer.json").read_text())
    new_id = max(t["id"] for t in data["added_tokens"]) + 1
    data["added_tokens"].append({"id": new_id, "content": "<think>\n", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": False})
    tok = Tokenizer(json_.dumps(data), {}, source="test")
    text = "a<|im_end|>b <think>\nreasoning"
    head = "a<|im_end|>b <think>"
    ids = tok.encode(text)
    assert new_id in ids and tok.encode(head) != ids[:len(tok.encode(head))]
    assert tok.encode_head(head, text, ids) == tok.encode(head)
