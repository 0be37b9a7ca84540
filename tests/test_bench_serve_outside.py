"""`ninfer bench serve --outside`: one quick run end to end against real `ninfer serve`
processes on the tiny model (the figures' presence and sanity: the prompts were the sizes
asked, cold prompts reused nothing, the next turn reused its conversation, the mtp server
drafted), the prompts' token counts, and how the command picks the mode and names its file.
No figure's speed is asserted."""

from __future__ import annotations

import json

import pytest

from ninfer import cli
from ninfer.bench import serve, serve_outside
from ninfer.bench.serve_outside import SIZES, card_name, default_json_path
from ninfer.bench.sized_prompts import PromptMaker

QUICK = SIZES["cpu-quick"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("outside") / "serve.json"
    assert serve_outside.main(device="cpu", quick=True, json_path=str(out)) == 0
    return json.loads(out.read_text())["results"]


def test_the_server_is_timed_from_its_start(results):
    assert 0 < results["port_open_s"] <= results["ready_s"]
    assert results["mtp_ready_s"] > 0 and results["ready_warm_s"] > 0
    assert 0 <= results["warm_up_s"] < results["ready_s"]   # read from the server's log
    assert "warm_up_graphs" not in results                  # (none on the CPU)
    assert results["device"] == "cpu" and results["card"] == "cpu"
    options = results["server_options"]
    assert options[options.index("--max-concurrency") + 1] == str(results["max_concurrency"])
    context = int(options[options.index("--max-context") + 1])
    assert context >= QUICK.longest + QUICK.decode_tokens


def test_the_prompts_are_the_sizes_asked_and_cold_ones_reuse_nothing(results):
    for n in QUICK.first:
        assert results[f"first_prompt_tokens_{n}"] == n
        assert results[f"repeat_prompt_tokens_{n}"] == n
        assert results[f"first_over_repeat_{n}"] == pytest.approx(
            results[f"first_ttft_ms_{n}"] / results[f"repeat_ttft_ms_{n}"])
    for n in QUICK.cold:
        assert results[f"cold_prompt_tokens_{n}"] == n
        assert results[f"cold_cached_tokens_{n}"] == 0
        assert results[f"cold_ttft_ms_{n}"] > 0


def test_the_next_turn_reuses_the_conversation(results):
    """A probe that sent the next turn without the reply, or in another conversation, would
    prefill it from scratch: its reused tokens would not cover the first turn."""
    assert results["next_turn_reused"] is True
    for n in QUICK.next_turn:
        assert results[f"turn1_prompt_tokens_{n}"] == n
        cached = results[f"turn2_cached_tokens_{n}"]
        assert n + QUICK.reply_tokens - 1 <= cached < results[f"turn2_prompt_tokens_{n}"]
        # the new message and the markers around it (the reply's end, the next turn's start)
        assert QUICK.new_turn_tokens <= results[f"turn2_new_tokens_{n}"] <= \
            QUICK.new_turn_tokens + 8
        assert results[f"turn2_ttft_ms_{n}"] > 0
        # the turn again with another message reuses the history through the reply as well
        # (the random model's reply ids are not its text's encoding: a retry encoded whole
        # would reuse only the first turn's prompt)
        assert results[f"retry_cached_tokens_{n}"] >= n + QUICK.reply_tokens - 1
        assert results[f"retry_new_tokens_{n}"] <= QUICK.new_turn_tokens + 8
        assert results[f"retry_ttft_ms_{n}"] > 0


def test_decode_and_the_gap_beside_a_prefill_are_measured(results):
    for n in QUICK.streams:
        assert results[f"decode_tok_s_{n}"] > 0 and results[f"decode_first_run_tok_s_{n}"] > 0
        assert 0 < results[f"decode_gap_ms_median_{n}"] <= results[f"decode_gap_ms_p99_{n}"]
    assert results["prefill_covered"] is True and results["prefill_deltas_during"] >= 1
    assert results["prefill_long_prompt_tokens"] == QUICK.long_prefill
    assert results["prefill_gap_ratio"] == pytest.approx(
        results["prefill_gap_max_ms"] / results["prefill_gap_usual_ms"])


def test_decode_through_http_is_held_against_the_bare_engine_of_the_same_run(results):
    """Each stream count's bare-engine decode (same model, this process, after the servers)
    beside the HTTP total while every stream decoded, and their ratio (item 4's figure)."""
    for n in QUICK.streams:
        assert results[f"engine_decode_tok_s_{n}"] > 0
        together = results.get(f"decode_together_tok_s_{n}")
        if together is None:   # (streams that never all ran at once: no ratio)
            assert f"http_over_engine_{n}" not in results
            continue
        assert results[f"http_over_engine_{n}"] == pytest.approx(
            together / results[f"engine_decode_tok_s_{n}"])
    assert "decode_together_tok_s_1" in results   # one stream always runs "together"


def test_the_together_rate_counts_only_the_window_every_stream_decoded():
    from types import SimpleNamespace

    from ninfer.bench.serve_probes import together_rate
    a = SimpleNamespace(arrivals=[0.0, 1.0, 2.0, 3.0, 4.0], completion_tokens=10)  # 2 a delta
    b = SimpleNamespace(arrivals=[2.0, 2.5, 3.0, 3.5, 9.0], completion_tokens=5)   # 1 a delta
    # the window (2, 4]: a's deltas at 3 and 4 (4 tokens), b's at 2.5, 3, 3.5 (3 tokens)
    assert together_rate([a, b]) == pytest.approx(7 / 2)
    late = SimpleNamespace(arrivals=[5.0, 6.0], completion_tokens=2)
    assert together_rate([a, late]) is None


def test_the_mtp_server_drafted_and_is_compared_with_none(results):
    assert results["mtp_drafted_tokens"] > 0   # read from its /metrics: it really drafted
    for n in QUICK.mtp_streams:
        assert results[f"mtp_over_none_{n}"] == pytest.approx(
            results[f"mtp_decode_tok_s_{n}"] / results[f"decode_tok_s_{n}"])


def test_the_warm_up_figures_are_read_from_its_log_line(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("INFO ninfer.server: loading\n2026-12-06 INFO ninfer.server: warm-up: 7 "
                   "requests (2 from a stored state) in 3.2 s; 1,234 CUDA graphs (100 decode, "
                   "1,100 verify, 34 MTP) captured in 12.5 s, graph memory 2,048 MiB; 15.9 s "
                   "in all\n")
    assert serve_outside.warm_up_figures(log) == {
        "warm_up_s": 15.9, "warm_up_graphs": 1234, "graph_memory_mib": 2048}
    log.write_text("warm-up: 1 requests (0 from a stored state) in 0.1 s; 0.1 s in all\n")
    assert serve_outside.warm_up_figures(log) == {"warm_up_s": 0.1}
    log.write_text("INFO ninfer.server: warm-up: 3 kernel specialisations compiled or loaded; "
                   "any met after ready is logged as a warning\nWARNING ninfer.kernels: kernel "
                   "k met a new specialisation after ready (the warm-up missed this shape; this "
                   "request waits for it): k[num_warps=4](T: i32)\n")
    assert serve_outside.warm_up_figures(log) == {
        "kernels_after_ready": 1, "kernels_after_ready_list": ["k[num_warps=4](T: i32)"]}


def test_prompts_have_the_token_counts_asked():
    prompts = PromptMaker.for_model(None)
    for n in (26, 300, 2048):
        assert prompts.count(prompts.messages(n, key=n)) == n
    assert prompts.messages(300, key=1) != prompts.messages(300, key=2)
    history = [*prompts.messages(300, key=1), {"role": "assistant", "content": "Yes."}]
    follow = prompts.follow_up(history, 26, key=3)
    assert follow[:2] == history
    assert prompts.count(follow) - prompts.count(history, generation=False) == 26


@pytest.mark.parametrize("argv, outside", [
    ([], False), (["--outside"], True), (["--device", "cuda"], True),
    (["--model", "/models/anchor-1b"], True)])
def test_the_mode_follows_the_options(monkeypatch, argv, outside):
    calls, inside = [], []
    monkeypatch.setattr(serve_outside, "main", lambda **kw: calls.append(kw) or 0)
    monkeypatch.setattr(serve, "run", lambda args: inside.append(args) or 0)
    args = cli.build_parser().parse_args(["bench", "serve", *argv, "--server-args",
                                          "--prefill-chunk 4096"])
    assert args.func(args) == 0
    assert (len(calls), len(inside)) == ((1, 0) if outside else (0, 1))
    if outside:
        assert calls[0]["extra"] == ["--prefill-chunk", "4096"]
        assert calls[0]["device"] == args.device and calls[0]["model"] == args.model


def test_the_card_names_the_file(monkeypatch):
    import torch
    for name, card in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                       ("NVIDIA GeForce RTX 4090", "4090")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert card_name("cuda") == card
    assert card_name("cpu") == "cpu"
    assert default_json_path("cuda", "h100") == "bench/results/serve-cuda-h100.json"
    assert default_json_path("cpu", "cpu") is None


def test_a_cuda_run_reports_against_the_issue_goals(results, tmp_path, monkeypatch):
    """The CUDA path's reporting, without a GPU: the figures of the CPU run standing in for
    a CUDA run's; the goals of the sizes measured are checked, the JSON goes to the card's
    file, and the server got the GPU's options."""
    seen = {}

    def measure(options, sizes, prompts, mtp=True):
        seen["options"] = options
        return {k: v for k, v in results.items() if k not in ("device", "card")}
    monkeypatch.setattr(serve_outside, "measure", measure)
    monkeypatch.setattr(serve_outside, "engine_baseline", lambda *args: {})  # (in `results`)
    monkeypatch.setattr(serve_outside, "card_name", lambda device: "h100")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    assert serve_outside.main(device="cuda", sizes=QUICK) == 0
    doc = json.loads((tmp_path / "bench/results/serve-cuda-h100.json").read_text())
    # the rest: not measured at these sizes
    assert set(doc["targets"]) == {"ready_s", "ready_warm_s", "prefill_gap_ratio"}
    assert doc["results"]["card"] == "h100" and doc["results"]["max_concurrency"] == 8
    options = seen["options"]
    assert options[options.index("--device") + 1] == "cuda"
    assert options[options.index("--dtype") + 1] == "bfloat16"
    assert options[options.index("--prefill-chunk") + 1] == "8192"   # the GPU default


def test_on_cuda_the_server_logs_its_slow_steps_and_sizes_its_own_pool():
    from ninfer.bench.serve_outside import SLOW_STEP_MS, server_options, sizes_for
    cuda = server_options("cuda", "m", sizes_for("cuda", True), 8, [])
    assert cuda[cuda.index("--log-slow-steps") + 1] == str(SLOW_STEP_MS)
    assert "--kv-capacity" not in cuda
    cpu = server_options("cpu", None, sizes_for("cpu", True), 2, [])
    assert "--log-slow-steps" not in cpu and "--kv-capacity" in cpu
    from ninfer.cli import build_parser
    args = build_parser().parse_args(["serve", *cuda])
    assert args.log_slow_steps == SLOW_STEP_MS and args.model == "m"
    for bad in ("0", "-5"):   # a threshold of nothing would log every step
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--log-slow-steps", bad])
