"""An experiment, not product code: a prefill chunk's attention at anchor-1b's shapes (8 query
heads of 256 over 2 KV heads, bf16) timed as the engine does it now and split in two, the
chunk's queries over the prefix (no mask) and over the chunk itself (square causal), the two
merged by their log-sum-exps; each half may then take a kernel that the lower-right causal
mask of the whole does not reach (cuDNN's). Issue 32 item 2: flash attention was 86 of the
231 ms of a 32K prefill on the H100 (bench/NOTES.md, stop 41).

    python3 bench/attention_split.py --check          # CPU: the split equals the whole
    python3 bench/attention_split.py --out r.json     # GPU: time the variants
    python3 bench/attention_split.py --fresh          # GPU: ninfer's split, new shapes' cost
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

H, HKV, D = 8, 2, 256


def whole(q, k, v):
    """The engine's way: [1, H, T, D] over [1, Hkv, L, D], causal aligned bottom right."""
    T, L = q.shape[2], k.shape[2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, L),
                                          scale=D ** -0.5, enable_gqa=True)


def _flash_half(q, k, v, causal, scale):
    """One half by flash attention (the KV heads shared inside the kernel), with its LSE."""
    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)[:2]


def split(q, k, v, backend: str):
    """The product's split (`ninfer.model.chunk_attention.split_attention`) with the
    backend's halves: the chunk over the prefix (all of it visible) and over itself."""
    from ninfer.model.chunk_attention import cpu_half, cudnn_half, split_attention
    half = {"cpu": cpu_half, "flash": _flash_half, "cudnn": cudnn_half}[backend]
    T, L = q.shape[2], k.shape[2]
    if L == T:
        return half(q, k, v, True, D ** -0.5)[0]
    return split_attention(q, k, v, D ** -0.5, half)


def _inputs(T, L, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(1, H, T, D, generator=g).to(device, dtype)
    k = torch.randn(1, HKV, L, D, generator=g).to(device, dtype)
    v = torch.randn(1, HKV, L, D, generator=g).to(device, dtype)
    return q, k, v


def check() -> None:
    for T, L in ((64, 64), (48, 200), (1, 33), (100, 300)):
        q, k, v = _inputs(T, L, "cpu", torch.float32)
        err = (split(q, k, v, "cpu") - whole(q, k, v)).abs().max().item()
        print(f"T {T} L {L}: max |split - whole| {err:.2e}")
        assert err < 1e-4, err


def _time(fn, repeat=5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def bench(prompt: int, chunk: int, layers: int) -> dict:
    rows = {}
    for L in range(chunk, prompt + 1, chunk):
        q, k, v = _inputs(chunk, L, "cuda", torch.bfloat16, seed=L)
        ref = whole(q, k, v)
        flops = 4 * H * D * (chunk * (L - chunk) + chunk * chunk / 2)
        row = {}
        for name, fn in (("whole_flash", lambda: whole(q, k, v)),
                         ("split_flash", lambda: split(q, k, v, "flash")),
                         ("split_cudnn", lambda: split(q, k, v, "cudnn"))):
            try:
                err = (fn().float() - ref.float()).abs().max().item()
                ms = _time(fn)
                row[name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_err": err}
            except Exception as exc:  # a backend this torch or card lacks
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        rows[L] = row
        print(L, json.dumps(row), flush=True)
    total = {name: sum(r[name].get("ms", float("nan")) for r in rows.values()) * layers
             for name in ("whole_flash", "split_flash", "split_cudnn")}
    return {"prompt": prompt, "chunk": chunk, "layers": layers, "chunks": rows,
            "prefill_ms_all_layers": total, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}


def fresh_shapes() -> dict:
    """The product's split (`ninfer.model.chunk_attention`, cuDNN halves) on shapes it has
    not met: the first call (cuDNN builds a plan per shape and strides) against a repeat;
    what `prepare` spends per shape in the warm-up, and what a request would wait for if
    any shape took the split."""
    from ninfer.model.chunk_attention import cudnn_half, split_attention
    rows = {}
    for T, L in ((8192, 16384), (8192, 20011), (3001, 11193), (517, 30000), (6000, 14000),
                 (8192, 24576), (8192, 32768)):
        q, k, v = _inputs(T, L, "cuda", torch.bfloat16, seed=T + L)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            split_attention(q, k, v, D ** -0.5, cudnn_half)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        rows[f"{T}x{L}"] = {"first_ms": times[0], "repeat_ms": min(times[1:])}
        print(T, L, json.dumps(rows[f"{T}x{L}"]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="CPU: the split equals the whole")
    p.add_argument("--fresh", action="store_true",
                   help="GPU: the product's split, first call of new shapes against a repeat")
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--layers", type=int, default=6, help="attention layers (anchor-1b: 6)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.check:
        check()
        return
    if args.fresh:
        rows = fresh_shapes()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    result = bench(args.prompt, args.chunk, args.layers)
    print(json.dumps(result["prefill_ms_all_layers"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
