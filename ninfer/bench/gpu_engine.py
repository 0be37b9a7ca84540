"""The engine on the GPU (`bench/gpu.sh engine` / `baseline`): anchor-1b, a 0.73B random
Qwen3-Next in bf16 (`ninfer make-tiny --preset anchor-1b`), against its roofline and against
transformers + fla on the same weights, each measured in the run that reports it.

- roofline: bytes read per decode step (every weight but the embedding table and the MTP
  head) over the copy bandwidth measured in this run; a batch of B reads them once.
- ours: `ninfer bench engine`'s figures on the GPU (decode at batch 1/4/8 through the whole
  engine, CUDA graphs for the steps; prefill; MTP drafting as the model drafts, forced right,
  forced wrong; each after a warm run, as the decode figures), plus the model's own step
  time (a graph replay and its argmax), a verify of 4 positions and an MTP head step (graph
  replays too: `ninfer.model.spec_graphs`) against a plain step; decode at batch 1 again
  with the graphs not running the next step ahead (`run_ahead`), the same-run "before" of
  that; and decode at batch 1 under each value of a flag, the graphs captured afresh for
  each, in turn three times (runs drift by ~2% over a minute): the median of each and their
  ratio. The flags (`ninfer.flags`, switched with `override`): zero-copy staging
  (`zero_copy`), the conv tails read before or after the PDL wait (`early_conv`), the
  zero-copy step's fence kept by its first GEMM or by a barrier (`fence_in_kernel`), the
  attention's empty splits skipped or not at 64 and 1K tokens of context
  (`skip_empty_splits`), the attention's tile for wide heads at 64 and 4K
  (`wide_attention_tile`), and the GDN step's value tile and warps (`gdn_step_tile`).
  `skinny_rows`: a verify of 4 positions, batch-4 / 8 decode and MTP with drafts forced
  right, with GEMMs of up to 4 rows through cuBLAS or the skinny kernels (`skinny_rows`),
  in turn. `verify_in_place`: a verify of 4 positions gathering the GDN slots first or
  reading them in place (`verify_in_place`). `mtp_span_graphs`: MTP with drafts forced
  right, the MTP layer's catch-up of a round's positions eager (`mtp_graph_span` 1) or
  replayed from graphs.
  `removal_bounds_b1`: batch-1 decode with the GDN step, the attention's merge, the whole
  attention, or the GDN step and the attention left out of the graph (wrong tokens): how
  much of a step those kernels cost, so what any change to them could gain at most.
  `main(path, only="row,row")` runs only those rows (a short device call).
- baseline: transformers' Qwen3NextForCausalLM on the same files, with fla's kernels when
  transformers binds them (reported), `generate` greedy at batch 1 and 8, and a 4K prefill.
"""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path

import torch

from ..flags import FLAGS, override
from .report import write_line

ANCHOR_DIR = Path("/tmp/ninfer-anchor-1b")
DECODE_TOKENS = 128


