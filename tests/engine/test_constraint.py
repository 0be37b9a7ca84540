"""A request's grammar state (ninfer/engine/constraint.py) and the choice over masked
logits: masks at a round's positions equal the ones a matcher stepped token by token gives,
drafts are cut at the first token the grammar refuses, the state is a pure function of the
committed output, the reply cannot end inside its reasoning, and sampling under a mask
keeps the masked distribution (also through speculative acceptance)."""

from __future__ import annotations

import math

import pytest
import torch

from ninfer.engine.constraint import Constraint
from ninfer.engine.grammar import ConstraintError, GrammarError, Grammars
from ninfer.engine.sampling import SampledChoice, token_logprobs
from ninfer.lifecycle.request import SamplingParams, grammar_hash
from ninfer.server.reply_grammar import OutputFormat, reply_grammar

from .embedded import end_tokens, grammars, json_grammar, tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                         "b": {"type": "array", "maxItems": 3, "items": {"enum": ["x", "y"]}}}}
DOC = '{"a": 12, "b": ["x", "y"]}'


def constraint(grammar: str, history: list[int], after: int | None = None) -> Constraint:
    g = grammars()
    return Constraint(g.matcher(grammar), history, after=after, end_tokens=g.end_tokens,
                      vocab_size=g.vocab_size)


def stepped_mask(grammar: str, tokens: list[int]) -> torch.Tensor:
    """The mask after `tokens`, from a fresh matcher fed them one by one."""
    c = constraint(grammar, list(tokens))
    return c.masks()[0]


def test_round_masks_equal_masks_of_a_matcher_stepped_token_by_token():
    grammar = json_grammar(SCHEMA)
    ids = tokenizer().encode(DOC)
    history = ids[:3]
    c = constraint(grammar, history)
    rows = c.masks(ids[3:])
    assert rows.shape == (len(ids) - 2, grammars().vocab_size)
    for i in range(len(ids) - 2):
        assert torch.equal(rows[i], stepped_mask(grammar, ids[:3 + i])), i
    assert rows[-1].nonzero().flatten().tolist() == list(end_tokens())  # complete: only the end
    # the matcher rests at the committed output: the next committed token is still its
    assert c.admissible(ids[3:]) == len(ids) - 3
    # and a second round over other drafts is answered from the same state
    assert torch.equal(c.masks(ids[3:5])[-1], stepped_mask(grammar, ids[:5]))


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses():
    grammar = json_grammar(SCHEMA)
    ids = tokenizer().encode(DOC)
    c = constraint(grammar, [])
    assert c.admissible(ids) == len(ids)
    assert c.admissible([*ids, *end_tokens()[:1]]) == len(ids) + 1   # the end, once complete
    bad = tokenizer().encode('{"a": x')
    good = len(tokenizer().encode('{"a": '))
    assert bad[:good] == ids[:good]
    assert c.admissible(bad) == good


def test_the_state_is_a_pure_function_of_the_committed_output():
    """Built over the whole output at once (a preempted request resumed) or followed as it
    grew: the same masks."""
    grammar = json_grammar(SCHEMA)
    ids = tokenizer().encode(DOC)
    grown: list[int] = []
    follower = constraint(grammar, grown)
    for n in range(len(ids)):
        follower.masks(ids[n:n + 2])           # rounds along the way, rolled back
        grown.append(ids[n])
        fresh = constraint(grammar, list(ids[:n + 1]))
        assert torch.equal(follower.masks(), fresh.masks()), n


def test_reasoning_is_free_but_cannot_end_the_reply():
    tok = tokenizer()
    think_end = tok.special.think_end
    grammar = json_grammar(SCHEMA, after_reasoning=True)
    reasoning = tok.encode("let me think: {{ not json")
    c = constraint(grammar, list(reasoning), after=think_end)
    free = c.masks()[0]
    assert not c.started and int(free.sum()) == grammars().vocab_size - len(end_tokens())
    assert not free[list(end_tokens())].any()
    answer = tok.encode("\n\n" + DOC)
    assert c.admissible([think_end, *answer]) == 1 + len(answer)
    more = tok.encode(" more")
    assert c.admissible([*more, end_tokens()[0]]) == len(more)  # no end in reasoning
    rows = c.masks([think_end, *answer])
    assert torch.equal(rows[1], stepped_mask(grammar, []))  # the grammar starts after it
    assert not constraint(grammar, [*reasoning, think_end, *answer], think_end).masks()[0][
        think_end]


