"""Claude Code completes a turn against `ninfer serve` started with no options (but a free
port): installed from the npm registry once per test run, pointed at the local server by
`ANTHROPIC_BASE_URL`, run non-interactively (`claude -p`), offline (no telemetry, no update
check, no error reports, no traffic but the API's, an API key so it never asks to log in),
thinking off (`MAX_THINKING_TOKENS=0`, and `CLAUDE_CODE_DISABLE_THINKING=1`: 2.1.332 still
asks for adaptive thinking under the first alone). It exits 0 and prints the model's reply.

Its system prompt and every tool's schema in the prompt (`ENABLE_TOOL_SEARCH=false`, as
before it deferred most tools to a search tool: about 80 KB, 42K tokens of the tiny model's
tokenizer) must fit the server's default --max-context. The server's model is the default one
made to answer briefly (brief_model.py): the random one would write until an output limit, and
Claude Code fails a turn that runs into its token limit or the context.

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

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.332"


@pytest.fixture(scope="session")
def claude() -> Path:
    """The `claude` command, installed from the npm registry once per test run."""
    return npm_install(CLAUDE_CODE, "claude-code", "claude")


def test_claude_code_completes_a_turn(claude, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    with served_with_defaults(tmp_path) as server:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), **NO_NETWORK,
               "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "ninfer-local",
               "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
               "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "MAX_THINKING_TOKENS": "0", "CLAUDE_CODE_DISABLE_THINKING": "1",
               "ENABLE_TOOL_SEARCH": "false"}
        done = subprocess.run([str(claude), "-p", "Say hello in one sentence."],
                              cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=900)
        server_log = server.log.read_text()
        with contextlib.closing(sqlite3.connect(f"file:{server.journal}?mode=ro",
                                                uri=True)) as db:
            rows = db.execute("SELECT request, kind, data FROM events WHERE kind IN "
                              "('RequestQueued', 'StopReached', 'RequestFinished') AND request "
                              "NOT LIKE 'warmup-%' ORDER BY seq").fetchall()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{server_log[-4000:]}"
    assert done.stdout.strip() == REPLY
    queued = {r: json.loads(d) for r, k, d in rows if k == "RequestQueued"}
    stopped = {r: json.loads(d) for r, k, d in rows if k == "StopReached"}
    finished = {r for r, k, _ in rows if k == "RequestFinished"}
    assert len(queued) == 1, server_log[-4000:]
    (rid, request), = queued.items()
    # its system prompt and tools, in the default context (past the old default, 32,768)
    assert request["prompt_len"] > 32_768
    assert "reasoning_budget" not in request["params"]   # thinking off: nothing to budget
    assert rid in finished and stopped[rid]["reason"] == "stop_token"   # the model ended it
