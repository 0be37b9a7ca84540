"""The Codex CLI completes a turn against `ninfer serve` started with no options (but a free
port): installed from the npm registry once per test run, configured through a temporary
CODEX_HOME with a custom provider speaking the Responses API, run non-interactively
(`codex exec`) and offline but for the local server.

Its instructions and tool list run to tens of KB (about 20K tokens of the tiny model's
tokenizer), so the server's default --max-context and --kv-capacity must hold them. The
server's model is the default one made to answer briefly (brief_model.py): the random one
would write until an output limit, which the CLI reports as an incomplete reply.

Skipped only where `npm` is missing, loudly (a warning besides the skip)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest

from .brief_model import REPLY, brief_model

ROOT = Path(__file__).resolve().parents[2]
CODEX = "@openai/codex@0.171.0"
CACHE = ROOT / ".cache" / "agent-clis"   # ignored by git (.gitignore)
NO_NETWORK = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
              "ALL_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}


@pytest.fixture(scope="session")
def codex_cli() -> Path:
    """The Codex CLI, installed from the npm registry into CACHE once per test run."""
    npm = shutil.which("npm")
    if npm is None:
        message = "npm is not installed: the Codex CLI end-to-end test did NOT run"
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    prefix = CACHE / "codex"
    prefix.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                           CODEX], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"npm install {CODEX} failed:\n{done.stderr[-3000:]}"
    return prefix / "node_modules" / ".bin" / "codex"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    """`ninfer serve --port P` in its own process, on the brief default model; its URL and
    journal."""
    home, state = tmp_path / "ninfer-home", tmp_path / "state"
    brief_model(home)
    port = _free_port()
    env = {**os.environ, "NINFER_HOME": str(home), "XDG_STATE_HOME": str(state)}
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", "--port",
                                    str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise AssertionError("ninfer serve did not become ready")
        yield url, state / "ninfer" / "journal.db"
    finally:
        process.terminate()
        process.wait(30)


def test_codex_exec_completes_a_turn(codex_cli, served, tmp_path):
    url, journal = served
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(f"""
model = "tiny-qwen3-next-v1"
model_provider = "ninfer"
model_reasoning_effort = "none"

[model_providers.ninfer]
name = "ninfer"
base_url = "{url}/v1"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
""")
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [str(codex_cli), "exec", "--skip-git-repo-check", "Say hello."], cwd=work,
        env={**os.environ, **NO_NETWORK, "CODEX_HOME": str(codex_home)},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert REPLY in done.stdout
    with contextlib.closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as db:
        finished = [json.loads(d) for (d,) in db.execute(
            "SELECT data FROM events WHERE kind = 'RequestFinished'")]
    # the CLI's own instructions and tools: well past the old default --max-context (8192)
    assert max(f["prompt_tokens"] for f in finished) > 10_000
