"""Sampling and speculative acceptance: filters do what they say; rejection sampling keeps
the target distribution (checked statistically on a small vocabulary)."""

import pytest
import torch

from ninfer.engine.sampling import (
    SampledChoice,
    SamplingConfig,
    accept_drafts,
    apply_penalties,
    distinct,
    probabilities,
    top_logprobs,
)
from ninfer.lifecycle.request import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)


def test_greedy_is_a_point_mass_on_the_argmax():
    p = probabilities(LOGITS, SamplingConfig())
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_top_k_top_p_min_p_cut_the_tail():
    assert (probabilities(LOGITS, SamplingConfig(temperature=1.0, top_k=2)) > 0).sum() == 2
    full = torch.softmax(LOGITS, -1)
    p = probabilities(LOGITS, SamplingConfig(temperature=1.0, top_p=float(full[0]) + 1e-6))
    assert (p > 0).tolist() == [True, True, False, False, False]
    p = probabilities(LOGITS, SamplingConfig(temperature=1.0, min_p=0.3))
    assert (p > 0).tolist() == (full >= 0.3 * full.max()).tolist()
    assert torch.allclose(p.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_temperature_sharpens():
    hot = probabilities(LOGITS, SamplingConfig(temperature=2.0))
    cold = probabilities(LOGITS, SamplingConfig(temperature=0.5))
    assert cold[0] > hot[0]


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-12])
def test_a_tiny_temperature_is_a_point_mass_not_nan(temperature):
    """Dividing unshifted logits by a tiny temperature overflowed to inf, and softmax gave
    NaN, which stopped the engine (found by the schema fuzzer)."""
    p = probabilities(LOGITS, SamplingConfig(temperature=temperature, top_p=0.9))
    assert p.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    masked = LOGITS.clone()
    masked[0] = float("-inf")
    assert probabilities(masked, SamplingConfig(temperature=temperature)).argmax() == 1


def test_penalties_lower_seen_tokens():
    out = apply_penalties(LOGITS, [1, 1, 3], SamplingConfig(presence_penalty=0.5,
                                                            frequency_penalty=0.25))
    assert out.tolist() == pytest.approx([2.0, 1.0 - 1.0, 0.5, -0.75, -1.0])


def test_repetition_penalty_divides_seen_positive_logits_and_multiplies_negative_ones():
    cfg = SamplingConfig(repetition_penalty=2.0)
    out = apply_penalties(LOGITS, [4], cfg, prompt_ids=distinct([0, 3, 0]))
    assert out.tolist() == pytest.approx([1.0, 1.0, 0.5, 0.0, -2.0])
    assert apply_penalties(LOGITS, [], cfg).tolist() == LOGITS.tolist()
    both = apply_penalties(LOGITS, [1, 1], SamplingConfig(presence_penalty=0.5,
                                                          repetition_penalty=2.0))
    assert both.tolist() == pytest.approx([2.0, 0.25, 0.5, 0.0, -1.0])  # (1 - 0.5) / 2


def test_a_verify_rows_penalties_count_the_drafts_before_it():
    """Row i of a verify round follows drafts[:i]: a draft the round already holds is
    penalised in the rows after it, as it would be decoded one token at a time."""
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    choice = SampledChoice(params, history=[], prompt=[4])
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, 0.0],    # after the prompt: 0
                         [2.0, 1.0, 0.5, 0.0, 0.0],    # after draft 0: 0 is seen, so 1
                         [2.0, 1.5, 0.6, 0.0, 0.0]],   # after drafts 0, 1: 0 and 1 seen, 2
                        dtype=torch.float64)
    probs = choice._probs(rows, [0, 1])
    assert probs.argmax(-1).tolist() == [0, 1, 2]
    assert choice.accept([0, 1], None, rows, [None, None]) == (2, 2)
    assert choice.accept([0, 0], None, rows, [None, None]) == (1, 1)
    # a draft drawn after draft 0 of the same round is penalised for it too
    assert choice.draft(None, rows[1], [0])[0] == 1
    assert choice.draft(None, rows[1])[0] == 0


def test_min_tokens_rules_the_stop_tokens_out_until_then_in_each_row():
    """Positions before min_tokens cannot end the reply: a verify's row i sits at position
    len(history) + i, so with one output so far and min_tokens 3, rows 0 and 1 hold the
    stop token back and row 2 may choose it."""
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_tokens=(0,))
    history = [4]
    choice = SampledChoice(params, history=history)
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, 0.0]] * 3, dtype=torch.float64)
    assert choice._probs(rows, [1, 1]).argmax(-1).tolist() == [1, 1, 0]
    assert choice.accept([1, 1], None, rows, [None, None]) == (2, 0)
    assert choice.next(None, rows[0]) == 1
    history.extend([1, 1])  # three outputs: the stop token may come now
    assert choice.next(None, rows[0]) == 0


def test_top_logprobs_are_sorted_log_probabilities():
    top = top_logprobs(LOGITS, 2)
    assert [t for t, _ in top] == [0, 1]
    assert top[0][1] == pytest.approx(float(torch.log_softmax(LOGITS, -1)[0]))


def test_greedy_acceptance_is_the_longest_agreeing_prefix():
    target = torch.eye(5, dtype=torch.float64)[[2, 4, 1, 3]]  # argmax 2, 4, 1, 3
    assert accept_drafts([2, 4, 0], target, None, SamplingConfig(), None) == (2, 1)
    assert accept_drafts([2, 4, 1], target, None, SamplingConfig(), None) == (3, 3)
    assert accept_drafts([0], target[:2], None, SamplingConfig(), None) == (0, 2)


@pytest.mark.parametrize("deterministic_drafter", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(deterministic_drafter):
    """The first produced token is distributed as the target's p, whatever the drafter."""
    cfg = SamplingConfig(temperature=1.0)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.6, 0.1, 0.2], dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(4)
    n = 20_000
    for _ in range(n):
        if deterministic_drafter:
            d, qd = 1, None
        else:
            d = int(torch.multinomial(q, 1, generator=gen))
            qd = q[None]
        accepted, nxt = accept_drafts([d], torch.stack([p, p]), qd, cfg, gen)
        counts[d if accepted else nxt] += 1
    freq = counts / n
    assert torch.allclose(freq, p.float(), atol=0.015), freq
