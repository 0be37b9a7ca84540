"""`python -m ninfer.bench.l2 [out.json]` (a GPU): the L2 prefetcher beside the decode step
(`kernels.prefetch`), swept. anchor-1b with random bf16 weights built on the device, its
batch-1 decode graph captured afresh for each lead (NINFER_L2_AHEAD, MiB; 0: no
prefetcher, the baseline of the same run) and prefetch size (NINFER_L2_CHUNK), and timed
by CUDA events: the median of three runs of 200 back-to-back replays, and the ratio of each
to the baseline."""

from __future__ import annotations

import os
import sys

from .report import write_line

AHEAD_MIB = (0, 4, 8, 16, 32)
CHUNKS = (16384, 65536)


def main(json_path: str | None = None) -> int:
    import torch

    from kernels import prefetch

    from ..engine.model import Lane
    from ..model.graphs import DecodeGraphs
    from .skinny import _events_us, anchor_model
    m = anchor_model()
    lane = Lane(slot=0, attn_blocks=list(range(64)))
    rows: dict = {}
    for chunk in CHUNKS:
        prefetch.CHUNK = chunk
        for mib in AHEAD_MIB if chunk == CHUNKS[0] else AHEAD_MIB[1:]:
            os.environ["NINFER_L2_AHEAD"] = str(mib)
            m.graphs = DecodeGraphs(m)  # captured afresh under this setting
            m.forward_batch([(lane, [7], 1000)])
            graph = m.graphs.graphs[(1, 64)].graph
            runs = sorted(_events_us(graph.replay, 200) for _ in range(3))
            key = "none" if mib == 0 else f"ahead{mib}_chunk{chunk // 1024}k"
            rows[key] = {"replay_us": runs[1], "runs": runs}
            print(f"{key:>20}: {runs[1]:7.1f} us", file=sys.stderr, flush=True)
    os.environ.pop("NINFER_L2_AHEAD")
    base = rows["none"]["replay_us"]
    for row in rows.values():
        row["speedup"] = base / row["replay_us"]
    write_line({"bench": "l2", "results": {"device": torch.cuda.get_device_name(),
                                           "b1": rows}}, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
