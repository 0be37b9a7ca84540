"""Issue 32, item 2: a cold prefill's time to first token, ninfer's engine at several
prefill chunk sizes against transformers (+ fla, where its kernels bind) on the same
anchor-1b files, in one run on one GPU (`bench/gpu.sh prefill`).

Each figure is the median of three timed prompts after one untimed (whose time is kept as
`first_ms`: the shape's compiles); transformers' forward keeps the last position's logits
only, as the engine does for a prompt's first token."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from .report import write_line

SIZES = (4096, 32768)
CHUNKS = (2048, 4096, 8192)


def _timed(run, n: int) -> dict:
    runs = []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t0)
    median = statistics.median(runs[1:])
    return {"first_ms": runs[0] * 1e3, "median_ms": median * 1e3, "tok_s": n / median}


def _ninfer(path) -> dict:
    """The engine at each chunk size; at the served one (the last) also with a chunk's
    attention as one flash call (`FLAGS.split_chunk_attention` off: the "before")."""
    from ..flags import override
    from .engine import Bench
    b, r = Bench(str(path), "cuda", "bfloat16"), {}
    runs = [(chunk, "", True) for chunk in CHUNKS] + [(CHUNKS[-1], "_one_flash_call", False)]
    for chunk, suffix, split in runs:
        engine = b.engine(prefill_chunk=chunk)
        with override(split_chunk_attention=split):
            # what the server's warm-up does: the split's shapes prepared (cuDNN's plans)
            r[f"prepared_chunk{chunk}{suffix}"] = engine.model.prepare_prefill(
                chunk=chunk, max_context=engine.config.max_context)
            for n in SIZES:
                key = f"ninfer_chunk{chunk}{suffix}_{n}"
                r[key] = _timed(lambda e=engine, n=n: b.ttft(e, b.prompt(n), 1), n)
                print(f"ninfer, chunks of {chunk}{suffix}, {n} tokens:", r[key],
                      file=sys.stderr)
    return r


def _transformers(path) -> dict:
    from .gpu_engine import transformers_model
    model, r = transformers_model(path)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for n in SIZES:
            ids = torch.randint(0, 4000, (1, n), device="cuda", generator=g)
            r[f"hf_fla_{n}"] = _timed(lambda ids=ids: model(ids, logits_to_keep=1), n)
    return r


def main(json_path: str | None = None) -> int:
    if not torch.cuda.is_available():
        print("gpu prefill bench: needs a CUDA device", file=sys.stderr)
        return 2
    from .gpu_engine import anchor_dir
    path = anchor_dir()
    r: dict = {"card": torch.cuda.get_device_name(), "model": "anchor-1b", **_ninfer(path)}
    torch.cuda.empty_cache()
    r.update(_transformers(path))
    for n in SIZES:
        for chunk in [*CHUNKS, f"{CHUNKS[-1]}_one_flash_call"]:   # > 1: ninfer is faster
            r[f"speedup_chunk{chunk}_{n}"] = (r[f"hf_fla_{n}"]["median_ms"]
                                              / r[f"ninfer_chunk{chunk}_{n}"]["median_ms"])
    write_line({"bench": "gpu-prefill", "results": r}, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else None))
