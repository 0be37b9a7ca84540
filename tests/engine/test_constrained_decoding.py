"""Constrained decoding through the engine, token by token, on the embedded model (float64):
Hypothesis-generated JSON schemas whose replies parse and validate, with plain, MTP and
n-gram decoding at temperature 0 and 1; drafting changes no greedy constrained output; a
strict bounded schema always completes within its stated bound; reasoning stays free, and a
reasoning budget's close leaves the answer its turn; a request preempted or cut in the
middle of a JSON object goes on (or is retried) under the same grammar; the grammar is
journaled with the request."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.engine.constraint import Constraint
from ninfer.engine.engine import EngineConfig, Submit
from ninfer.engine.grammar import Grammars
from ninfer.engine.runner import Runner
from ninfer.lifecycle.journal import Journal
from ninfer.lifecycle.reader import JournalReader
from ninfer.lifecycle.request import SamplingParams, grammar_hash
from ninfer.server.reasoning import bounded
from ninfer.server.reply_grammar import document_bound
from ninfer.sim.harness import Harness

from .embedded import chat_prompt, end_tokens, grammars, json_grammar, model_factory, tokenizer

PROMPT = chat_prompt("Reply with a JSON document.")
SPECS = ("none", "mtp", "ngram")
NAMES = ("id", "name", "size", "tags", "ok", "kind", "x")


def harness(spec: str, journal: Journal | None = None, **config) -> Harness:
    return Harness(EngineConfig(spec=spec, prefill_chunk=64, max_concurrency=2, draft_tokens=3,
                                **config),
                   num_blocks=400, block_size=16, num_slots=24, model_factory=model_factory,
                   grammars=grammars(), journal=journal)


# --- schemas ---------------------------------------------------------------------------------

def _integer():
    return st.one_of(st.just({"type": "integer"}), st.tuples(
        st.integers(-50, 50), st.integers(0, 500)).map(
            lambda b: {"type": "integer", "minimum": b[0], "maximum": b[0] + b[1]}))


def _number():
    return st.one_of(st.just({"type": "number"}), st.tuples(
        st.floats(-100, 100, allow_nan=False), st.floats(0.5, 100, allow_nan=False)).map(
            lambda b: {"type": "number", "minimum": round(b[0], 2),
                       "maximum": round(b[0] + b[1], 2)}))


LEAVES = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}), _integer(), _number(),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.one_of(st.sampled_from(["a", "b c", "δ", "\""]), st.integers(-9, 99)),
             min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


def _object(children):
    return st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}))


def _array(children):
    return st.tuples(children, st.integers(0, 3)).map(
        lambda a: {"type": "array", "items": a[0], "maxItems": a[1]})


SCHEMAS = _object(st.recursive(LEAVES, lambda c: st.one_of(_object(c), _array(c)),
                               max_leaves=5))


# --- running ---------------------------------------------------------------------------------

def params(grammar: str, temperature: float, max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7,
                          stop_tokens=end_tokens(), grammar=grammar, **kw)


def run(h: Harness, requests: dict[str, SamplingParams], prompt=PROMPT,
        session: str | None = None, boundaries=()) -> dict:
    for rid, p in requests.items():
        h.engine.submit(Submit(rid, prompt, session, "t", p, boundaries=boundaries))
    h.run()
    h.check()
    return {rid: h.request(rid) for rid in requests}


def text_of(request) -> str:
    return tokenizer().decode([t for t in request.outputs if t not in end_tokens()])


def check_reply(request, schema: dict, grammar: str) -> None:
    """'stop': a complete document that validates; 'length': a prefix the grammar accepts."""
    if request.stop_reason == "stop_token":
        jsonschema.validate(json.loads(text_of(request)), schema)
    else:
        assert request.stop_reason == "max_tokens"
        g = grammars()
        Constraint(g.matcher(grammar), request.outputs, after=None, end_tokens=g.end_tokens,
                   vocab_size=g.vocab_size).masks()   # raises if it refuses a token


@pytest.fixture(scope="module")
def engines():
    return {spec: harness(spec) for spec in SPECS}


@settings(max_examples=6)
@given(schema=SCHEMAS, strict=st.booleans())
def test_replies_to_generated_schemas_validate_and_drafting_changes_no_greedy_one(
        engines, schema, strict):
    """Each schema, under each drafting mode, greedy and sampled: every reply validates (or
    is a valid prefix, ended by max_tokens); a strict, bounded one always completes within
    its bound; the greedy replies are token for token the same with and without drafting."""
    grammar = json_grammar(schema, strict)
    bound = document_bound(schema) if strict else None
    max_tokens = bound + 1 if bound is not None else 120
    greedy = {}
    for spec, h in engines.items():
        n = h.ids = h.ids + 1
        got = run(h, {f"g{n}": params(grammar, 0.0, max_tokens),
                      f"s{n}": params(grammar, 1.0, max_tokens)})
        for request in got.values():
            check_reply(request, schema, grammar)
            if bound is not None:
                assert request.stop_reason == "stop_token", text_of(request)
                assert len(text_of(request).encode()) <= bound
        greedy[spec] = got[f"g{n}"].outputs
    assert greedy["mtp"] == greedy["none"] == greedy["ngram"]


BOUNDED = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "ok"],
           "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"},
                          "tags": {"type": "array", "maxItems": 3,
                                   "items": {"type": "string", "maxLength": 4}}}}


@pytest.mark.parametrize("spec", ["mtp", "ngram"])
def test_drafts_are_cut_at_the_first_token_the_grammar_refuses_before_the_verify(
        spec, monkeypatch):
    """A drafter that proposes the right token and then ones the grammar refuses: only the
    right one is ever fed to a verify, and the reply is the one plain decoding gives."""
    grammar = json_grammar(BOUNDED)
    p = params(grammar, 0.0, document_bound(BOUNDED) + 1)
    want = run(harness("none"), {"r": p})["r"].outputs
    refused = tokenizer().encode("~")[0]
    real_draft, real_forward = Runner.draft, Runner.forward_many
    fed: list[int] = []

    def drafter(self, lane, seq, frontier, k, choice, ngrams=None):
        real_draft(self, lane, seq, frontier, k, choice, ngrams)  # the MTP layer still runs
        done = len(seq) - len(PROMPT)
        return [*want[done:done + 1], refused, refused][:k], None

    def forward(self, items, **kw):
        fed.extend(t for _, tokens, _ in items for t in tokens)
        return real_forward(self, items, **kw)

    monkeypatch.setattr(Runner, "draft", drafter)
    monkeypatch.setattr(Runner, "forward_many", forward)
    h = harness(spec)
    got = run(h, {"r": p})["r"]
    assert got.outputs == want
    assert refused not in fed
    commits = [e for e in h.journal.read() if e.kind == "TokensCommitted"]
    assert sum(e.accepted for e in commits) > 0
    assert all(e.drafted <= 1 for e in commits)


@pytest.mark.parametrize("spec", ["mtp", "ngram"])
def test_masks_computed_while_the_verify_runs_change_no_reply(spec):
    """From a large vocabulary up a round's masks are computed during its verify forward;
    forced on here, greedy and sampled replies are the ones computed after it."""
    g = grammars()
    ahead = Grammars(tokenizer().json_text, g.vocab_size, g.end_tokens, prefetch=True)
    grammar = json_grammar(BOUNDED)
    requests = {"g": params(grammar, 0.0, document_bound(BOUNDED) + 1),
                "s": params(grammar, 1.0, document_bound(BOUNDED) + 1)}
    want = run(harness(spec), requests)
    h = harness(spec)
    h.engine.grammars = ahead
    got = run(h, requests)
    for rid in requests:
        assert got[rid].outputs == want[rid].outputs
        check_reply(got[rid], BOUNDED, grammar)


def _reasoning_params(grammar: str | None, bias: float) -> SamplingParams:
    tok = tokenizer()
    think_end = tok.special.think_end
    return SamplingParams(max_tokens=200, stop_tokens=end_tokens(), grammar=grammar,
                          grammar_after=think_end if grammar else None,
                          logit_bias=((think_end, bias),))


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_reasoning_is_free_and_the_grammar_holds_from_its_end(spec):
    """With thinking on, the reasoning the model writes under a grammar is the one it
    writes without (a logit bias on the end-of-reasoning token makes it a few tokens), and
    after it the reply is the blank line and a valid document."""
    tok = tokenizer()
    think_end = tok.special.think_end
    prompt = chat_prompt("Reply with a JSON document.", thinking=True)
    h = harness(spec)
    grammar = json_grammar(BOUNDED, after_reasoning=True)
    got = run(h, {"free": _reasoning_params(None, 3.0),
                  "held": _reasoning_params(grammar, 3.0)}, prompt)
    free, held = got["free"].outputs, got["held"].outputs
    cut = held.index(think_end)
    assert cut >= 2, "a short reasoning, not none"
    assert held[:cut + 1] == free[:cut + 1]
    answer = tok.decode(held[cut + 1:-1])
    assert answer.startswith("\n\n") and got["held"].stop_reason == "stop_token"
    jsonschema.validate(json.loads(answer), BOUNDED)


def test_a_budget_closes_the_reasoning_and_the_constrained_answer_gets_its_turn():
    """Thinking on, a small reasoning budget and a JSON schema: the budget's close is
    committed as if chosen (the grammar, from the end of the reasoning, never refuses it),
    then the answer is a complete, valid document; greedy and sampled, under plain, MTP
    and n-gram decoding, and drafting changes no greedy reply."""
    tok = tokenizer()
    think_end = tok.special.think_end
    prompt = chat_prompt("Reply with a JSON document.", thinking=True)
    grammar = json_grammar(BOUNDED, after_reasoning=True)
    budget = 5
    held = bounded(SamplingParams(max_tokens=1, stop_tokens=end_tokens(), grammar=grammar,
                                  grammar_after=think_end, seed=7), budget, tok)
    close = list(held.reasoning_close)
    assert think_end in close
    held = dataclasses.replace(
        held, max_tokens=budget + len(close) + document_bound(BOUNDED) + 1)
    greedy = {}
    for spec in SPECS:
        got = run(harness(spec), {"g": held, "s": dataclasses.replace(held, temperature=1.0)},
                  prompt)
        for request in got.values():
            out = request.outputs
            assert think_end not in out[:budget]          # the model did not close it itself
            assert out[budget:budget + len(close)] == close
            answer = tok.decode(out[budget + len(close):-1])
            assert request.stop_reason == "stop_token", answer
            jsonschema.validate(json.loads(answer), BOUNDED)
        greedy[spec] = got["g"].outputs
    assert greedy["mtp"] == greedy["none"] == greedy["ngram"]


def test_the_reply_cannot_end_inside_its_reasoning():
    """An end token made all but certain still does not end a reply whose reasoning is
    open (thinking off: the same bias ends it at once)."""
    grammar = json_grammar(BOUNDED, after_reasoning=True)
    bias = tuple((t, 50.0) for t in end_tokens())
    prompt = chat_prompt("Reply with a JSON document.", thinking=True)
    h = harness("none")
    held = dataclasses.replace(_reasoning_params(grammar, 0.0), logit_bias=bias, max_tokens=12)
    free = dataclasses.replace(held, grammar=None, grammar_after=None)
    got = run(h, {"held": held, "free": free}, prompt)
    assert got["free"].outputs[-1] in end_tokens() and len(got["free"].outputs) == 1
    assert got["held"].stop_reason == "max_tokens"
    assert not set(got["held"].outputs) & set(end_tokens())


def _until(h: Harness, rid: str, n: int) -> None:
    for _ in range(200):
        h.step()
        r = h.request(rid)
        if getattr(r, "state", None) == "Active" and len(r.outputs) >= n:
            return
    raise AssertionError(f"{rid} did not reach {n} outputs")


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_a_preempted_request_resumes_under_the_same_grammar(spec):
    """Preempted in the middle of its JSON object, re-planned from the endpoint its
    frontier was published as: the same reply as uninterrupted (the grammar's state is a
    function of the committed tokens)."""
    grammar = json_grammar(BOUNDED)
    p = params(grammar, 0.0, document_bound(BOUNDED) + 1)
    whole = run(harness(spec), {"whole": p})["whole"]
    h = harness(spec)
    h.engine.submit(Submit("cut", PROMPT, "s", "t", p))
    _until(h, "cut", 4)
    assert h.request("cut").stop_reason is None
    h.engine.preempt("cut")
    h.run()
    h.check()
    resumed = h.request("cut")
    assert resumed.plan.kind == "PrivateEndpoint" and resumed.plan.reuse_base > len(PROMPT)
    assert resumed.outputs == whole.outputs
    check_reply(resumed, BOUNDED, grammar)


def test_a_cancel_in_the_middle_of_an_object_and_its_retry_validate():
    grammar = json_grammar(BOUNDED)
    h = harness("mtp")
    p = params(grammar, 1.0, document_bound(BOUNDED) + 1)
    anchor = (len(PROMPT) - 6,)  # where the generation prompt starts, say
    h.engine.submit(Submit("cut", PROMPT, "s", "t", p, boundaries=anchor))
    _until(h, "cut", 3)
    h.engine.cancel("cut")
    h.step()
    cut = h.request("cut")
    assert cut.state == "Cancelled" and text_of(cut).startswith("{")
    check_reply(dataclasses.replace(cut, stop_reason="max_tokens"), BOUNDED, grammar)
    retry = run(h, {"retry": dataclasses.replace(p, seed=8)}, session="s",
                boundaries=anchor)["retry"]
    assert (retry.plan.kind, retry.plan.reuse_base) == ("PrivateAnchor", anchor[0])
    check_reply(retry, BOUNDED, grammar)
    assert retry.stop_reason == "stop_token"


@pytest.mark.parametrize("tokens", [True, False])
def test_the_grammar_is_journaled_with_the_request_or_its_hash(tokens, tmp_path):
    """With the journal's content, the grammar's text (what redrive needs); without, its
    hash. The journal tools' lean reads leave it out."""
    grammar = json_grammar(BOUNDED)
    h = harness("none", Journal.open(tmp_path / "j.db"), journal_tokens=tokens)
    run(h, {"r": params(grammar, 0.0, 8)})
    [queued] = [e for e in h.journal.read() if e.kind == "RequestQueued"]
    if tokens:
        assert queued.params["grammar"] == grammar
        assert SamplingParams.from_dict(queued.params).grammar == grammar
    else:
        assert "grammar" not in queued.params
        assert queued.params["grammar_hash"] == grammar_hash(grammar)
    h.journal.close()
    with JournalReader.open(tmp_path / "j.db") as src:
        [lean] = [e for e in src.events(lean=True) if e.kind == "RequestQueued"]
    assert lean.params.get("grammar") is None and lean.params["max_tokens"] == 8
