"""Two `ninfer serve` processes on one journal: the second is refused by name and exits with
status 1 (a supervisor sees it), while the first goes on serving."""

from __future__ import annotations

import os

import httpx

from .serve_process import free_port, serving, start


def test_a_second_server_on_a_journal_in_use_exits_with_status_1(tmp_path):
    journal = tmp_path / "journal.db"
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    with serving(["--journal", str(journal)], env, tmp_path / "first.log") as first:
        second = start(["--port", str(free_port()), "--journal", str(journal)], env,
                       tmp_path / "second.log")
        assert second.wait(timeout=120) == 1
        said = (tmp_path / "second.log").read_text()
        assert f"in use by another writer (pid {first.process.pid})" in said
        assert httpx.get(first.url + "/health", timeout=5).status_code == 200


def test_ctrl_c_stops_the_server_quietly_with_status_0(tmp_path):
    """A person's Ctrl+C: uvicorn shuts down (the journal closed), then raises the signal it
    handled again; the server exits 0 without a traceback, and the journal reads."""
    import signal
    import subprocess
    import sys
    journal = tmp_path / "journal.db"
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    log = tmp_path / "serve.log"
    with serving(["--journal", str(journal)], env, log) as running:
        running.process.send_signal(signal.SIGINT)
        assert running.process.wait(timeout=60) == 0
    said = log.read_text()
    assert "Traceback" not in said and "stopped" in said
    check = subprocess.run([sys.executable, "-m", "ninfer.cli", "journal", "check",
                            str(journal)], env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
