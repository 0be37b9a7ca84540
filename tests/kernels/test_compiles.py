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
