"""The recipe on the CPU, in seconds: a few steps of a small shape on a slice of the corpus;
the loss falls, the file loads with the normal loader and answers a prompt. And the default
shape fits the 16 MiB the issue allows."""

import dataclasses
import json

import pytest
import torch

from ninfer.model.config import ModelConfig, expected_tensors
from ninfer.model.loader import load_files
from ninfer.model.runtime import open_model
from ninfer.train import evaluate, loop, weights
from ninfer.train.recipe import MAX_WEIGHT_BYTES, TrainSettings, smoke_shape, trained_config

SMOKE = TrainSettings(steps=40, batch=8, seq_len=64, lr=4e-3, min_lr=4e-4, warmup=4,
                      mtp_depth=2, eval_every=20, checkpoint_every=25, whole_chats=True)


def test_the_default_shape_is_a_qwen35_hybrid_within_16_mib():
    config = trained_config(8192, endoftext=8183, im_end=8185)
    assert config.family == "qwen3_5" and not config.is_moe and config.mtp_num_hidden_layers
    assert config.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    assert weights.weight_bytes(config) <= MAX_WEIGHT_BYTES
    assert any(name.startswith("mtp.") for name in expected_tensors(config))
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_the_learning_rate_warms_up_then_decays_to_its_floor():
    s = TrainSettings(lr=1e-3, min_lr=1e-4, warmup=10)
    lrs = [loop.lr_at(i, 100, s) for i in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(1e-4, rel=0.01)


def test_windows_are_drawn_from_the_seed():
    tokens = torch.arange(1000)
    a, b = loop.Windows(tokens, 16, seed=3), loop.Windows(tokens, 16, seed=3)
    first = a.next(4)
    assert torch.equal(first, b.next(4)) and first.shape == (4, 17)
    assert torch.equal(first[:, 1:] - first[:, :-1], torch.ones(4, 16, dtype=torch.int64))


def _stream() -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Documents ended by 0: source files (tokens 10..) and chats (starting with 1, a call
    marked 2), and the chats' (first, last) positions."""
    docs, chats, at = [], [], 0
    for i in range(60):
        doc = [1] + [5] * (3 + i % 7) + [2, 6, 6] if i % 3 else [10 + i % 5] * (20 + i % 11)
        if doc[0] == 1:
            chats.append((at, at + len(doc)))
        docs += doc + [0]
        at += len(doc) + 1
    return torch.tensor(docs), chats


def test_chat_spans_are_the_documents_that_open_a_conversation():
    tokens, chats = _stream()
    first, last = loop.chat_spans(tokens, endoftext=0, im_start=1)
    assert list(zip(first.tolist(), last.tolist(), strict=True)) == chats
    first, last = loop.chat_spans(torch.tensor([1, 5, 5]), endoftext=0, im_start=1)
    assert first.tolist() == last.tolist() == []   # no document ends: nothing to start at


def test_whole_chat_windows_read_every_chat_from_its_first_token():
    tokens, chats = _stream()
    spans = loop.chat_spans(tokens, endoftext=0, im_start=1)
    whole = loop.Windows(tokens, 12, seed=5, chats=spans)
    cut = loop.Windows(tokens, 12, seed=5)
    cut_calls = snapped = 0
    for _ in range(50):
        a, b = whole.next(8), cut.next(8)
        for w, c in zip(a.tolist(), b.tolist(), strict=True):
            # a window that opened in a source file is the one drawn; one drawn inside a chat
            # opens at its first token, so each call it holds comes after that chat's start
            snapped += w != c
            assert w == c or w[0] == 1
            for row in (w, c):
                for p in (p for p, t in enumerate(row) if t == 2):
                    opened = 1 in row[:p]
                    if row is w:
                        assert opened
                    cut_calls += not opened
    assert snapped > 0 and cut_calls > 0  # the plain draw does cut chats; whole ones do not
    again = loop.Windows(tokens, 12, seed=5, chats=spans)
    assert torch.equal(again.next(8), loop.Windows(tokens, 12, seed=5, chats=spans).next(8))


def test_the_share_of_calls_cut_off_from_their_tools_is_what_windows_draw():
    tokens, chats = _stream()
    spans = loop.chat_spans(tokens, endoftext=0, im_start=1)
    into = [tokens[a:b].tolist().index(2) for a, b in chats]   # each call's offset
    assert loop.calls_cut_off(tokens, spans, 2, 12, whole=False) == pytest.approx(
        sum(min(p / 12, 1) for p in into) / len(into))
    assert loop.calls_cut_off(tokens, spans, 2, 12, whole=True) == 0.0
    # a window shorter than a conversation's way to its call cuts it even when whole
    assert loop.calls_cut_off(tokens, spans, 2, 6, whole=True) == pytest.approx(
        sum(p >= 6 for p in into) / len(into))
    assert loop.calls_cut_off(tokens, spans, 99, 12, whole=False) is None


@pytest.fixture(scope="module")
def trained(slice_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "smoke.ninfer"
    report_path = out.with_suffix(".json")
    report = loop.train(slice_corpus, out, settings=SMOKE, config_overrides=smoke_shape(),
                        report_path=report_path, progress=False)
    return out, report, report_path


def test_a_few_steps_lower_the_loss_and_write_a_report(trained, slice_corpus):
    out, report, report_path = trained
    assert json.loads(report_path.read_text()) == json.loads(json.dumps(report))
    first, last = report["losses"][0], report["losses"][-1]
    assert last["main"] < first["main"] - 1.0
    assert all(a > b for a, b in zip(first["mtp"], last["mtp"], strict=True))
    assert report["heldout"][-1]["loss"] < report["heldout"][0]["loss"] + 0.5
    assert report["steps_done"] == SMOKE.steps and report["tokens"] == 40 * 8 * 64
    assert report["corpus"]["sha256"] == slice_corpus.sha256
    # windows of 64 tokens: every call lies further than that into its conversation
    assert report["corpus"]["tool_calls_cut_off"] == 1.0
    assert report["settings"]["seed"] == 0 and report["config"]["model_type"] == "qwen3_5_text"


def test_the_report_says_whether_its_windows_cut_chats_off_their_tools(slice_corpus,
                                                                        tmp_path,
                                                                        monkeypatch):
    """`whole_chats` reaches the windows (they get the chats' spans) and the report: with
    windows longer than a conversation's way to its call none is cut off; drawn anywhere,
    some are."""
    given = []
    real = loop.Windows
    monkeypatch.setattr(loop, "Windows", lambda *a, **kw: (given.append(a[3:]), real(*a))[1])
    shares = {}
    for whole in (True, False):
        settings = dataclasses.replace(SMOKE, steps=1, seq_len=512, eval_every=0,
                                       checkpoint_every=0, whole_chats=whole)
        report = loop.train(slice_corpus, tmp_path / f"{whole}.ninfer", settings=settings,
                            config_overrides=smoke_shape(), progress=False)
        shares[whole] = report["corpus"]["tool_calls_cut_off"]
    assert shares[True] < 0.05 < shares[False]
    (whole_chats,), (anywhere,) = given
    assert whole_chats is not None and len(whole_chats[0]) > 0 and anywhere is None


def test_the_written_file_loads_and_answers_a_prompt(trained):
    out, report, _ = trained
    [checkpoint] = report["checkpoints"]
    assert checkpoint == {"step": 25, "path": str(loop.checkpoint_path(out, 25))}
    assert load_files(checkpoint["path"]).config == load_files(out).config
    files = load_files(out)
    assert all(t.dtype == torch.bfloat16 for t in files.tensors.values())
    assert files.config.tie_word_embeddings and files.config.mtp_num_hidden_layers == 1
    om = open_model(out, kv_capacity=4096, num_slots=8)
    prompt = om.template.render([{"role": "user", "content": "Quote a string."}],
                                add_generation_prompt=True)
    assert prompt.endswith("</think>\n\n")  # thinking off by default
    [reply] = evaluate.generate(om, [om.tokenizer.encode(prompt)], max_tokens=8)
    assert 1 <= reply.tokens <= 8


def test_the_same_seed_trains_the_same_weights(slice_corpus, tmp_path):
    settings = dataclasses.replace(SMOKE, steps=3, eval_every=0)
    a = loop.train(slice_corpus, tmp_path / "a.ninfer", settings=settings,
                   config_overrides=smoke_shape(), progress=False)
    b = loop.train(slice_corpus, tmp_path / "b.ninfer", settings=settings,
                   config_overrides=smoke_shape(), progress=False)
    assert a["out_sha256"] == b["out_sha256"]
    assert [e["loss"] for e in a["losses"]] == [e["loss"] for e in b["losses"]]


def test_minutes_fix_the_step_count_from_the_first_steps_and_record_it(slice_corpus, tmp_path):
    settings = dataclasses.replace(SMOKE, steps=10**6, batch=2, seq_len=32, eval_every=0)
    report = loop.train(slice_corpus, tmp_path / "m.ninfer", settings=settings, minutes=0.05,
                        config_overrides=smoke_shape(), progress=False, log=lambda _: None)
    assert loop.CALIBRATION_STEPS + 2 < report["steps_planned"] < 10**6
    assert report["steps_done"] <= report["steps_planned"]
    assert report["seconds_per_step_calibrated"] > 0 and report["minutes"] == 0.05


def test_the_commands_train_and_evaluate(slice_corpus, tmp_path, capsys):
    from ninfer.cli import main
    out, report, figures = tmp_path / "m.ninfer", tmp_path / "r.json", tmp_path / "e.json"
    assert main(["train", "run", "--corpus", str(slice_corpus.path), "--out", str(out),
                 "--report", str(report), "--shape", "smoke", "--steps", "3", "--batch", "2",
                 "--seq-len", "32", "--checkpoint-every", "2", "--quiet"]) == 0
    written = json.loads(report.read_text())
    assert written["steps_done"] == 3 and written["settings"]["batch"] == 2
    assert [c["step"] for c in written["checkpoints"]] == [2]
    assert main(["train", "eval", str(out), "--corpus", str(slice_corpus.path), "--parts",
                 "bpb", "--limit", "1", "--json", str(figures), "--quiet"]) == 0
    written = json.loads(figures.read_text())
    bpb = written["bpb"]
    assert bpb["files"] == 1 and bpb["bits_per_byte"] > 0
    assert [g["figure"] for g in written["goals"]] == ["bpb.ratio_to_xz"]
    assert "bits per byte / xz -9's" in capsys.readouterr().err   # the goals' table


def test_a_share_or_stride_out_of_range_is_refused_by_name(slice_corpus, tmp_path, capsys):
    from ninfer.cli import main
    for bad in ("1.5", "-0.1"):
        with pytest.raises(SystemExit) as exit_:
            main(["train", "corpus", str(tmp_path / "c"), "--made-up-tools", bad])
        assert exit_.value.code == 2 and "--made-up-tools" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    for window, stride in (("64", "64"), ("64", "0")):
        assert main(["train", "eval", "x.ninfer", "--corpus", str(slice_corpus.path),
                     "--window", window, "--stride", stride]) == 2
        assert "--stride" in capsys.readouterr().err
