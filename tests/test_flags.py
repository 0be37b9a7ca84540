"""`ninfer.flags`: one object holds every behaviour switch of the GPU path; `override`
changes some for a block and puts them back; the code that acts reads them when it acts;
no other module reads a switch from the environment."""

import ast
from pathlib import Path

import pytest
import torch

import kernels
from kernels import pdl, skinny
from kernels.skinny import Tiles
from ninfer.flags import FLAGS, Flags, override
from ninfer.model.protocol import Lane
from ninfer.model.spec_graphs import MtpGraphs

ROOT = Path(__file__).resolve().parents[1]


def test_override_changes_what_it_names_for_the_block_and_restores_it_after():
    rows, ahead = FLAGS.skinny_rows, FLAGS.run_ahead
    with override(skinny_rows=4, verify_in_place=False) as flags:
        assert flags is FLAGS
        assert (FLAGS.skinny_rows, FLAGS.verify_in_place, FLAGS.run_ahead) == (4, False, ahead)
        with override(skinny_rows=0):  # nested: the inner value, then the outer one again
            assert FLAGS.skinny_rows == 0
        assert FLAGS.skinny_rows == 4
    assert (FLAGS.skinny_rows, FLAGS.verify_in_place) == (rows, True)


def test_override_restores_when_the_block_raises():
    with pytest.raises(RuntimeError), override(mtp_graph_span=1, gdn_step_tile=(8, 1)):
        raise RuntimeError("a capture failed")
    assert (FLAGS.mtp_graph_span, FLAGS.gdn_step_tile) == (8, None)


def test_an_unknown_flag_or_a_value_out_of_range_changes_nothing():
    before = vars(FLAGS).copy()
    with pytest.raises(TypeError), override(skinny_rows=4, no_such_flag=True):
        pass
    with pytest.raises(ValueError, match="skinny_rows"), override(skinny_rows=9):
        pass
    with pytest.raises(ValueError, match="mtp_graph_span"), override(mtp_graph_span=0):
        pass
    assert vars(FLAGS) == before


def test_the_two_environment_switches_give_their_flags_defaults(monkeypatch):
    assert Flags().pdl and Flags().zero_copy  # (the test environment sets neither)
    monkeypatch.setenv("NINFER_PDL", "0")
    monkeypatch.setenv("NINFER_ZERO_COPY", "0")
    assert not Flags().pdl and not Flags().zero_copy
    monkeypatch.setenv("NINFER_PDL", "1")
    assert Flags().pdl


def test_the_kernel_dispatch_reads_the_flags_when_it_is_called():
    x = torch.zeros(4, 8)
    assert kernels.kernels_for(x) is None  # CPU tensors take the torch references
    with override(interpret_on_cpu=True):
        if kernels.device_kernels() is None:
            pytest.skip("needs Triton")
        assert kernels.kernels_for(x) is not None
        assert kernels.skinny_for(x[:1]) is not None and kernels.skinny_for(x) is None
        with override(skinny_rows=4):
            assert kernels.skinny_for(x) is not None
        with override(skinny_rows=0):
            assert kernels.skinny_for(x[:1]) is None
        assert not pdl.enabled(x)  # never on the CPU, whatever the flag


def test_measured_tilings_come_first_on_a_gpu_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    rule = skinny.tiles_for(1, 1024, 2048, False, cuda)
    tuned = Tiles(16, 256, 2)
    assert rule != tuned
    with override(skinny_tiles={(True, 1024, 2048, False): tuned}):
        assert skinny.tiles_for(1, 1024, 2048, False, cuda) == tuned
        assert skinny.tiles_for(8, 1024, 2048, False, cuda) != tuned  # keyed by one row
        assert skinny.tiles_for(1, 1024, 2048, False, cpu) != tuned
    assert skinny.tiles_for(1, 1024, 2048, False, cuda) == rule


def test_the_mtp_catch_up_graphs_take_spans_up_to_the_flag():
    lane = Lane(slot=0, attn_blocks=[0], mtp_blocks=[1])
    assert MtpGraphs.fits(lane, 8) and not MtpGraphs.fits(lane, 9)
    with override(mtp_graph_span=1):
        assert MtpGraphs.fits(lane, 1) and not MtpGraphs.fits(lane, 2)


def test_no_module_but_the_flags_reads_a_switch_from_the_environment():
    """Every NINFER_ name in the package's and the kernels' code is the flags module's, but
    NINFER_HOME (where models are kept) and NINFER_MODEL (the model served when none is
    named): paths, not switches."""
    found = []
    for path in sorted([*(ROOT / "ninfer").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]):
        if path == ROOT / "ninfer" / "flags.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith("NINFER_") \
                    and node.value not in ("NINFER_HOME", "NINFER_MODEL"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert found == []