def anchor_dir() -> Path:
    """The anchor-1b model directory (`make_tiny`'s preset, random bf16 weights), written
    once per machine."""
    if not (ANCHOR_DIR / "config.json").exists():
        from ..model.tiny import make_tiny
        t0 = time.perf_counter()
        make_tiny(ANCHOR_DIR, dtype="bfloat16", preset="anchor-1b")
        print(f"anchor-1b written in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return ANCHOR_DIR


def step_bytes(net) -> int:
    """Bytes a decode step must read: every weight but the embedding table and MTP head."""
    return sum(p.numel() * p.element_size() for n, p in net.named_parameters()
               if not n.startswith(("model.embed_tokens", "mtp.")))


def _cuda_time(fn, reps: int) -> float:
    """Seconds per call of fn(), CUDA-synchronised."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def model_steps(bench) -> dict:
    """The model alone: a one-token step of 1 and 8 lanes (graph replay + argmax), a
    verify of 4 positions keeping every state and an MTP head step, against a plain
    step."""
    from ..model.protocol import Lane
    m = bench.om.model
    out = {}
    for B in (1, 8):
        lanes = [Lane(slot=i, attn_blocks=list(range(i * 64, i * 64 + 64))) for i in range(B)]
        items = [(lane, [7], 1000) for lane in lanes]
        out[f"step_b{B}_us"] = _cuda_time(lambda items=items: m.forward_batch(items), 50) * 1e6
    lane = Lane(slot=0, attn_blocks=list(range(64)))
    out["verify4_us"] = _cuda_time(
        lambda: m.forward_batch([(lane, [7, 8, 9, 10], 1000)], per_position=True), 50) * 1e6
    out["verify4_over_step"] = out["verify4_us"] / out["step_b1_us"]
    if m.net.has_mtp:  # one MTP head step (a draft, or one position's catch-up)
        lane.mtp_blocks = list(range(64, 128))
        hidden = torch.zeros(m.config.hidden_size, dtype=m.dtype, device=m.device)
        out["mtp_step_us"] = _cuda_time(lambda: m.mtp(lane, 1000, hidden, 7), 50) * 1e6
        out["mtp_step_over_step"] = out["mtp_step_us"] / out["step_b1_us"]
    return out


def _without_ahead(run):
    """run() with the decode graphs not running the next step ahead (the "before")."""
    with override(run_ahead=False):
        return run()


def _recaptured(bench, run, **flags):
    """run() with `flags` (`ninfer.flags`) overridden and the decode and verify graphs
    captured afresh under them, then dropped again, so that the next run captures them as
    the flags were (run: a warm one, its first call captures)."""
    graphs = bench.om.model.graphs
    if graphs is None:
        return {"error": "no decode graphs"}

    def drop() -> None:
        graphs.drop_ahead()
        graphs.graphs = {}
        if bench.om.model.verify_graphs is not None:  # (a kernel flag may change them;
            # the MTP head's graphs stay: dropping every graph of the shared pool at once
            # trips an assertion of torch's caching allocator at the next capture)
            bench.om.model.verify_graphs.graphs = {}

    drop()
    try:
        with override(**flags):
            return run()
    finally:
        drop()


def skinny_rows_row(bench, rounds: int = 3) -> dict:
    """A verify of 4 positions (and batch-4 / 8 decode, and MTP with drafts forced right)
    with GEMMs of up to 4 rows through cuBLAS (`skinny_rows` 1, the default) or through the
    skinny kernels (4), in turn: each figure's median and every run's. (The MTP head's
    graphs are not captured afresh: `_recaptured`.)"""
    def figures() -> dict:  # each run twice: the first captures the graphs afresh
        steps = model_steps(bench)
        b4 = [bench.decode(4, tokens=DECODE_TOKENS) for _ in range(2)][1]
        b8 = [bench.decode(8, tokens=DECODE_TOKENS) for _ in range(2)][1]
        accept = [bench.decode(1, tokens=DECODE_TOKENS, spec="mtp", drafts="accept")
                  for _ in range(2)][1]
        return {"verify4_over_step": steps["verify4_over_step"],
                "verify4_us": steps["verify4_us"], "decode_b4_tok_s": b4["tok_s"],
                "decode_b8_tok_s": b8["tok_s"], "mtp_accept_tok_s": accept["tok_s"],
                "mtp_accept_tokens_per_verify": accept["tokens_per_verify"]}

    variants = {"rows_1": 1, "rows_4": 4}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for rows in variants.values():  # warm: the first call of a shape compiles and captures
        _recaptured(bench, figures, skinny_rows=rows)
    for _ in range(rounds):
        for name, rows in variants.items():
            runs[name].append(_recaptured(bench, figures, skinny_rows=rows))
    return {name: {key: sorted(r[key] for r in rs)[rounds // 2] for key in rs[0]}
            | {"runs": rs} for name, rs in runs.items()}


def verify_in_place_row(bench, rounds: int = 3) -> dict:
    """A verify of 4 positions whose GDN layers gather the lanes' slots first or read them
    in place (`FLAGS.verify_in_place`), in turn: each median and every run."""
    runs: dict[str, list[float]] = {"gather": [], "in_place": []}
    for _ in range(rounds + 1):  # the first round warms
        for name, value in (("gather", False), ("in_place", True)):
            us = _recaptured(bench, lambda: model_steps(bench)["verify4_us"],
                             verify_in_place=value)
            runs[name].append(us)
    out = {name: {"verify4_us": sorted(v[1:])[rounds // 2], "runs": v[1:]}
           for name, v in runs.items()}
    out["in_place_over_gather"] = out["in_place"]["verify4_us"] / out["gather"]["verify4_us"]
    return out


def removal_bounds_row(bench, rounds: int = 3) -> dict:
    """Batch-1 decode with kernels LEFT OUT of the decode graph (wrong tokens: upper bounds
    of what making them free could gain, not a mode to run): the GDN step (out_proj reads
    v as its output), the attention's merge of its splits, the whole attention (o_proj
    reads q), and the GDN step with the whole attention; the graphs captured afresh for
    each, in turn. Each variant's median tok/s, the us a token it saves against the full
    step, and its fraction of the roofline (`roofline_fraction` is filled in by `main`)."""
    import kernels
    from kernels import decode_attention
    dev = kernels.device_kernels()
    full = (dev.step, decode_attention.merge_splits, dev.decode_attention)

    def no_step(q, k, v, *args, **kw):
        return v

    def no_merge(*args, **kw):
        return None

    def no_attention(y, heads, kv_heads, head_dim, *args, **kw):
        return y[:, :, :heads * head_dim].reshape(y.shape[0], 1, heads, head_dim)

    variants = {"full": full, "no_gdn_step": (no_step, full[1], full[2]),
                "no_merge": (full[0], no_merge, full[2]),
                "no_attention": (full[0], full[1], no_attention),
                "no_gdn_step_no_attention": (no_step, full[1], no_attention)}

    def run(settings: dict) -> dict:
        dev.step, decode_attention.merge_splits, dev.decode_attention = settings["kernels"]
        try:
            return _recaptured(bench, lambda: [bench.decode(1, tokens=DECODE_TOKENS)
                                               for _ in range(2)][1])
        finally:
            dev.step, decode_attention.merge_splits, dev.decode_attention = full

    out = _in_turn({name: {"kernels": v} for name, v in variants.items()}, run, rounds)
    for row in out.values():
        row["saves_us_a_token"] = 1e6 / out["full"]["tok_s"] - 1e6 / row["tok_s"]
    return out


def _in_turn(variants: dict[str, dict], run, rounds: int = 3) -> dict:
    """run(settings) for each variant in turn, `rounds` times: each variant's median tok/s
    and every run's, and the ratio of each median to the first variant's."""
    runs: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, settings in variants.items():
            runs[name].append(run(settings)["tok_s"])
    first = sorted(next(iter(runs.values())))[rounds // 2]
    return {name: {"tok_s": sorted(v)[rounds // 2], "runs": v,
                   "over_first": sorted(v)[rounds // 2] / first} for name, v in runs.items()}


def _settled(run, key: str, n: int = 3) -> dict:
    """run() once to warm, then n times: the median run by row[key], with every run's
    figure. (A 4K prefill takes ~75 ms; on the H200 its second run has measured 40% below
    its later ones.)"""
    run()
    rows = sorted((run() for _ in range(n)), key=lambda row: row[key])
    return {**rows[n // 2], f"{key}_runs": [row[key] for row in rows]}


def main(json_path: str | None = None, only: str | None = None) -> int:
    """Every row (or those named in `only`, comma-separated: a short device call), the
    JSON written to json_path."""
    if not torch.cuda.is_available():
        print("gpu engine bench: needs a CUDA device", file=sys.stderr)
        return 2
    from .engine import Bench
    from .kernels import copy_bandwidth
    path = anchor_dir()
    bandwidth = copy_bandwidth()
    b = Bench(str(path), "cuda", "bfloat16")
    per_step = step_bytes(b.om.model.net)
    r: dict = {"model": "anchor-1b", "params": sum(p.numel() for p in b.om.model.net.parameters()),
               "copy_bandwidth_GBps": bandwidth / 1e9, "step_bytes": per_step,
               "roofline_tok_s_b1": bandwidth / per_step,
               "graphs": b.om.model.graphs is not None}
    def warm(run):  # the first call of a shape compiles kernels and captures graphs
        return lambda: (run(), run())[1]

    steps = [("model", lambda: model_steps(b)),
             ("prefill", lambda: _settled(lambda: b.prefill(4096), "prefill_tok_s"))]
    for batch in (1, 4, 8):
        steps.append((f"decode_b{batch}",
                      warm(lambda batch=batch: b.decode(batch, tokens=DECODE_TOKENS))))
    steps.append(("decode_b1_no_ahead", warm(lambda: _without_ahead(
        lambda: b.decode(1, tokens=DECODE_TOKENS)))))
    steps.append(("zero_copy_b1", lambda: _in_turn(
        {"copies": {"zero_copy": False}, "zero_copy": {"zero_copy": True}},
        lambda flags: _recaptured(b, warm(lambda: b.decode(1, tokens=DECODE_TOKENS)),
                                  **flags))))
    for row, flag, variants, context in (
            ("early_conv_b1", "early_conv", {"after_wait": False, "before_wait": True}, 64),
            ("fence_b1", "fence_in_kernel", {"barrier": False, "in_kernel": True}, 64),
            ("skip_empty_b1", "skip_empty_splits", {"every_split": False, "skip_empty": True},
             64),
            ("skip_empty_b1_1k", "skip_empty_splits",
             {"every_split": False, "skip_empty": True}, 1024),
            ("attention_tile_b1", "wide_attention_tile", {"32": 32, "16": 16}, 64),
            ("attention_tile_b1_4k", "wide_attention_tile", {"32": 32, "16": 16}, 4096),
            ("gdn_tile_b1", "gdn_step_tile",
             {"bv32_4warps": None, "bv16_1warp": (16, 1), "bv8_1warp": (8, 1),
              "bv32_1warp": (32, 1)}, 64)):
        steps.append((row, lambda flag=flag, variants=variants, context=context: _in_turn(
            {label: {flag: value} for label, value in variants.items()},
            lambda flags: _recaptured(b, warm(lambda: b.decode(
                1, tokens=DECODE_TOKENS, context=context)), **flags))))
    steps.append(("removal_bounds_b1", lambda: removal_bounds_row(b)))
    steps.append(("decode_b1_4k",
                  warm(lambda: b.decode(1, tokens=DECODE_TOKENS, context=4096))))
    steps.append(("skinny_rows", lambda: skinny_rows_row(b)))
    steps.append(("verify_in_place", lambda: verify_in_place_row(b)))
    steps.append(("mtp_span_graphs", lambda: _in_turn(  # the MTP catch-up eager or replayed
        {"eager": {"mtp_graph_span": 1}, "graphs": {"mtp_graph_span": FLAGS.mtp_graph_span}},
        lambda flags: _recaptured(b, warm(lambda: b.decode(
            1, tokens=DECODE_TOKENS, spec="mtp", drafts="accept")), **flags))))
    for drafts in (None, "accept", "reject"):  # warm too: a verify graph per round length
        steps.append((f"mtp_{drafts or 'model'}", warm(
            lambda d=drafts: b.decode(1, tokens=DECODE_TOKENS, spec="mtp", drafts=d))))
    steps.append(("turn2_4k", warm(lambda: b.turn2(4096))))
    if only:
        steps = [step for step in steps if step[0] in only.split(",")]
    for name, run in steps:
        t0 = time.perf_counter()
        try:
            r[name] = run()
        except Exception as exc:  # a broken figure must not hide the others
            r[name] = {"error": repr(exc)}
            print(f"gpu engine bench: {name} failed: {exc!r}", file=sys.stderr)
        print(f"  {name}: {r[name]} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    for batch in (1, 4, 8):
        row = r.get(f"decode_b{batch}", {})
        if "tok_s" in row:
            row["roofline_fraction"] = row["tok_s"] / (batch * r["roofline_tok_s_b1"])
    for row in r.get("removal_bounds_b1", {}).values():
        if isinstance(row, dict) and "tok_s" in row:
            row["roofline_fraction"] = row["tok_s"] / r["roofline_tok_s_b1"]
    if "tok_s" in r.get("decode_b1", {}) and "tok_s" in r.get("decode_b1_no_ahead", {}):
        r["ahead_speedup_b1"] = r["decode_b1"]["tok_s"] / r["decode_b1_no_ahead"]["tok_s"]
    _write("engine", r, json_path)
    return 0


def baseline(json_path: str | None = None) -> int:
    """transformers (+ fla when it binds it) on the same anchor-1b files."""
    if not torch.cuda.is_available():
        print("gpu baseline: needs a CUDA device", file=sys.stderr)
        return 2
    model, r = transformers_model(anchor_dir())
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for batch in (1, 8):
            ids = torch.randint(0, 4000, (batch, 64), device="cuda", generator=g)
            kw = dict(max_new_tokens=DECODE_TOKENS, min_new_tokens=DECODE_TOKENS,
                      do_sample=False, pad_token_id=0)
            model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            r[f"decode_b{batch}_tok_s"] = batch * DECODE_TOKENS / seconds
        ids = torch.randint(0, 4000, (1, 4096), device="cuda", generator=g)
        model(ids)
        seconds = _cuda_time(lambda: model(ids), 3)
        r["prefill_4k_tok_s"] = 4096 / seconds
    _write("baseline", r, json_path)
    return 0


def transformers_model(path):
    """transformers' model of the files at `path` in bf16 on the GPU, fla's kernels bound
    where it imports, and what it runs: (model, {"transformers": version, "kernels",
    "bound", "fast_path"})."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_next import modeling_qwen3_next as module
    bound = _bind_fla(module)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    kernels = _implementations(model.model.layers[0].linear_attn, module)
    return model, {"transformers": transformers.__version__, "kernels": kernels,
                   "bound": bound,
                   "fast_path": bool(getattr(module, "is_fast_path_available", False))}


