"""`python -m ninfer.bench.l2 [out.json]` (a GPU): the L2 prefetcher beside the decode step
(`kernels.prefetch`), swept. anchor-1b with random bf16 weights built on the device.

- `alone`: the prefetcher by itself over the step's whole weight stream, every piece
  released at once, by number of programs: how fast it can ask for the stream (GB/s).
- `b1`: the batch-1 decode graph captured afresh for each lead (NINFER_L2_AHEAD, MiB; 0:
  no prefetcher, the baseline of the same run), prefetch size (NINFER_L2_CHUNK) and number
  of programs (NINFER_L2_PROGRAMS), timed by CUDA events: the median of three runs of 200
  back-to-back replays, and the ratio of each to the baseline."""

from __future__ import annotations

import os
import sys

from .report import write_line

AHEAD_MIB = (0, 4, 8, 16, 32)
CHUNKS = (16384, 65536)
PROGRAMS = (1, 4, 16, 32)


def _alone(plan, events_us) -> dict:
    """The prefetcher over plan's stream with every piece released at once, by programs."""
    import torch

    from kernels import prefetch
    pieces = [(a, n, 0) for a, n, _ in plan.pieces()]
    table = torch.tensor(pieces, dtype=torch.int64, device="cuda").view(-1, 3)
    progress = torch.zeros(2, dtype=torch.int32, device="cuda")
    total = sum(n for _, n, _ in pieces)
    rows = {}
    for programs in PROGRAMS:
        us = events_us(lambda p=programs: prefetch.launch_prefetcher(
            table, progress, 0, plan.chunk, programs=p), 20)
        rows[f"programs{programs}"] = {"us": us, "GBps": total / us / 1e3}
        print(f"  alone, {programs:2} programs: {us:8.1f} us, {total / us / 1e3:7.1f} GB/s",
              file=sys.stderr, flush=True)
    return {"bytes": total, **rows}


def main(json_path: str | None = None) -> int:
    import torch

    from kernels import prefetch

    from ..engine.model import Lane
    from ..model.graphs import DecodeGraphs
    from .skinny import _events_us, anchor_model
    m = anchor_model()
    lane = Lane(slot=0, attn_blocks=list(range(64)))
    rows: dict = {}

    def replay(key: str, mib: float) -> None:
        os.environ["NINFER_L2_AHEAD"] = str(mib)
        m.graphs = DecodeGraphs(m)  # captured afresh under this setting
        m.forward_batch([(lane, [7], 1000)])
        graph = m.graphs.graphs[(1, 64)].graph
        runs = sorted(_events_us(graph.replay, 200) for _ in range(3))
        rows[key] = {"replay_us": runs[1], "runs": runs}
        print(f"{key:>30}: {runs[1]:7.1f} us", file=sys.stderr, flush=True)

    default_programs = prefetch.PROGRAMS
    for chunk in CHUNKS:
        prefetch.CHUNK = chunk
        for mib in AHEAD_MIB if chunk == CHUNKS[0] else AHEAD_MIB[1:]:
            replay("none" if mib == 0 else f"ahead{mib}_chunk{chunk // 1024}k", mib)
    alone = _alone(m.graphs.graphs[(1, 64)].plan, _events_us)
    for programs in PROGRAMS:
        if programs != default_programs:
            prefetch.PROGRAMS = programs
            replay(f"ahead16_chunk{CHUNKS[-1] // 1024}k_programs{programs}", 16)
    prefetch.PROGRAMS = default_programs
    os.environ.pop("NINFER_L2_AHEAD")
    base = rows["none"]["replay_us"]
    for row in rows.values():
        row["speedup"] = base / row["replay_us"]
    write_line({"bench": "l2", "results": {"device": torch.cuda.get_device_name(),
                                           "programs": default_programs, "alone": alone,
                                           "b1": rows}}, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
