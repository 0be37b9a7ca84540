"""Drafting helpers: n-gram lookup, greedy acceptance, truncation, adaptive length."""

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from ninfer.engine.speculative import (
    AdaptiveDraft,
    NgramIndex,
    accept_greedy,
    ngram_draft,
    truncate,
)
from ninfer.lifecycle.request import TokensSoFar


def test_ngram_draft_follows_the_latest_earlier_occurrence():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [4, 5, 1]
    assert ngram_draft([1, 2, 3], 3) == []
    assert ngram_draft([5, 6, 5, 6], 0) == []


@given(st.integers(1, 3),
       st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=5),
                          st.integers(0, 4)), max_size=30))
def test_the_ngram_index_drafts_what_the_scan_does(n, rounds):
    """A request's sequence grows between rounds; the index's drafts are the scan's."""
    index, prompt, outputs = NgramIndex(n), (3, 1), []
    for new, k in rounds:
        outputs.extend(new)
        seq = TokensSoFar(prompt, outputs)
        assert index.draft(seq, k) == ngram_draft(prompt + tuple(outputs), k, n)


class Reads(Sequence):
    """A sequence that counts the items its readers copy out."""

    def __init__(self, items):
        self.items, self.read = list(items), 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        got = self.items[i]
        self.read += len(got) if isinstance(i, slice) else 1
        return got


def test_a_round_of_the_ngram_index_reads_the_new_tokens_not_the_context():
    tokens = Reads(range(10_000))
    index = NgramIndex()
    index.draft(tokens, 3)
    tokens.items += [7, 8, 9, 7, 8]
    tokens.read = 0
    assert index.draft(tokens, 3) == [9, 7, 8]
    assert tokens.read <= 16


def test_the_ngram_index_starts_over_for_a_shorter_sequence():
    index = NgramIndex()
    assert index.draft(tuple([1, 2, 7, 8, 9] * 3) + (1, 2), 2) == [7, 8]
    assert index.draft((5, 1, 2, 3, 1, 2), 2) == [3, 1]   # (not the sequence before's)


@given(st.lists(st.integers(0, 9), max_size=8), st.lists(st.integers(0, 9), max_size=8),
       st.integers(-10, 10), st.integers(-10, 10), st.sampled_from([None, 1, 2, -1]))
def test_tokens_so_far_reads_as_prompt_and_outputs(prompt, outputs, a, b, step):
    view, whole = TokensSoFar(tuple(prompt), outputs), tuple(prompt) + tuple(outputs)
    assert len(view) == len(whole) and tuple(view) == whole
    assert view[a:b:step] == whole[a:b:step]
    assert [view[i] for i in range(-len(whole), len(whole))] == list(whole) * 2
    outputs.append(5)
    assert view[-1] == 5 and len(view) == len(whole) + 1   # it follows the outputs


def test_accept_greedy_and_truncate():
    assert accept_greedy([4, 5, 6], [4, 5, 7, 8]) == 2
    assert truncate([4, 5, 7], room=2, stop_tokens=()) == (2, "max_tokens")
    assert truncate([4, 0, 7], room=5, stop_tokens=(0,)) == (2, "stop_token")
    assert truncate([4, 5], room=5, stop_tokens=(0,)) == (2, None)


def test_adaptive_drafting_pauses_when_nothing_is_accepted():
    a = AdaptiveDraft(4)
    drafted = verified = 0
    for _ in range(200):
        k = a.next_k()
        drafted += k
        verified += k + 1
        a.observe(k, 0)
    # a verify of k+1 positions instead of 1: the extra work stays under 10%
    assert (verified - 200) / 200 < 0.10


def test_adaptive_drafting_keeps_full_length_when_drafts_agree():
    a = AdaptiveDraft(4)
    for _ in range(20):
        k = a.next_k()
        a.observe(k, k)
    assert a.next_k() == 4


def test_adaptive_drafting_comes_back_soon_after_a_few_misses():
    """A drafter that agrees but missed three in a row (a hard stretch) drafts again
    within a few rounds; one that keeps missing waits longer each time."""
    a = AdaptiveDraft(3)
    for _ in range(3):
        a.observe(a.next_k(), 0)
    waited = 0
    while a.next_k() == 0:
        waited += 1
    assert waited <= 4
    a.observe(1, 1)
    assert a.next_k() > 0
    pauses = []
    for _ in range(4):
        a.observe(max(a.next_k(), 1), 0)
        n = 0
        while a.next_k() == 0:
            n += 1
        pauses.append(n)
    assert pauses == sorted(pauses) and pauses[-1] > pauses[0]


def test_fixed_drafting_always_drafts_its_length():
    a = AdaptiveDraft(3, adaptive=False)
    for _ in range(10):
        assert a.next_k() == 3
        a.observe(3, 0)
