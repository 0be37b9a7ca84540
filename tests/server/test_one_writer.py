"""Two `ninfer serve` processes on one journal: the second is refused by name and exits with
status 1 (a supervisor sees it), while the first goes on serving."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(journal, port: int, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", "--port", str(port),
                             "--journal", str(journal)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "XDG_STATE_HOME": str(journal.parent)})


def test_a_second_server_on_a_journal_in_use_exits_with_status_1(tmp_path):
    journal, port = tmp_path / "journal.db", _free_port()
    with open(tmp_path / "first.log", "w") as log:
        first = _serve(journal, port, log)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        with open(tmp_path / "second.log", "w") as log:
            second = _serve(journal, _free_port(), log)
            assert second.wait(timeout=120) == 1
        said = (tmp_path / "second.log").read_text()
        assert f"in use by another writer (pid {first.pid})" in said
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        first.terminate()
        first.wait(timeout=30)
