"""`ninfer bench turn` on the session's server, at small sizes: turn 2 reuses turn 1, every
stage is measured, the served ones in the order they happen, and the table names each."""

from ninfer.bench.sized_prompts import PromptMaker
from ninfer.bench.turn import HOST, SERVED, one_turn, summary


def test_a_next_turn_measured_stage_by_stage(live, capsys):
    prompts = PromptMaker.for_model(None)
    runs = {n: [one_turn(live.url, live.server, live.journal_path, prompts, n, key=9100 + n)]
            for n in (256, 512)}
    results = summary(runs, 1)
    for n in (256, 512):
        run = runs[n][0]
        assert 0 < run["cached_tokens"] < run["prompt_tokens"]
        assert run["prompt_tokens"] - run["cached_tokens"] < 64   # the delta, not the whole
        assert all(run[key] > 0 for key, _ in [*SERVED, *HOST] if key != "prefilled_to_client")
        assert run["prefilled_to_client"] > -1   # the first token arrives after its prefill
        assert run["to_queued"] + run["queued_to_started"] + run["started_to_prefilled"] \
            <= run["ttft"] + 1
        assert run["journal_kib"] > 0
        delta = run["prompt_tokens"] - run["cached_tokens"]
        # a short delta is one forward, however many pieces its checkpoints cut it in
        assert run["pieces"] >= 2 and run["forwards"] == (1 if delta <= 32 else run["pieces"])
        assert results[f"ttft_ms_{n}"] == run["ttft"]
        assert results[f"forwards_n_{n}"] == run["forwards"]
    table = capsys.readouterr().out
    assert all(label in table for _, label in [*SERVED, *HOST])