def test_masks_prefetched_in_a_worker_are_the_same():
    """Computed while a verify runs (a worker thread), a round's masks are the ones computed
    after it, and the matcher is back at the committed output for what comes next."""
    grammar = json_grammar(SCHEMA)
    ids = tokenizer().encode(DOC)
    history: list[int] = []
    g = grammars()
    ahead = Constraint(g.matcher(grammar), history, after=None, end_tokens=g.end_tokens,
                       vocab_size=g.vocab_size, prefetch=True)
    for n in range(len(ids) - 2):
        drafts = ids[n:n + 2]
        ahead.prefetch(drafts)
        assert torch.equal(ahead.masks(drafts), constraint(grammar, list(ids[:n])).masks(drafts))
        assert ahead.admissible(drafts) == 2
        history.append(ids[n])
    bad = Constraint(g.matcher(grammar), tokenizer().encode("nope"), after=None,
                     end_tokens=g.end_tokens, vocab_size=g.vocab_size, prefetch=True)
    bad.prefetch(())
    with pytest.raises(ConstraintError):  # a worker's error is raised where it is waited for
        bad.masks()


def test_a_committed_token_the_grammar_refuses_is_an_error():
    c = constraint(json_grammar(SCHEMA), tokenizer().encode("nope"))
    with pytest.raises(ConstraintError):
        c.masks()


def test_a_model_without_logits_takes_the_lowest_allowed_token():
    c = constraint(json_grammar(SCHEMA), [])
    allowed = c.masks()[0].nonzero().flatten().tolist()
    assert all(tokenizer().decode([t]).startswith("{") for t in allowed)
    assert c.pick(allowed[-1]) == allowed[-1]
    assert c.pick(tokenizer().encode("x")[0]) == allowed[0]


def _choice(words: list[str], **params) -> tuple[SampledChoice, torch.Tensor]:
    """A choice over a grammar of `words`, and the tokens its grammar allows first (every
    token that starts one of the words: byte-level grammars allow any tokenization)."""
    grammar = reply_grammar(OutputFormat("choice", words))
    c = constraint(grammar, [])
    choice = SampledChoice(SamplingParams(grammar=grammar, stop_tokens=end_tokens(), **params),
                           [], (), c)
    return choice, c.masks()[0].nonzero().flatten()


def test_sampling_under_a_mask_keeps_the_masked_distribution_also_through_acceptance():
    """The first token of a three-way choice, drawn (a) directly and (b) through rejection
    sampling of a drafted token against the masked target: both follow the softmax of the
    logits of the tokens the grammar allows."""
    choice, allowed = _choice([" the", " and", " of"], temperature=1.0, seed=11)
    assert 3 <= len(allowed) <= 12
    vocab = grammars().vocab_size
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, vocab, generator=gen, dtype=torch.float64)
    want = torch.softmax(logits[0, allowed], -1)
    index = {int(t): i for i, t in enumerate(allowed)}
    n = 6000
    direct = torch.zeros(len(allowed))
    spec = torch.zeros(len(allowed))
    draft_logits = torch.zeros(vocab, dtype=torch.float64)  # a drafter that knows nothing
    for _ in range(n):
        direct[index[choice.next(None, logits[0])]] += 1
        token, q = choice.draft(None, draft_logits)
        assert token in index and q[allowed].sum() == pytest.approx(1.0)
        accepted, nxt = choice.accept([token], None, logits, [q])
        spec[index[token if accepted else nxt]] += 1
    assert torch.allclose(direct / n, want.float(), atol=0.02), direct / n
    assert torch.allclose(spec / n, want.float(), atol=0.02), spec / n


def test_logit_bias_is_added_and_log_probabilities_are_after_the_mask():
    [of] = tokenizer().encode(" of")
    choice, allowed = _choice([" the", " and", " of"], logit_bias=((of, 3.0), (5, -100.0)))
    logits = torch.zeros(grammars().vocab_size, dtype=torch.float64)
    shaped = choice.shaped(logits)
    assert sorted((shaped > -math.inf).nonzero().flatten().tolist()) == allowed.tolist()
    assert shaped[of] == 3.0 and int((shaped == 0).sum()) == len(allowed) - 1
    assert choice.next(None, logits) == of  # greedy: the biased one
    [report] = token_logprobs(choice.shaped(logits[None], [of]), [of], 20)
    assert sorted(t for t, _ in report["top"]) == allowed.tolist()  # no masked alternative
    assert report["top"][0][0] == of
    assert sum(math.exp(lp) for _, lp in report["top"]) == pytest.approx(1.0)


def test_grammars_are_compiled_once_per_text_and_refused_with_the_reason():
    g = Grammars(tokenizer().json_text, grammars().vocab_size, end_tokens(), cache=2)
    first = json_grammar(SCHEMA)
    assert g.compile(first) == grammar_hash(first)
    g.matcher(first)
    g.compile(first)
    assert g.compiled == 1
    for other in ("a", "b", "c"):
        g.compile(reply_grammar(OutputFormat("regex", other)))
    assert g.compiled == 4
    g.compile(first)  # dropped by the three after it (cache of 2): compiled again
    assert g.compiled == 5
    with pytest.raises(GrammarError, match="dependentSchemas"):
        g.compile(json_grammar({"type": "object", "dependentSchemas": {}}))
    with pytest.raises(GrammarError, match="over the limit"):
        g.compile(reply_grammar(OutputFormat("choice", ["x" * 1000] * 600)))
