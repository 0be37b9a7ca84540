"""`ninfer journal redrive` of constrained requests: the grammar comes back with the
request's parameters, the recorded tokens are redriven, and with the model's tokenizer each
constrained output is checked against its journaled grammar (a grammar's state is a pure
function of the grammar and the output), so an output the grammar refuses is reported."""

from __future__ import annotations

import dataclasses

import pytest

from ninfer.engine.engine import EngineConfig, Submit
from ninfer.lifecycle.journal import Journal
from ninfer.lifecycle.reader import JournalReader
from ninfer.lifecycle.request import SamplingParams
from ninfer.sim.harness import Harness
from ninfer.tools.redrive import redrive

from ..engine.embedded import chat_prompt, end_tokens, grammars, json_grammar, model_factory

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
OTHER = {"type": "object", "required": ["m"], "properties": {"m": {"type": "string"}}}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A constrained session: greedy and sampled requests, one cut in its object, a second
    turn, on the embedded model with n-gram drafts (redriven on SimModel, MTP drafts would
    be judged otherwise, and the MTP layer's lag with them)."""
    path = tmp_path_factory.mktemp("constrained") / "journal.db"
    h = Harness(EngineConfig(spec="ngram", prefill_chunk=64, max_concurrency=2),
                num_blocks=300, block_size=16, num_slots=16, model_factory=model_factory,
                grammars=grammars(), journal=Journal.open(path))
    prompt = chat_prompt("JSON, please.")
    grammar = json_grammar(SCHEMA)

    def submit(rid, prompt, temperature, max_tokens=40):
        h.engine.submit(Submit(rid, prompt, "s", "t", SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=1, grammar=grammar,
            stop_tokens=end_tokens())))

    submit("greedy", prompt, 0.0)
    submit("sampled", prompt, 1.0)
    h.run()
    submit("cut", prompt, 1.0)
    for _ in range(20):
        h.step()
        if len(h.request("cut").outputs) >= 3:
            break
    h.engine.cancel("cut")
    h.run()
    submit("turn2", prompt + tuple(h.request("greedy").outputs) + prompt[-6:], 0.0)
    h.run()
    h.journal.close()
    return path


def _events(path):
    with JournalReader.open(path) as src:
        return list(src.events()), src.meta


def test_constrained_requests_redrive_and_their_outputs_are_checked(recorded):
    events, meta = _events(recorded)
    out = redrive(events, meta, grammars=grammars())
    assert out.same and out.differences == [] and out.violations == []
    assert out.grammars_checked == 4 and out.grammar_violations == []
    # without the tokenizer, the same recording redrives as well, its grammars unchecked
    plain = redrive(events, meta)
    assert plain.same and plain.grammars_checked == 0


def test_an_output_its_grammar_refuses_is_reported(recorded):
    events, meta = _events(recorded)
    other = json_grammar(OTHER)
    tampered = [dataclasses.replace(e, params={**e.params, "grammar": other})
                if e.kind == "RequestQueued" and e.request == "greedy" else e for e in events]
    out = redrive(tampered, meta, grammars=grammars())
    assert not out.same
    assert len(out.grammar_violations) == 1 and "greedy" in out.grammar_violations[0]
