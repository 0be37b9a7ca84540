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