def _implementations(layer, module) -> dict[str, str | None]:
    """Which module implements each GDN function the layer calls (None: not there). In
    transformers 4.x the layer holds fla's functions, bound at its init; in 5.x the module's
    torch functions are wrapped, at import, around the package's (fla, causal_conv1d) when it
    imports, and the wrapper keeps it as `implementation`."""
    found = {}
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                 "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                 "causal_conv1d_update", "causal_conv1d_fn"):
        f = getattr(layer, name, None) or getattr(module, name, None)
        if f is None:
            continue
        if getattr(f, "__closure__", None):
            f = inspect.getclosurevars(f).nonlocals.get("implementation", f)
        found[name] = getattr(f, "__module__", None)
    return found


def _bind_fla(module) -> list[str]:
    """transformers binds fla's kernels at import only when it finds a distribution named
    "fla" (fla-core's is "fla-core"): bind them as it would have, before the model is built."""
    try:
        from fla.modules import FusedRMSNormGated
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except ImportError:
        return []
    bound = []
    for name, value in (("chunk_gated_delta_rule", chunk_gated_delta_rule),
                        ("fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule),
                        ("FusedRMSNormGated", FusedRMSNormGated)):
        if hasattr(module, name) and getattr(module, name) is None:
            setattr(module, name, value)
            bound.append(name)
    if hasattr(module, "is_fast_path_available"):
        module.is_fast_path_available = True
    return bound


def _write(name: str, r: dict, json_path: str | None) -> None:
    write_line({"bench": f"gpu-{name}", "results": r}, json_path)
