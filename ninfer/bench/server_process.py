"""`ninfer serve` started as a user starts it, for benchmarks that measure it from outside:
a fresh process on a free port with its own journal in a folder of its own, timed from the
moment it is started to its port answering and to `/health` answering 200, stopped
(terminated, then killed) when the block ends."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple


class Started(NamedTuple):
    url: str
    port_open_s: float      # from the process's start to its first HTTP answer (any status)
    ready_s: float          # from the process's start to /health 200
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(process: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM, and SIGKILL when it has not exited within `grace` seconds; waited for."""
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def started(options: Sequence[str], folder: Path, *, ready_within: float = 1200,
            env: dict[str, str] | None = None) -> Iterator[Started]:
    """`ninfer serve OPTIONS --port P --journal FOLDER/journal.db`, its output in
    FOLDER/serve.log, ready, until the block ends; `env`: variables set for it. A process
    that exits or is not ready in time raises RuntimeError with its log's tail."""
    import httpx
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "serve.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "ninfer.cli", "serve", *options, "--port", str(port),
               "--journal", str(folder / "journal.db")]
    with open(log, "w") as out:
        t0 = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, **env} if env else None)
    try:
        port_open = None
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"ninfer serve exited ({process.returncode}):\n{_tail(log)}")
            if time.perf_counter() - t0 > ready_within:
                raise RuntimeError(f"ninfer serve not ready in {ready_within:.0f} s:\n"
                                   f"{_tail(log)}")
            with contextlib.suppress(httpx.TransportError):
                status = httpx.get(url + "/health", timeout=5).status_code
                port_open = port_open or time.perf_counter() - t0
                if status == 200:
                    break
            time.sleep(0.02)
        yield Started(url, port_open, time.perf_counter() - t0, log)
    finally:
        stop(process)
