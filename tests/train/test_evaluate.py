"""The evaluation's judges: what counts as a valid tool call, a parsing answer, and the bits
per byte (against a forward computed here, and xz on the same bytes)."""

import lzma
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.model.hybrid import HybridState
from ninfer.model.runtime import open_model
from ninfer.train import evaluate, loop
from ninfer.train.recipe import TrainSettings, smoke_shape

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"},
                                           "width": {"type": "integer"},
                                           "ratio": {"type": "number"},
                                           "strict": {"type": "boolean"}},
          "required": ["text"]}


@pytest.mark.parametrize("arguments, ok", [
    ({"text": "a"}, True),
    ({"text": "a", "width": 3, "ratio": 2, "strict": False}, True),
    ({"text": "a", "ratio": 0.5}, True),
    ({}, False),                                 # a required parameter missing
    ({"text": 1}, False),                        # of the wrong type
    ({"text": "a", "width": True}, False),       # a bool is no integer
    ({"text": "a", "width": 2.5}, False),
    ({"text": "a", "depth": 1}, False),          # a parameter the tool does not have
    ([], False),
])
def test_arguments_validate_against_the_tools_schema(arguments, ok):
    assert evaluate.validates(arguments, SCHEMA) is ok


@pytest.mark.parametrize("reply, call", [
    ('<tool_call>\n{"name": "fill", "arguments": {"text": "x"}}\n</tool_call>',
     evaluate.Call("fill", {"text": "x"})),
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', evaluate.Call("f", {})),
    ('<tool_call>\n{"name": "fill", "arguments": {"text": "x"}}', None),  # never closed
    ('<tool_call>\n{"name": "fill", "arguments": "{}"}\n</tool_call>', None),
    ('<tool_call>\n{"name": "fill", "arguments": {"text": }}\n</tool_call>', None),
    ('{"name": "fill", "arguments": {}}', None),
])
def test_a_call_is_well_formed_only_between_its_tags_as_an_object(reply, call):
    assert evaluate.first_call(reply) == call


def _tool_item(request: str):
    from ninfer.train.examples import Example
    tools = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}}
             for n in ("fill", "wrap")]
    return Example("tools", [{"role": "user", "content": request}], tools,
                   '{"name": "fill", "arguments": {"text": "a"}}')


@pytest.mark.parametrize("call, outcome", [
    (None, "no_call"),
    (evaluate.Call("fill", {"text": "b"}), "valid"),
    (evaluate.Call("wrap", {"text": "b"}), "valid_other_tool"),
    (evaluate.Call("wrap", {"depth": 1}), "other_tool"),
    (evaluate.Call("fill", {"width": 1}), "bad_arguments"),
    (evaluate.Call("heappushpop", {"text": "b"}), "unlisted_tool"),
])
def test_each_tool_reply_has_one_outcome(call, outcome):
    assert evaluate.tool_outcome(_tool_item("Please call fill."), call) == outcome


def test_tool_prompts_are_grouped_by_tools_listed_and_whether_the_request_names_it():
    assert evaluate.tool_groups(_tool_item("Please call fill with text.")) == (
        "tools_listed_2", "names_it")
    assert evaluate.tool_groups(_tool_item("Fill a paragraph.")) == (
        "tools_listed_2", "describes_it")


def test_an_answer_counts_when_python_parses_it():
    assert evaluate.parses("def f(x):\n    return x\n")
    assert evaluate.parses("\n\ndef f():\n    pass")
    assert not evaluate.parses("  def f():\n    pass")
    assert not evaluate.parses("def f(x):\n    return (x\n")
    assert not evaluate.parses("x = '\x00'")


@pytest.fixture(scope="module")
def model(slice_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval") / "m.ninfer"
    settings = TrainSettings(steps=2, batch=2, seq_len=32, warmup=1, mtp_depth=1, eval_every=0,
                             checkpoint_every=0)
    loop.train(slice_corpus, out, settings=settings, config_overrides=smoke_shape(),
               progress=False)
    return open_model(out, kv_capacity=4096, num_slots=8)


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 300), window=st.integers(2, 64), data=st.data())
def test_sliding_windows_score_every_token_once_with_the_context_promised(length, window, data):
    stride = data.draw(st.integers(1, window - 1))
    windows = evaluate.scored_windows(length, window, stride)
    scored = [t for begin, end, first in windows for t in range(first, end)]
    assert scored == list(range(1, length))
    for begin, end, first in windows:
        assert 0 <= begin < first < end <= length and end - begin <= window
        assert first - begin >= min(first, window - stride)   # the context it promises


