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
import sqlite3
import subprocess
from pathlib import Path

import pytest

from .agent_clis import NO_NETWORK, npm_install, served_with_defaults
from .brief_model import REPLY

CODEX = "@openai/codex@0.171.0"


@pytest.fixture(scope="session")
def codex_cli() -> Path:
    """The Codex CLI, installed from the npm registry once per test run."""
    return npm_install(CODEX, "codex", "codex")


@pytest.fixture
def served(tmp_path):
    """`ninfer serve --port P` in its own process, on the brief default model; its URL and
    journal."""
    with served_with_defaults(tmp_path) as server:
        yield server.url, server.journal


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
