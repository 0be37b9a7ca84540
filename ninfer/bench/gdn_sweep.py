"""`bench/gpu.sh gdn-sweep` (a GPU): the GDN chunked prefill under each launch configuration
in CONFIGS (kernels.gdn_chunk.GDNChunkConfig) at bench_kernels' shapes, against fla's
`chunk_gated_delta_rule` timed in the same run, with each answer's distance from fla's; the
fastest configuration is the candidate for the default.

Times: triton.testing.do_bench, median milliseconds, L2 flushed between calls.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from kernels.gdn_chunk import DEFAULT_CONFIG

from .report import write_line

CONFIGS = {  # changes to DEFAULT_CONFIG (split stage 1, solve warps by program count)
    "default": {},
    "w_u": {"corrections_from_x": False},  # W and U from stage 1 (`_wu_kernel`)
    "fused": {"wy_split": False},
    "s2": {"solve_warps": 2},
    "state_bv16": {"state_block_v": 16},
    "state_w8": {"state_warps": 8},
    "state_stages4": {"state_stages": 4},
}


def sweep() -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla

    from kernels.gdn_chunk import chunk_gated_delta_rule as ours
    from kernels.gdn_reference import chunk_gated_delta_rule as reference

    from .kernels import _bench, _gdn_inputs, _rel
    out: dict = {}
    for T in (4096, 16384):
        args = _gdn_inputs(1, T)  # q, k, v, g, beta
        o_fla, s_fla = fla(*args, output_final_state=True)
        q, k, v, g, beta = args
        o_ref, _ = reference(q.float(), k.float(), v.float(), g, beta)
        out[f"T{T}_fla_err_vs_reference"] = _rel(o_fla, o_ref)
        fla_ms = _bench(lambda a=args: fla(*a, output_final_state=True))
        for name, change in CONFIGS.items():
            cfg = dataclasses.replace(DEFAULT_CONFIG, **change)
            key = f"T{T}_{name}"
            try:
                o, s = ours(*args, config=cfg)
                ms = _bench(lambda a=args, c=cfg: ours(*a, config=c))
            except Exception as exc:  # a configuration that fails: say so, go on
                out[key] = {"error": repr(exc)[:200]}
                print(f"  {key}: {out[key]['error']}", file=sys.stderr)
                continue
            out[key] = {"config": change, "ms": ms, "fla_ms": fla_ms, "ours_over_fla": fla_ms / ms,
                        "err": _rel(o, o_fla), "err_vs_reference": _rel(o, o_ref),
                        "state_err": float((s - s_fla).abs().max() / s_fla.abs().max())}
            print(f"  {key}: {ms:.3f} ms, fla {fla_ms:.3f} ms ({fla_ms / ms:.2f}x), "
                  f"from fla {out[key]['err']:.1e}, from the reference "
                  f"{out[key]['err_vs_reference']:.1e} (fla's "
                  f"{out[f'T{T}_fla_err_vs_reference']:.1e})", file=sys.stderr)
    return out


def main(json_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        print("bench gdn-sweep: needs a CUDA device", file=sys.stderr)
        return 2
    write_line({"bench": "gdn-sweep", "results": sweep()}, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