@pytest.mark.parametrize("stride", [0, 8, 9])
def test_a_stride_that_scores_nothing_or_leaves_no_context_is_refused(stride):
    with pytest.raises(ValueError, match="stride"):
        evaluate.scored_windows(20, 8, stride)


@pytest.mark.parametrize("window,stride", [(8, 4), (8, 7), (4096, 2048)])
def test_bits_per_byte_are_the_models_nats_per_byte_and_xz_is_lzma_9(model, window, stride):
    """Each token's loss computed alone, from the context its window gives it (a causal
    model's prediction of a token does not depend on what follows it in a window)."""
    texts = ["def add(a, b):\n    return a + b\n", "x = [i * i for i in range(10)]\n"]
    got = evaluate.bits_per_byte(model, texts, window=window, stride=stride)
    tok, net = model.tokenizer, model.model.net
    nats = 0.0
    with torch.inference_mode():
        for text in texts:
            seq = [tok.special.endoftext, *tok.encode(text)]
            for begin, end, first in evaluate.scored_windows(len(seq), window, stride):
                for t in range(first, end):
                    piece = torch.tensor([seq[begin:t]])
                    state = HybridState.initial(net.config, 1, torch.float32)
                    logits = net.forward(piece, torch.arange(t - begin)[None], state).logits
                    nats += float(F.cross_entropy(logits[0, -1:], torch.tensor([seq[t]])))
    data = "".join(texts).encode()
    assert got["bits_per_byte"] == pytest.approx(nats / math.log(2) / len(data), rel=1e-5)
    assert got["xz_bits_per_byte"] == 8 * len(lzma.compress(data, preset=9)) / len(data)
    assert got["bytes"] == len(data) and got["stride"] == stride


def test_every_part_runs_on_a_slice(model, slice_corpus):
    figures = evaluate.evaluate(model, slice_corpus, limit=2, max_tokens=12,
                                continuation_tokens=24, progress=False)
    assert figures["corpus_sha256"] == slice_corpus.sha256
    assert figures["docstrings"]["prompts"] == 2 and figures["tools"]["prompts"] == 2
    assert 0 <= figures["tools"]["share"] <= 1
    runs = figures["drafting"]["runs"]
    assert set(runs) == {"none", "mtp1", "mtp2", "mtp3", "ngram3", "mtp3_adaptive"}
    # each continuation decodes its 24 tokens after the prefill's first, however drafted
    assert all(r["tokens"] == 2 * (24 - 1) for r in runs.values())
    assert runs["none"]["tokens_per_verify"] == 1.0 and runs["none"]["drafted"] == 0
    # fixed lengths: every round drafts k (the random model's head never agrees: one token
    # a round) but the last three of each continuation (1 + 2 + 3 short of k), whatever
    # the acceptance; adaptive drafting pauses
    fixed = runs["mtp3"]
    assert fixed["drafted"] >= 3 * fixed["verifies"] - 2 * 6 > runs["mtp3_adaptive"]["drafted"]
    assert not runs["mtp3"]["adaptive"] and runs["mtp3_adaptive"]["adaptive"]


def test_the_goals_are_judged_from_the_figures_the_report_holds():
    figures = {"bpb": {"ratio_to_xz": 0.649}, "tools": {"share": 0.665},
               "drafting": {"runs": {"mtp3": {"tokens_per_verify": 3.28}}}}
    rows = {r["figure"]: r for r in evaluate.goals(figures)}
    assert set(rows) == {"bpb.ratio_to_xz", "tools.share",
                         "drafting.runs.mtp3.tokens_per_verify"}   # no docstrings: absent
    assert rows["bpb.ratio_to_xz"]["met"] and rows["bpb.ratio_to_xz"]["<="] == 0.7
    assert not rows["tools.share"]["met"] and rows["tools.share"][">="] == 0.8
    assert rows["drafting.runs.mtp3.tokens_per_verify"]["met"]
    table = evaluate.goals_table(evaluate.goals(figures))
    assert "tool calls valid" in table and "NO" in table and table.count("yes") == 2
