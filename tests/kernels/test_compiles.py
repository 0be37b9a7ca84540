"""The compile watch counts the kernel specialisations met before ready and logs each one
met after it."""

import logging

from kernels.compiles import CompileWatch, watch


def test_specialisations_after_ready_are_logged_and_none_is_skipped(caplog):
    w = CompileWatch()
    fn = type("Info", (), {"name": "gdn_chunk"})()
    assert w.hook(key=1, repr="gdn_chunk[num_warps=4](T: i32)", fn=fn) is None
    assert w.before_ready == 1 and w.after_ready == []
    w.ready()
    with caplog.at_level(logging.WARNING, logger="ninfer.kernels"):
        assert w.hook(key=2, repr="gdn_chunk[num_warps=4](T: constexpr=1)", fn=fn) is None
    assert w.before_ready == 1
    assert w.after_ready == ["gdn_chunk: gdn_chunk[num_warps=4](T: constexpr=1)"]
    assert "the warm-up missed this shape" in caplog.text and "T: constexpr=1" in caplog.text


def test_watch_installs_itself_as_the_cache_hook():
    from triton import knobs
    before = knobs.runtime.jit_cache_hook
    try:
        w = watch()
        assert w is not None and knobs.runtime.jit_cache_hook == w.hook
    finally:
        knobs.runtime.jit_cache_hook = before


def test_a_late_specialisation_is_described_by_its_arguments(caplog):
    """Triton's own repr lists the arguments against the characters of its cache key; the
    log names each argument, its constant value, and which Triton took as multiples of 16
    or 16-byte aligned, from the signature, constants and configs of the hook's `compile`
    (the keywords of Triton 3.6's `JITFunction._call_hook`)."""
    w = CompileWatch()
    w.ready()
    fn = type("Info", (), {"name": "_solve_kernel"})()
    signature = {"k": "*bf16", "beta": "*bf16", "T": "i32", "BT": "constexpr"}
    configs = [{(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}]
    with caplog.at_level(logging.WARNING, logger="ninfer.kernels"):
        w.hook(key="[('*bf16', 'D')]", repr="_solve_kernel[num_warps=2](k: (", fn=fn,
               compile={"key": "[('*bf16', 'D')]", "signature": signature,
                        "constants": {(3,): 64}, "configs": configs},
               is_manual_warmup=False, already_compiled=False)
    assert w.after_ready == ["_solve_kernel: _solve_kernel(k: *bf16 %16, beta: *bf16, "
                             "T: i32 %16, BT=64)"]
    assert "beta: *bf16," in caplog.text


def test_a_late_specialisation_names_what_the_warm_ups_nearest_had_instead(caplog):
    """The warning says which arguments set the late specialisation apart from the nearest
    one met before ready, so a log tells which of a kernel's integers to stop
    specialising (or which shape the warm-up should run)."""
    w = CompileWatch()
    fn = type("Info", (), {"name": "_conv_update_kernel"})()
    signature = {"x": "*bf16", "T": "i32", "s_xb": "i32", "s_xt": "i32", "K": "constexpr"}

    def launch(divisible: tuple[int, ...], k: int = 4):
        configs = [{(i,): [["tt.divisibility", 16]] for i in divisible}]
        w.hook(key="k", repr="r", fn=fn, compile={"signature": signature,
                                                  "constants": {(4,): k}, "configs": configs})
    launch((0, 2, 3))            # before ready: two variants met
    launch((0,), k=2)            # (two arguments apart from the late one)
    w.ready()
    with caplog.at_level(logging.WARNING, logger="ninfer.kernels"):
        launch((0, 3))
    assert "the warm-up's nearest had s_xb: i32 %16 (now s_xb: i32)" in caplog.text
    assert "K=" not in caplog.text.split("nearest had")[1]
