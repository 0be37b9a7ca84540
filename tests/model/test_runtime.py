"""The random tiny model (the tests' default, $NINFER_MODEL): generated on first use into the
cache directory, then reused; and which model is the default."""

import time

from ninfer.engine.engine import Engine, EngineConfig, Submit, run_until_idle
from ninfer.lifecycle.request import SamplingParams
from ninfer.model import runtime


def test_the_random_model_is_generated_once_and_serves(tmp_path, monkeypatch):
    monkeypatch.setenv("NINFER_HOME", str(tmp_path))
    monkeypatch.setenv("NINFER_MODEL", runtime.RANDOM_MODEL)
    first = runtime.open_model(kv_capacity=1024, num_slots=8)
    made = runtime.random_model_dir()
    assert made.parent == tmp_path and (made / "config.json").exists()
    stamp = (made / "config.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = runtime.open_model(kv_capacity=1024, num_slots=8)
    assert (made / "config.json").stat().st_mtime_ns == stamp, "reused, not regenerated"
    assert again.model.identity == first.model.identity
    assert time.perf_counter() - t0 < 30
    engine = Engine(again.model, EngineConfig(spec="mtp"), blocks=again.blocks,
                    slots=again.slots)
    engine.recover()
    prompt = tuple(again.tokenizer.encode("Hello there, how are you?"))
    engine.submit(Submit("r1", prompt, "s", "t", SamplingParams(max_tokens=4)))
    run_until_idle(engine)
    r = engine.requests["r1"]
    assert r.state == "Finished" and r.outputs == again.model.reference_generate(prompt, 4)


def test_the_default_model_is_the_shipped_one_unless_named(monkeypatch, tmp_path):
    monkeypatch.delenv("NINFER_MODEL", raising=False)
    assert runtime.default_model() == (runtime.DEFAULT_FILE, runtime.DEFAULT_MODEL)
    assert runtime.DEFAULT_FILE.is_file()
    monkeypatch.setenv("NINFER_MODEL", str(tmp_path / "mine.ninfer"))
    assert runtime.default_model() == (tmp_path / "mine.ninfer", "mine")
