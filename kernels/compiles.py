"""Which Triton kernel specialisations this process meets, and whether a request met one
after the server said it was ready.

Triton compiles a kernel once per specialisation: its constexpr values and, for integer
arguments, whether the value is 1 or a multiple of 16. The first launch of each in a
process compiles it (seconds) or loads it from the disk cache; either way the request that
launches it waits. The warm-up (`ninfer.server.warmup`) launches the shapes it knows of
before ready; `watch` counts them, and logs a warning, with the kernel and its
specialisation, for each one met after `ready()`: a shape the warm-up missed.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("ninfer.kernels")


class CompileWatch:
    def __init__(self) -> None:
        self.before_ready = 0
        self.after_ready: list[str] = []   # "kernel: specialisation" of each
        self._seen: dict[str, list[list[str]]] = {}   # kernel -> arguments of each met
        self._ready = False
        self._lock = threading.Lock()

    def ready(self) -> None:
        self._ready = True

    def hook(self, *, repr: str = "", fn=None, **kw) -> None:   # noqa: A002 (Triton's name)
        """Triton's `jit_cache_hook`: called on a specialisation's first launch in this
        process (None: go on and compile or load it)."""
        name = getattr(fn, "name", "?")
        args = arguments(kw)
        with self._lock:
            if not self._ready:
                self.before_ready += 1
                if args is not None:
                    self._seen.setdefault(name, []).append(args)
                return None
            # (Triton 3.6's own `repr` pairs the arguments with the characters of its
            # cache key: "k: (" and no more)
            shape = f"{name}({', '.join(args)})" if args is not None else repr
            self.after_ready.append(f"{name}: {shape}")
            nearest = difference(args, self._seen.get(name, []))
        log.warning("kernel %s met a new specialisation after ready (the warm-up missed "
                    "this shape; this request waits for it): %s%s", name, shape,
                    f"; the warm-up's nearest had {nearest}" if nearest else "")
        return None


def difference(args: list[str] | None, seen: list[list[str]]) -> str | None:
    """What the nearest specialisation met before ready had where `args` differ (the
    fewest arguments apart): "s_xb: i32 %16 (now s_xb: i32)"; None without one."""
    if args is None or not seen:
        return None
    near = min((s for s in seen if len(s) == len(args)),
               key=lambda s: sum(a != b for a, b in zip(s, args, strict=True)), default=None)
    if near is None:
        return None
    return ", ".join(f"{b} (now {a})" for a, b in zip(args, near, strict=True) if a != b)


def arguments(kw: dict) -> list[str] | None:
    """Each argument of a specialisation from the `signature`, `constants` and `configs`
    that Triton passes the hook in its `compile` argument: its type, its value where it is
    a constant, and "%16" where Triton took it as a multiple of 16 (an integer) or 16-byte
    aligned (a pointer). None where the keywords are not of that form."""
    kw = kw.get("compile") or kw
    try:
        attrs = (kw.get("configs") or [{}])[0] or {}
        constants = kw.get("constants") or {}
        parts = []
        for i, (arg, ty) in enumerate(kw["signature"].items()):
            if (i,) in constants:
                parts.append(f"{arg}={constants[(i,)]}")
                continue
            marks = attrs.get((i,), ())
            aligned = any("divisib" in str(mark[0]) for mark in marks)
            parts.append(f"{arg}: {ty}{' %16' if aligned else ''}")
        return parts
    except (KeyError, TypeError, IndexError, AttributeError):
        return None


def watch() -> CompileWatch | None:
    """Install a CompileWatch as Triton's `jit_cache_hook` (None where Triton has no such
    hook: an older Triton)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return None
    w = CompileWatch()
    runtime.jit_cache_hook = w.hook
    return w
