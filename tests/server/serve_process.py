"""`ninfer serve` in its own process, as a user starts it: on a free port, its output in a
log file, ready when /health answers 200, stopped (terminated, then killed) when the block
ends. For the tests that need a real process (agent CLIs, exit statuses)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import httpx

from ninfer.bench.server_process import free_port, stop


def start(options: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`ninfer serve OPTIONS`, its output to `log`; not waited for."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", *options],
                                env=env, stdout=out, stderr=subprocess.STDOUT)


class Running(NamedTuple):
    url: str
    process: subprocess.Popen


@contextlib.contextmanager
def serving(options: Sequence[str], env: dict[str, str], log: Path,
            ready_within: float = 180) -> Iterator[Running]:
    """`ninfer serve --port P OPTIONS`, ready, until the block ends (its log in the
    assertion when it exits or is not ready in time)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start(["--port", str(port), *options], env, log)
    try:
        deadline = time.monotonic() + ready_within
        while time.monotonic() < deadline:
            assert process.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise AssertionError(f"ninfer serve did not become ready:\n{log.read_text()}")
        yield Running(url, process)
    finally:
        stop(process)
