"""The shipped default model (ninfer/data/): the file is the one recorded, it loads, answers
a fixed prompt exactly as recorded, and its MTP head drafts tokens the model accepts. A
broken loader, template, tokenizer or head turns these red."""

import hashlib
import json
from pathlib import Path

import pytest

from ninfer.engine.engine import Submit, run_until_idle
from ninfer.lifecycle.request import SamplingParams
from ninfer.model import runtime
from ninfer.train.evaluate import _engine

RECORDED = json.loads((Path(__file__).with_name("default_model.json")).read_text())


@pytest.fixture(scope="module")
def opened():
    return runtime.open_model(runtime.DEFAULT_FILE, kv_capacity=2048, num_slots=8)


def test_the_shipped_file_is_the_recorded_one():
    data = runtime.DEFAULT_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == RECORDED["sha256"] == runtime.DEFAULT_SHA256
    assert len(data) <= 17 * 2**20   # bf16 weights of <= 16 MiB, the tokenizer, the template


def test_a_greedy_answer_is_the_recorded_one(opened):
    """Through the engine as the server decodes: the template renders the question, the
    reply's tokens up to the end of its turn decode to the recorded bytes."""
    prompt = opened.template.render([{"role": "user", "content": RECORDED["prompt"]}],
                                    add_generation_prompt=True)
    engine = _engine(opened)
    stops = tuple(sorted(opened.tokenizer.special.stop_ids))
    engine.submit(Submit("r", tuple(opened.tokenizer.encode(prompt)), None, "t",
                         SamplingParams(max_tokens=RECORDED["max_tokens"], stop_tokens=stops)))
    run_until_idle(engine)
    out = list(engine.requests["r"].outputs)
    text = opened.tokenizer.decode(out[:-1] if out and out[-1] in stops else out)
    assert text == RECORDED["answer"]


def test_the_mtp_head_drafts_tokens_the_model_accepts(opened):
    """Code continued with MTP drafting at k = 3 (every round drafts): drafts are accepted,
    and the output is the plain greedy one."""
    ids = tuple(opened.tokenizer.encode(RECORDED["code_prompt"]))
    outputs, events = {}, []
    for spec in ("none", "mtp"):
        engine = _engine(opened, spec=spec, draft_tokens=3, adaptive=False)
        engine.log.listeners.append(events.append)
        engine.submit(Submit(spec, ids, None, "t", SamplingParams(max_tokens=48)))
        run_until_idle(engine)
        outputs[spec] = engine.requests[spec].outputs
    commits = [e for e in events if e.kind == "TokensCommitted"]
    assert sum(e.drafted for e in commits) > 0
    assert sum(e.accepted for e in commits) >= RECORDED["min_accepted"]
    assert outputs["mtp"] == outputs["none"]
