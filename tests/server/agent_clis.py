"""What the agent CLI tests share (test_codex.py, test_claude_code.py): a CLI installed from
the npm registry once per test run into CACHE (skipped, loudly, only where npm is missing),
and `ninfer serve` started in its own process with no options but a free port, on the
default model made to answer briefly (brief_model.py), its journal under the test's tmp."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from ninfer.model.runtime import RANDOM_MODEL

from .brief_model import brief_model
from .serve_process import serving

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "agent-clis"   # ignored by git (.gitignore)
# a CLI run offline but for the local server: any other connection goes nowhere
NO_NETWORK = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
              "ALL_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}


def npm_install(package: str, prefix: str, command: str) -> Path:
    """`command` of `package` (name@version), installed under CACHE/`prefix`."""
    npm = shutil.which("npm")
    if npm is None:
        message = f"npm is not installed: the {package} end-to-end test did NOT run"
        warnings.warn(message, stacklevel=2)
        pytest.skip(message)
    where = CACHE / prefix
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(where),
                           package], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"npm install {package} failed:\n{done.stderr[-3000:]}"
    return where / "node_modules" / ".bin" / command


class Served(NamedTuple):
    url: str
    journal: Path
    log: Path       # the server's output


@contextlib.contextmanager
def served_with_defaults(tmp_path: Path) -> Iterator[Served]:
    """`ninfer serve --port P` in its own process, on the brief default model, until the
    block ends."""
    home, state = tmp_path / "ninfer-home", tmp_path / "state"
    brief_model(home)
    env = {**os.environ, "NINFER_HOME": str(home), "XDG_STATE_HOME": str(state),
           "NINFER_MODEL": RANDOM_MODEL}
    with serving([], env, tmp_path / "serve.log") as running:
        yield Served(running.url, state / "ninfer" / "journal.db", tmp_path / "serve.log")
