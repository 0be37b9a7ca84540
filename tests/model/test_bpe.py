"""The BPE trainer on texts too small for the size asked: an error when the added tokens'
ids must not move, else fewer BPE tokens with the added ones right after them (the
constrained bench's ~152K tokenizer, trained on whatever Python source a machine has)."""

from __future__ import annotations

import pytest

from ninfer.model.bpe import ADDED, added_ids, train_bpe

TEXTS = ["the cat sat on the mat", "the dog sat on the log"] * 4


def test_too_few_merges_is_an_error_unless_not_exact():
    with pytest.raises(RuntimeError, match="BPE tokens"):
        train_bpe(TEXTS, 5000)
    text = train_bpe(TEXTS, 5000, exact=False)
    ids = added_ids(text)
    first = min(ids.values())
    assert 256 < first < 5000      # the byte alphabet and some merges, not 5000
    assert [ids[t] for t in ADDED] == list(range(first, first + len(ADDED)))
