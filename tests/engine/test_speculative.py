"""Drafting helpers: n-gram lookup, greedy acceptance, truncation, adaptive length."""

from ninfer.engine.speculative import AdaptiveDraft, accept_greedy, ngram_draft, truncate


def test_ngram_draft_follows_the_latest_earlier_occurrence():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [4, 5, 1]
    assert ngram_draft([1, 2, 3], 3) == []
    assert ngram_draft([5, 6, 5, 6], 0) == []


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
