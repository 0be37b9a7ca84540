"""`ninfer serve`'s options where their defaults depend on the machine."""

import argparse

import httpx
import pytest
import torch

from ninfer.server.serve import add_serve_parser, default_dtype, default_prefill_chunk, load


def _args(*argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    return add_serve_parser(sub).parse_args(list(argv))


def test_prefill_chunk_and_dtype_default_to_the_device_and_explicit_ones_win(tmp_path):
    # a GPU forward's host time does not grow with its tokens: bigger chunks there; and its
    # decode kernels are tuned for bf16
    assert default_prefill_chunk("cpu") == 512
    assert default_prefill_chunk("cuda") == default_prefill_chunk("cuda:1") == 8192
    assert default_dtype("cpu") == "float32"
    assert default_dtype("cuda") == default_dtype("cuda:1") == "bfloat16"
    for argv, chunk, dtype in (([], 512, torch.float32),
                               (["--prefill-chunk", "48", "--dtype", "float64"], 48,
                                torch.float64)):
        args = _args("--journal", str(tmp_path / f"j{chunk}.db"), "--torch-threads", "1",
                     *argv)
        loaded = load(args)
        try:
            engine = loaded.thread.engine
            assert engine.config.prefill_chunk == chunk
            assert engine.model.dtype == dtype
        finally:
            loaded.thread.stop()


def test_model_aliases_reasoning_budget_and_claude_names_reach_the_settings():
    import pytest

    from ninfer.server.serve import settings_from
    plain = settings_from(_args(), "tiny")
    assert (plain.model_aliases, plain.reasoning_budget, plain.claude_names) == ((), None, True)
    from ninfer.model.runtime import DEFAULT_KV_CAPACITY
    # an agent's prompt; the pool is sized at load (a GPU's free memory, else the default)
    assert (plain.max_context, _args().kv_capacity, DEFAULT_KV_CAPACITY) == (
        65_536, None, 131_072)
    set_ = settings_from(_args("--model-alias", "a=tiny", "--model-alias", "b=tiny",
                               "--reasoning-budget", "0", "--no-claude-names"), "tiny")
    assert (set_.model_aliases, set_.reasoning_budget, set_.claude_names) == (
        ("a", "b"), 0, False)
    with pytest.raises(SystemExit, match="serves 'tiny'"):
        settings_from(_args("--model-alias", "a=other"), "tiny")
    with pytest.raises(SystemExit):
        _args("--model-alias", "no-equals-sign")


def test_decode_gap_defaults_to_3_and_refuses_a_gap_that_paces_nothing(capsys):
    import pytest

    from ninfer.server.serve import _decode_gap, _paced_from
    # a GPU paces prompts over 2048 tokens in chunks of 2048 or more; the CPU from one chunk
    assert _paced_from(_args("--device", "cuda"), 8192) == 2048
    assert _paced_from(_args("--device", "cuda"), 1024) == 1024
    assert _paced_from(_args(), 512) == 0
    assert _decode_gap(_args()) == 3.0
    assert _decode_gap(_args("--device", "cuda")) == 3.0
    assert _decode_gap(_args("--decode-gap", "0")) == 0.0
    assert _decode_gap(_args("--decode-gap", "2.5", "--device", "cuda")) == 2.5
    for bad in ("0.5", "1", "-2"):
        with pytest.raises(SystemExit):
            _args("--decode-gap", bad)
        assert "more than 1 step" in capsys.readouterr().err


def test_lanes_reach_the_largest_graph_batch_and_slots_follow_them(capsys):
    from ninfer.model.graphs import SIZES
    from ninfer.server.serve import MAX_LANES, check_slots, state_slots
    assert MAX_LANES == SIZES[-1] == 64   # a decode graph for every batch a server runs
    args = _args("--max-concurrency", "64")
    assert args.max_concurrency == 64 and state_slots(args) == 128 and check_slots(args) is None
    assert state_slots(_args("--max-concurrency", "8")) == 96
    with pytest.raises(SystemExit):
        _args("--max-concurrency", "65")
    assert "between 1 and 64" in capsys.readouterr().err
    short = _args("--max-concurrency", "32", "--state-slots", "32")
    assert "--state-slots 64" in check_slots(short)


def test_the_process_start_is_read_before_now_and_after_boot():
    """`process_started` (the start-up log's "since the process started") reads this
    process's start: a moment before now and, on Linux, before this module ran."""
    import time

    from ninfer.server.serve import _IMPORTED, process_started
    started = process_started()
    assert started <= _IMPORTED + 1e-3 and time.time() - started < 24 * 3600


def test_what_loading_made_is_out_of_the_collectors_way_once_ready(live):
    """The cyclic collector's full passes over everything loading made (the model's modules,
    the tokenizer, the template, the libraries' objects) stalled a request for 100 ms and
    more at 32K contexts: the server freezes them before it says it is ready."""
    import gc
    assert httpx.get(f"{live.url}/health", timeout=5).status_code == 200
    assert gc.get_freeze_count() > 10_000
