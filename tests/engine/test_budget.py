"""Reasoning budgets in the engine: the close is committed at the budget as if chosen, the
model goes on from the state after it (the same tokens a Root run of the extended sequence
gives), with plain decoding and under MTP and n-gram drafting; a model that closed by itself
is left alone; a redrive forces the same tokens."""

from __future__ import annotations

import pytest

from ninfer.engine.budget import ClosingChoice, ClosingGreedy, ForcedClose, budgeted
from ninfer.engine.choice import GreedyChoice
from ninfer.engine.engine import EngineConfig, Submit
from ninfer.lifecycle.journal import Journal
from ninfer.lifecycle.reader import JournalReader
from ninfer.lifecycle.request import SamplingParams
from ninfer.sim.harness import Harness
from ninfer.tools.redrive import redrive

PROMPT = tuple((i * 31 + 7) % 89 for i in range(1, 40))
CLOSE = (90, 91, 92)   # ids the prompt never holds: "\n", "</think>", "\n\n" in a real model
END = 91


def params(budget: int | None, max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, reasoning_budget=budget,
                          reasoning_close=CLOSE if budget is not None else (),
                          reasoning_end=END if budget is not None else None, **kw)


def run(spec: str, p: SamplingParams, prompt=PROMPT, journal: Journal | None = None):
    h = Harness(EngineConfig(spec=spec, prefill_chunk=8, check_reuse=True),
                num_blocks=400, num_slots=16, journal=journal)
    h.engine.submit(Submit("r1", tuple(prompt), "s", "t", p))
    h.run()
    h.engine.check_integrity()
    return h, list(h.request("r1").outputs)


def forced_reference(model, prompt, budget: int, max_tokens: int) -> list[int]:
    """Greedy up to the budget, the close, then greedy from the sequence that holds it."""
    head = model.reference_generate(prompt, budget) if budget else []
    rest = max_tokens - budget - len(CLOSE)
    tail = model.reference_generate(tuple(prompt) + tuple(head) + CLOSE, rest) if rest else []
    return [*head, *CLOSE, *tail]


@pytest.mark.parametrize("spec", ["none", "mtp", "ngram"])
@pytest.mark.parametrize("budget", [0, 1, 5, 12])
def test_the_close_is_committed_at_the_budget_and_the_model_goes_on(spec, budget):
    h, out = run(spec, params(budget))
    assert out == forced_reference(h.engine.model, PROMPT, budget, 16)
    assert out[budget:budget + len(CLOSE)] == list(CLOSE)


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_no_budget_or_a_budget_past_the_output_changes_nothing(spec):
    h, plain = run(spec, params(None))
    assert plain == h.engine.model.reference_generate(PROMPT, 16)
    _, long = run(spec, params(40))
    assert long == plain


def test_the_close_cut_by_max_tokens_stops_there():
    h, out = run("none", params(4, max_tokens=6))
    assert out == h.engine.model.reference_generate(PROMPT, 4) + list(CLOSE[:2])


def test_under_mtp_the_close_is_drafted_and_accepted_in_the_rounds():
    """The forced tokens are drafted (whatever the MTP head says), so a verify round accepts
    them rather than spending a round on each."""
    h = Harness(EngineConfig(spec="mtp", prefill_chunk=8), num_blocks=400, num_slots=16)
    commits = []
    h.engine.log.listeners.append(
        lambda e: commits.append(e) if e.kind == "TokensCommitted" else None)
    h.engine.submit(Submit("r1", PROMPT, "s", "t", params(5)))
    h.run()
    assert list(h.request("r1").outputs) == forced_reference(h.engine.model, PROMPT, 5, 16)
    at = 0
    accepted_forced = 0
    for e in commits:
        drafts_kept = e.tokens[:e.accepted] if e.accepted else ()
        accepted_forced += sum(1 for i, t in enumerate(drafts_kept)
                               if 5 <= at + i < 5 + len(CLOSE) and t == CLOSE[at + i - 5])
        at += len(e.tokens)
    assert accepted_forced >= 1


class _Scripted:
    """A choice that 'writes' given tokens (the end token among them)."""

    def __init__(self, tokens, outputs):
        self.tokens, self.outputs = tokens, outputs

    def next(self, greedy, logits):
        return self.tokens[len(self.outputs)]

    def draft(self, greedy, logits, before=()):
        return self.tokens[len(self.outputs) + len(before)], None

    def accept(self, drafts, greedy, logits, draft_probs):
        base = len(self.outputs)
        n = 0
        while n < len(drafts) and drafts[n] == self.tokens[base + n]:
            n += 1
        return n, self.tokens[base + n]


def test_a_model_that_closed_within_its_budget_is_not_forced():
    outputs: list[int] = []
    p = params(4)
    choice = budgeted(_Scripted([1, END, 2, 3, 4, 5, 6, 7, 8], outputs), p, outputs)
    assert isinstance(choice, ClosingChoice) and not isinstance(choice, GreedyChoice)
    for _ in range(8):
        outputs.append(choice.next(0, None))
    assert outputs == [1, END, 2, 3, 4, 5, 6, 7]


def test_acceptance_stops_at_the_close_and_the_inner_choice_judges_before_it():
    outputs = [10, 11, 12]                 # the budget (4) is one draft away
    p = params(4)
    forced = ForcedClose(p, outputs)
    assert [forced.at(i) for i in range(3, 9)] == [None, *CLOSE, None, None]
    choice = budgeted(GreedyChoice(), p, outputs)
    assert isinstance(choice, ClosingGreedy)
    # drafts: position 3 (free), 4..6 (the close), 7 (free again)
    greedy = [13, 99, 99, 99, 99, 99]
    assert choice.accept([13, *CLOSE, 50], greedy, None, None) == (3, CLOSE[2])
    assert choice.accept([14, *CLOSE], greedy, None, None) == (0, 13)   # the model's own
    assert choice.accept([13, CLOSE[0], 7], greedy, None, None) == (2, CLOSE[1])
    assert choice.draft(0, None, (13,)) == (CLOSE[0], None)
    assert choice.draft(42, None, ()) == (42, None)


def test_without_a_budget_the_choice_is_unwrapped():
    inner = GreedyChoice()
    assert budgeted(inner, params(None), []) is inner


def test_a_redrive_forces_the_same_close(tmp_path):
    path = tmp_path / "journal.db"
    h, out = run("mtp", params(5), journal=Journal.open(path))
    h.journal.close()
    with JournalReader.open(path) as src:
        events = list(src.events())
        queued = next(e for e in events if e.kind == "RequestQueued")
        assert queued.params["reasoning_budget"] == 5
        assert queued.params["reasoning_close"] == list(CLOSE)
        outcome = redrive(events, src.meta)
    assert outcome.differences == [] and outcome.violations == [] and outcome.same
    assert outcome.compared == 1


def test_the_journal_holds_a_budget_only_when_there_is_one():
    assert "reasoning_budget" not in params(None).to_dict()
    assert params(3).to_dict()["reasoning_close"] == list(CLOSE)
