"""`ninfer bench drafting` on the random tiny model, briefly: both servers answer, the greedy
replies are the same with and without drafting, and the JSON carries the figures."""

from __future__ import annotations

import json

from ninfer.bench import drafting


def test_the_drafting_bench_runs_and_compares_replies(tmp_path, capsys):
    out = tmp_path / "drafting.json"
    assert drafting.main(tokens=8, rounds=1, json_path=str(out)) == 0
    results = json.loads(out.read_text())["results"]
    assert results["same_replies"] is True
    assert results["none_tok_s"] > 0 and results["mtp_tok_s"] > 0
    assert results["speedup"] == results["mtp_tok_s"] / results["none_tok_s"]
    assert results["drafted"] > 0 and 0 <= results["acceptance"] <= 1   # read from /metrics
    assert "speed-up of mtp over none" in capsys.readouterr().out


def test_the_prompts_are_held_out_code():
    prompts = drafting.code_prompts(3, chars=200)
    assert len(prompts) == 3 and all(p.endswith("\n") and len(p) > 200 for p in prompts)
