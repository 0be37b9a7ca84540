"""Compile every Triton kernel for an H100 / H200 (sm_90) on a machine without a GPU.

CI has no GPU: its kernel tests run in Triton's interpreter, which executes Python and
accepts code the compiler rejects (a loop over a tuple of pointers ran there and failed to
compile on the H200). Here each kernel launch the wrappers make is compiled for sm_90
instead of run, with the arguments of a launch like the model's (decode, verify, prefill;
programmatic dependent launch on; the skinny GEMMs' GPU tilings), and ptxas' resource
usage is read back: registers, and stack (spills), which the H200 made slow before.

    python -m tests.kernels.sm90     # a table; exit status 1 if a kernel fails to compile
                                     # (from the repository's root)

Run without TRITON_INTERPRET (kernels must be compiled functions). The outputs of the
wrappers are garbage (nothing runs); only what was compiled is reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback

import torch

_POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
            torch.float64: "*fp64", torch.int64: "*i64", torch.int32: "*i32",
            torch.uint8: "*u8", torch.bool: "*i1"}


def _signature(fn, args, kwargs):
    """Triton's signature, constants and divisibility hints for fn(*args, **kwargs), as
    its launcher would specialise them."""
    values = dict(zip(fn.arg_names, args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = values[p.name]
        if p.is_constexpr or v is None:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = _POINTER[v.dtype]
            if not p.do_not_specialize:  # a fresh allocation is 16-byte aligned
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int) and v == 1 and not p.do_not_specialize:
            sig[p.name], consts[p.name] = "constexpr", 1
        elif isinstance(v, int):
            sig[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
            if v % 16 == 0 and not p.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {p.name} = {v!r}")
    return sig, consts, attrs


def _resources(compiled) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    finally:
        os.unlink(f.name)
    fields = dict(part.split(":") for line in out.splitlines() if "REG:" in line
                  for part in line.split() if ":" in part)
    return f"{fields.get('REG', '?')} registers, stack {fields.get('STACK', '?')}"


class _Compiling:
    """Stands in for a JIT kernel's `kernel[grid]`: compiles the launch for sm_90 (and
    appends (kernel, PTX) to `ptx` where given)."""

    def __init__(self, fn, seen: dict, ptx: list | None = None) -> None:
        self.fn, self.seen, self.ptx = fn, seen, ptx

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            import triton
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource
            sig, consts, attrs = _signature(self.fn, args, kwargs)
            compiled = triton.compile(
                ASTSource(fn=self.fn, signature=sig, constexprs=consts, attrs=attrs),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": kwargs.get("num_warps", 4),
                         "num_stages": kwargs.get("num_stages", 3)})
            self.seen.setdefault(self.fn.__name__, set()).add(_resources(compiled))
            if self.ptx is not None:
                self.ptx.append((self.fn.__name__, compiled.asm["ptx"]))
        return launch


_MODULES = tuple(f"kernels.{name}" for name in (
    "conv1d", "decode_attention", "fused", "gdn_chunk", "gdn_decode", "greedy", "kv_write",
    "paged_attention", "skinny"))


def _patch(seen: dict, ptx: list | None = None) -> None:
    """Every module-level Triton kernel of `kernels` compiles instead of running; launches
    take PDL; the skinny GEMMs pick their GPU tiles."""
    import importlib

    import triton

    from kernels import pdl, skinny
    for module in map(importlib.import_module, _MODULES):
        for name, value in list(vars(module).items()):
            if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                setattr(module, name, _Compiling(value, seen, ptx))
    pdl.launch = lambda x, fenced=False: {"PDL": True, **({"FENCE": False} if fenced else {})}
    gpu = torch.device("cuda")
    tiles = skinny.tiles_for
    skinny.tiles_for = lambda M, N, K, glu, device: tiles(M, N, K, glu, gpu)
    skinny._exact_dots = lambda x: x.dtype == torch.float32  # bf16: the tensor cores


def _launches() -> None:
    """The wrappers, called as anchor-1b's forwards call them (smaller where the shape
    does not change the code)."""
    from kernels import (
        conv1d,
        decode_attention,
        fused,
        gdn_chunk,
        gdn_decode,
        greedy,
        kv_write,
        paged_attention,
        skinny,
    )
    bf, H, inter, V = torch.bfloat16, 1024, 3072, 4096
    Hk, Hv, D, Ha, Hkv, Da = 8, 16, 128, 8, 2, 256

    def r(*shape, dtype=bf):
        return torch.randn(*shape).to(dtype)

    x, nw = r(1, 1, H), r(H)
    # skinny GEMMs of one row (the flag `skinny_rows`), with their prologues and epilogues
    skinny.norm_linear(x, nw, 1e-6, r(2 * inter, H), glu=True)
    skinny.linear(r(1, 1, inter), r(H, inter), residual=x)
    skinny.gated_norm_linear(r(1, 1, Hv, D), r(1, 1, Hv, D), r(D), 1e-6, r(H, Hv * D),
                             residual=x)
    skinny.gate_linear(r(1, 1, Ha, Da), r(1, 1, Ha, Da), r(H, Ha * Da), residual=x)
    conv_dim = 2 * Hk * D + Hv * D
    pool, slots = r(4, conv_dim, 3), torch.tensor([1])
    skinny.norm_linear(x, nw, 1e-6, r(conv_dim + Hv * D + 2 * Hv, H),
                       conv=(pool, slots, r(conv_dim, 4)))
    skinny.norm_linear(x, nw, 1e-6, r(V, H), normed=True,
                       argmax=torch.zeros(1, dtype=torch.int64))
    # and of 4 rows (a verify of 4 positions at `skinny_rows` 4: the tensor-core dots, down's
    # K split over programs; the GPU bench's `skinny_rows` row)
    x4 = r(1, 4, H)
    skinny.norm_linear(x4, nw, 1e-6, r(2 * inter, H), glu=True)
    skinny.linear(r(1, 4, inter), r(H, inter), residual=x4)
    skinny.gated_norm_linear(r(1, 4, Hv, D), r(1, 4, Hv, D), r(D), 1e-6, r(H, Hv * D),
                             residual=x4)
    skinny.gate_linear(r(1, 4, Ha, Da), r(1, 4, Ha, Da), r(H, Ha * Da), residual=x4)
    skinny.norm_linear(x4, nw, 1e-6, r(conv_dim + Hv * D + 2 * Hv, H))
    skinny.norm_linear(x4, nw, 1e-6, r(V, H), normed=True)
    # elementwise
    fused.rms_norm(r(2, 8, H), nw, 1e-6, residual=r(2, 8, H))
    fused.gated_rms_norm(r(8, Hv, D), r(8, Hv, D), r(D), 1e-6)
    fused.silu_mul(r(8, inter), r(8, inter))
    fused.sigmoid_mul(r(8, Ha * Da), r(8, Ha * Da))
    fused.rope(r(1, 8, Ha, Da), r(1, 8, 64), r(1, 8, 64))
    out = r(1, conv_dim, 64).transpose(1, 2)
    fused.qk_norm_gates(out[..., :Hk * D].reshape(1, 64, Hk, D),
                        out[..., Hk * D:2 * Hk * D].reshape(1, 64, Hk, D),
                        r(1, 64, Hv), r(1, 64, Hv), r(Hv), r(Hv))
    # the conv: a prefill chunk, a verify keeping every tail, one token off the pools
    conv1d.causal_conv1d_update(r(1, 256, conv_dim).transpose(1, 2), r(1, conv_dim, 3),
                                r(conv_dim, 4), activation="silu")
    conv1d.causal_conv1d_update(r(1, 4, conv_dim).transpose(1, 2), r(1, conv_dim, 3),
                                r(conv_dim, 4), activation="silu", all_states=True)
    conv1d.causal_conv1d_update(r(1, 1, conv_dim).transpose(1, 2), pool, r(conv_dim, 4),
                                activation="silu", state_indices=slots, out_indices=slots)
    # the GDN rule: chunked (plain and packed), a decode step off the pools, a verify. The
    # chunk's wrapper takes CPU tensors only in the interpreter, where bf16 dots are
    # emulated in float32: fp16 compiles the tensor-core dots bf16 takes on the GPU
    q, k, v = r(1, 256, Hk, D), r(1, 256, Hk, D), r(1, 256, Hv, D)
    g, beta = -torch.rand(1, 256, Hv), torch.rand(1, 256, Hv)
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        h = torch.float16
        gdn_chunk.chunk_gated_delta_rule(q.to(h), k.to(h), v.to(h), g, beta,
                                         torch.zeros(1, Hv, D, D))
        gdn_chunk.chunk_gated_delta_rule(q.to(h), k.to(h), v.to(h), g, beta,
                                         torch.zeros(2, Hv, D, D),
                                         cu_seqlens=torch.tensor([0, 100, 256]))
    finally:
        del os.environ["TRITON_INTERPRET"]
    states = torch.zeros(4, Hv, D, D)
    gates = (r(1, 1, Hv), r(1, 1, Hv), r(Hv), r(Hv))
    gdn_decode.fused_recurrent_gated_delta_rule(
        q[:, :1], k[:, :1], v[:, :1], None, None, states, state_indices=slots,
        out_indices=slots, use_qk_l2norm=True, gates=gates, early_state=True)
    gates = (r(1, 4, Hv), r(1, 4, Hv), r(Hv), r(Hv))
    gdn_decode.fused_recurrent_gated_delta_rule(
        q[:, :4], k[:, :4], v[:, :4], None, None, torch.zeros(1, Hv, D, D), all_states=True,
        use_qk_l2norm=True, gates=gates)
    # attention: the decode mixer, a verify's prologue and paged attention, greedy keys
    blocks, bs = 8, 16
    kc, vc = r(blocks + 1, bs, Hkv, Da), r(blocks + 1, bs, Hkv, Da)
    tables = torch.arange(blocks)[None]
    y = r(1, 1, (2 * Ha + 2 * Hkv) * Da)
    cos, sin = r(1, 1, 64), r(1, 1, 64)
    decode_attention.decode_attention(y, Ha, Hkv, Da, r(Da), r(Da), 1e-6, cos, sin, kc, vc,
                                      tables, torch.tensor([[40]]))
    y4, cos4, sin4 = r(1, 4, (2 * Ha + 2 * Hkv) * Da), r(1, 4, 64), r(1, 4, 64)
    kv_write.attention_prologue(y4, Ha, Hkv, Da, r(Da), r(Da), 1e-6, cos4, sin4, kc, vc,
                                tables, torch.arange(40, 44)[None])
    paged_attention.paged_attention_decode(r(1, 4, Ha, Da), kc, vc, tables,
                                           torch.tensor([44]))
    greedy.greedy_keys(r(2, V), torch.zeros(2, dtype=torch.int64))
    greedy.decode_start(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1,
                        dtype=torch.int64), torch.zeros(1, dtype=torch.int64), r(V, H),
                        torch.rand(32))
    # zero-copy staging: the inputs fetched from the host's ring, the keys published to it
    inputs = torch.zeros(4 + 64, dtype=torch.int64)
    ring, turn = torch.zeros(5, 1 + 68, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    keys = torch.zeros(1, dtype=torch.int64)
    greedy.decode_start(inputs[:1].view(1, 1), inputs[1:2].view(1, 1), keys, r(V, H),
                        torch.rand(32), fetch=(ring, turn, inputs))
    greedy.publish_keys(keys, torch.zeros(4, 2, dtype=torch.int64), turn)


def compile_all() -> tuple[dict[str, set[str]], list[str]]:
    """{kernel: its resource lines} for every launch `_launches` makes, and the failures.
    The kernel modules stay patched (their kernels compile instead of running): call it in
    a process of its own, as `python -m tests.kernels.sm90` does."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("run without TRITON_INTERPRET: the kernels must be compiled ones")
    seen: dict[str, set[str]] = {}
    _patch(seen)
    try:
        _launches()
    except Exception:
        return seen, [traceback.format_exc()]
    return seen, []


