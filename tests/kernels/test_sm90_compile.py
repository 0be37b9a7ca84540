"""Every Triton kernel compiles for sm_90 (the H200) on this machine, GPU or not: the
interpreter that runs the other kernel tests in CI accepts code the compiler rejects, and
the decode path's kernels compile without spilling to the stack (spills made them slow on
the H200; `tests.kernels.sm90`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]  # where `tests.kernels.sm90` imports from
# kernels of the batch-1 decode step and its neighbours: registers only, no stack
NO_SPILL = ("_skinny_kernel", "_gdn_decode_kernel", "_decode_attention_kernel",
            "_paged_attn_merge_kernel", "_decode_start_kernel", "_conv_update_kernel",
            "_qk_norm_gates_kernel", "_rms_norm_kernel")


def _compiled(args: list[str]) -> subprocess.CompletedProcess:
    """python args, in a process of its own (`tests.kernels.sm90` patches the kernel
    modules) with compiled kernels, not the interpreter; it must succeed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="with a GPU the kernel tests compile and run every kernel")
def test_every_kernel_compiles_for_sm90_and_the_decode_kernels_do_not_spill():
    run = _compiled(["-m", "tests.kernels.sm90"])
    rows = dict(line.split(None, 1) for line in run.stdout.splitlines() if line.strip())
    for kernel in ("_state_kernel", "_solve_kernel", "_output_kernel", "_prologue_kernel",
                   "_paged_attn_split_kernel", "_greedy_keys_kernel", "_rope_kernel",
                   "_gate_mul_kernel", "_gated_norm_kernel", "_publish_keys_kernel",
                   *NO_SPILL):
        assert kernel in rows, f"{kernel} was not compiled"
    for kernel in NO_SPILL:
        stacks = [int(s) for s in re.findall(r"stack (\d+)", rows[kernel])]
        assert stacks and max(stacks) == 0, f"{kernel} spills: {rows[kernel]}"


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="compiled for sm_90 without a GPU: CI's check of the kernels' code")
def test_the_in_projection_loads_its_conv_tails_before_its_pdl_wait():
    """The conv epilogue's reads of the slot pool (the slot, the tail, the weights) are
    issued before the wait, so their dependent round trips overlap the kernel before
    (the flag `early_conv`, `ninfer.flags`): the in-projection with the conv issues more loads there
    than without it. Not where the kernel keeps a fence (`kernels.pdl`)."""
    run = _compiled(["-c", "import json; from tests.kernels.sm90 import "
                     "in_projection_early_loads as f; print(json.dumps(f()))"])
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts["plain"] > 0, counts  # the weights: loaded before the wait as ever
    assert counts["conv"] > counts["plain"], counts
    # the kernel that keeps a fence (the first after a fetching decode_start): its weights
    # before the wait, the conv's reads after it, and its dependents launched after it
    assert counts["fenced"] == counts["plain"], counts
    assert counts["conv_dependents_early"] and not counts["fenced_dependents_early"], counts
