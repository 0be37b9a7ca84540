"""The behaviour switches of the GPU path, in one place.

Each default is what the product runs. A switch exists because a benchmark times the other
side of it (its "before", `ninfer.bench.gpu_engine`, `skinny`, `profile`) or because a test
runs a path it would not otherwise reach; both flip switches only through `override`,
never by setting an attribute of the module that reads them. Model and kernel code read
`FLAGS.<name>` when they act (at a launch, a capture, a forward), so an override takes
effect at the next such moment: a CUDA graph captured before it keeps what it captured
(`ninfer.bench.gpu_engine` drops the graphs around each switched run).

Two switches take their default from the environment, read once, when this module is first
imported (README.md, "On the GPU"): NINFER_PDL=0 turns programmatic dependent launch off,
NINFER_ZERO_COPY=0 turns the decode graphs' zero-copy staging off. No other module reads an
environment variable for a switch.

The flags are process-wide: `override` is for a benchmark or a test that drives the engine
on its own thread, not for a live server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernels.skinny import Tiles


def _env_on(name: str) -> bool:
    """An on/off switch from the environment: on unless set to "0"."""
    return os.environ.get(name, "1") != "0"


@dataclass
class Flags:
    """Every switch, with its default. Read the fields; change them with `override`."""

    pdl: bool = field(default_factory=lambda: _env_on("NINFER_PDL"))
    """Decode kernels launch with programmatic dependent launch on Hopper and later
    (`kernels.pdl`): each starts while the one before finishes. NINFER_PDL=0: off."""

    fence_in_kernel: bool = True
    """A zero-copy step's fence is kept by the GEMM after it, which loads its weights while
    the fencing kernel runs (`kernels.pdl.fence`); False: by a barrier kernel whatever
    comes next."""

    skinny_rows: int = 1
    """GEMMs of up to this many rows (B * T) take the skinny kernels, their neighbours
    folded in; more rows take cuBLAS (`kernels.skinny_for`). 0: none; at most 8. One row:
    on the H200 they made the batch-1 decode step 1.42x faster and the batch-8 one 0.89x
    (bench/results/skinny-h200.json), so a batch or a verify keeps cuBLAS."""

    skinny_tiles: Mapping[tuple[bool, int, int, bool], Tiles] = field(
        default_factory=lambda: MappingProxyType({}))
    """Measured tilings of the skinny GEMMs by (one row, N, K, glu), taken ahead of the
    rules of `kernels.skinny.tiles_for` on a GPU; `ninfer.bench.skinny` times the model
    with its sweep's best. Empty: the rules. Replace it; never change it in place."""

    early_conv: bool = True
    """The in-projection's conv epilogue reads the lanes' tails before its PDL wait
    (`kernels.skinny`; they are written only by earlier forwards or the host); False: after
    it."""

    skip_empty_splits: bool = True
    """Attention splits with no tile of their lane's positions end before their wait and
    write nothing, and the merge reads only the splits that worked
    (`kernels.paged_attention`); False: every split waits and writes an empty part."""

    wide_attention_tile: int = 32
    """KV positions per tile of the decode attention where heads are wider than 128 or the
    dtype is float32 (`kernels.decode_attention`; narrower bf16 heads take 64)."""

    gdn_step_tile: tuple[int, int] | None = None
    """(BV, num_warps) of a GDN decode step that names neither (`kernels.gdn_decode`);
    None: its own rules."""

    verify_in_place: bool = True
    """A verify on the GPU reads the lanes' GDN slot pools in place (`ninfer.model.gdn`);
    False: it gathers them into a copy first."""

    mtp_graph_span: int = 8
    """Longest MTP catch-up (a round's committed positions) replayed from a CUDA graph
    (`ninfer.model.spec_graphs`); 1: single entries only, a longer catch-up runs eagerly."""

    run_ahead: bool = True
    """The decode graphs launch the next greedy step before the engine asks for it
    (`ninfer.model.graphs`), and the engine reserves that step's block a step early."""

    zero_copy: bool = field(default_factory=lambda: _env_on("NINFER_ZERO_COPY"))
    """Decode graphs captured from now on read their inputs from, and write their greedy
    tokens to, pinned host memory themselves (`ninfer.model.graphs`); False: copies between
    replays (a benchmark that replays a graph itself needs this). NINFER_ZERO_COPY=0:
    off."""

    split_chunk_attention: bool = True
    """A prefill chunk of a shape the warm-up prepared (a whole chunk over whole chunks)
    takes its attention in two cuDNN calls, over the prefix and over itself, merged by their
    log-sum-exps (`ninfer.model.chunk_attention`); False: one flash call with the
    bottom-right causal mask, and nothing prepared."""

    interpret_on_cpu: bool = False
    """The model runs its Triton kernel paths on CPU tensors, in Triton's interpreter
    (TRITON_INTERPRET=1): how the tests reach the GPU path without a GPU
    (`kernels.kernels_for`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.skinny_rows <= 8:
            raise ValueError(f"skinny_rows is 0..8, not {self.skinny_rows}")
        if self.mtp_graph_span < 1:
            raise ValueError(f"mtp_graph_span is at least 1, not {self.mtp_graph_span}")


FLAGS = Flags()


@contextmanager
def override(**changes: Any) -> Iterator[Flags]:
    """FLAGS with `changes` (field names of Flags) for the body of the `with`, then the
    values they had before, also when the body raises. An unknown name is a TypeError and
    a value out of range a ValueError, before anything changes. Overrides nest."""
    wanted = replace(FLAGS, **changes)
    before = {name: vars(FLAGS)[name] for name in changes}
    vars(FLAGS).update({name: vars(wanted)[name] for name in changes})
    try:
        yield FLAGS
    finally:
        vars(FLAGS).update(before)