def loads_before_wait(ptx: str) -> int:
    """Global loads a kernel's PTX issues before its PDL wait (all of them without one)."""
    return ptx.split("griddepcontrol.wait")[0].count("ld.global")


def dependents_before_wait(ptx: str) -> bool:
    """Whether a kernel's PTX lets its dependents launch before its PDL wait."""
    return "griddepcontrol.launch_dependents" in ptx.split("griddepcontrol.wait")[0]


def in_projection_early_loads() -> dict[str, int | bool]:
    """A GDN in-projection of one row, with and without the conv epilogue, and with it in
    the kernel that keeps a fence (`kernels.pdl`), compiled for sm_90: the global loads
    each issues before its PDL wait, and whether it lets its dependents launch before the
    wait. The conv's loads (the lane's slot, its tail, the conv weights) belong there: they
    overlap the kernel before; not in the fenced one, whose slots the kernel before may
    have just written. Patches the kernel modules as `compile_all` does: call it in a
    process of its own."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("run without TRITON_INTERPRET: the kernels must be compiled ones")
    ptx: list = []
    _patch({}, ptx)
    from kernels import pdl, skinny
    H, conv_dim, n = 1024, 4096, 6176
    x, nw, w = (torch.randn(*s).to(torch.bfloat16) for s in ((1, 1, H), (H,), (n, H)))
    pool, cw = (torch.randn(*s).to(torch.bfloat16) for s in ((4, conv_dim, 3), (conv_dim, 4)))
    skinny.norm_linear(x, nw, 1e-6, w)
    skinny.norm_linear(x, nw, 1e-6, w, conv=(pool, torch.tensor([1]), cw))
    pdl.launch = lambda x, fenced=False: {"PDL": True, **({"FENCE": True} if fenced else {})}
    skinny.norm_linear(x, nw, 1e-6, w, conv=(pool, torch.tensor([1]), cw))
    (_, plain), (_, conv), (_, fenced) = ptx
    return {"plain": loads_before_wait(plain), "conv": loads_before_wait(conv),
            "fenced": loads_before_wait(fenced),
            "conv_dependents_early": dependents_before_wait(conv),
            "fenced_dependents_early": dependents_before_wait(fenced)}


def main() -> int:
    seen, failures = compile_all()
    for name in sorted(seen):
        print(f"{name:32s} {'; '.join(sorted(seen[name]))}")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
