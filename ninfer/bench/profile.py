"""`bench/gpu.sh profile` (a GPU): where the time of a decode step and of a long prefill goes,
kernel by kernel, to choose the next kernel to write.

- decode: anchor-1b's decode graphs at batch 1 and 8, captured with programmatic dependent
  launch (`kernels.pdl`) and again without it: the replay time by CUDA events, and per
  kernel name the launches and the device time per replay (torch.profiler). With PDL the
  kernels overlap, so their times add up to more than the replay: a kernel's time then
  includes the wait for the one before; so each kernel is also charged the time by which
  it moves the end of the replay's chain (`critical_path`), which adds up to the replay.
- prefill: the GDN chunked prefill at T = 4K and 16K (bench_kernels' shapes), ours and
  fla's, per stage kernel.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from ..flags import override
from .report import write_line

REPLAYS = 20


def kernel_table(run, reps: int) -> tuple[int, list[dict]]:
    """run() `reps` times under torch.profiler: (kernel launches per run, one row per kernel
    name with its launches and device microseconds per run, slowest first)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = per_name[e.name[:100]]
            row[0] += 1
            row[1] += e.device_time_total
    rows = [{"kernel": name, "launches": n / reps, "us": us / reps}
            for name, (n, us) in per_name.items()]
    rows.sort(key=lambda r: -r["us"])
    return round(sum(r["launches"] for r in rows)), rows


def critical_path(run, reps: int = 5) -> dict:
    """Where the chain of one run() spends its time: each kernel is charged the time by
    which it moves the end of the chain (its end minus the latest end before it), so the
    charges add up to the run's span even when kernels overlap (PDL). Per kernel name the
    charged microseconds per run, and the sequence of charges over the first
    `SEQUENCE` kernels of the last run (one layer pattern and more, in launch order)."""
    from torch.profiler import ProfilerActivity, profile
    spans = []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        kernels = sorted((e.time_range.start, e.time_range.end, e.name[:60])
                         for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        spans.append(kernels)
    per_name: dict[str, float] = defaultdict(float)
    sequence = []
    for kernels in spans:
        sequence = []
        end = kernels[0][0]
        for start, stop, name in kernels:
            charge = max(stop - max(end, start), 0.0) + max(start - end, 0.0)
            per_name[name] += charge / reps
            sequence.append((name, round(charge, 2), round(stop - start, 2)))
            end = max(end, stop)
    rows = sorted(({"kernel": k, "charged_us": v} for k, v in per_name.items()),
                  key=lambda r: -r["charged_us"])
    return {"span_us": sum(r["charged_us"] for r in rows), "kernels": rows,
            "sequence": sequence[:SEQUENCE]}


SEQUENCE = 40


def decode() -> dict:
    from ..model.graphs import DecodeGraphs
    from ..model.protocol import Lane
    from .skinny import _events_us, anchor_model
    m = anchor_model()
    out: dict = {}
    for pdl in (True, False):
        # zero_copy off: the graphs are replayed here, not staged by DecodeGraphs
        with override(pdl=pdl, zero_copy=False):
            m.graphs = DecodeGraphs(m)  # captured afresh under these flags
            for B in (1, 8):
                lanes = [Lane(slot=i, attn_blocks=list(range(i * 64, i * 64 + 64)))
                         for i in range(B)]
                m.forward_batch([(lane, [7], 1000) for lane in lanes])  # captures
                graph = m.graphs.graphs[(B, 64)].graph
                launches, rows = kernel_table(graph.replay, REPLAYS)
                out[f"b{B}_pdl{int(pdl)}"] = {
                    "replay_us": _events_us(graph.replay, REPLAYS), "launches": launches,
                    "kernels": rows, "critical_path": critical_path(graph.replay)}
    return out


def prefill() -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla

    from kernels.gdn_chunk import chunk_gated_delta_rule as ours

    from .kernels import _gdn_inputs
    out: dict = {}
    for T in (4096, 16384):
        args = _gdn_inputs(1, T)  # q, k, v, g, beta
        for name, fn in (("ours", lambda a=args: ours(*a)),
                         ("fla", lambda a=args: fla(*a, output_final_state=True))):
            for _ in range(3):
                fn()
            launches, rows = kernel_table(fn, 10)
            out[f"T{T}_{name}"] = {"launches": launches, "kernels": rows}
    return out


def main(json_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        print("bench profile: needs a CUDA device", file=sys.stderr)
        return 2
    r: dict = {"device": torch.cuda.get_device_name()}
    for name, part in (("decode", decode), ("prefill", prefill)):
        try:
            r[name] = part()
        except Exception as exc:  # one broken part must not hide the other's figures
            r[name] = {"error": repr(exc)}
            print(f"bench profile: {name} failed: {exc!r}", file=sys.stderr)
            continue
        for key, row in r[name].items():
            head = f"== {name} {key}: {row['launches']} launches"
            if "replay_us" in row:
                head += f", replay {row['replay_us']:.1f} us"
            print(head, file=sys.stderr)
            for k in row["kernels"][:12]:
                print(f"  {k['us']:9.1f} us {k['launches']:6.1f}x  {k['kernel']}",
                      file=sys.stderr)
            path = row.get("critical_path")
            if path:
                print(f"  critical path {path['span_us']:.1f} us:", file=sys.stderr)
                for k in path["kernels"][:12]:
                    print(f"  {k['charged_us']:9.1f} us  {k['kernel']}", file=sys.stderr)
                print("  sequence (charged, duration): " + ", ".join(
                    f"{n[:12]} {c}/{d}" for n, c, d in path["sequence"]), file=sys.stderr)
    write_line({"bench": "profile", "results": r}, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
