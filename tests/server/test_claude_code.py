"""Claude Code completes a turn against `ninfer serve` started with its defaults: installed
from the npm registry once per test run, pointed at the local server by
`ANTHROPIC_BASE_URL`, run non-interactively (`claude -p`), offline (no telemetry, no update
check, no error reports, no traffic but the API's, an API key so it never asks to log in).
It exits 0 and prints the model's reply. Its system prompt and tools (about 77 KB: over 60K
tokens of the embedded model's small tokenizer) must fit the server's default context.

The model served is the embedded tiny one, made to end its turns: the random model writes
`<|im_end|>` about once in 1,500 tokens, and Claude Code fails a turn that runs into its
token limit or the context (exit 1, "Prompt is too long"). So the test's `NINFER_HOME` holds
the embedded model with one change: after a tenth of the word tokens, `<|im_end|>` is all but
certain (their embeddings share a direction that `<|im_end|>`'s output row reads), so a reply
is a few words long. `ninfer serve` itself gets no options but a free port.

Skipped, with a warning, only where npm is missing."""

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
import torch
from safetensors.torch import load_file, save_file

from ninfer.model.runtime import DEFAULT_MODEL, default_model_dir
from ninfer.model.tokenizer import Tokenizer

PACKAGE = "@anthropic-ai/claude-code"


@pytest.fixture(scope="session")
def claude(tmp_path_factory) -> Path:
    """The `claude` command, installed from the npm registry into this run's tmp."""
    npm = shutil.which("npm")
    if npm is None:
        reason = f"npm is not installed: {PACKAGE} cannot be installed, Claude Code is untested"
        warnings.warn(reason, stacklevel=1)
        pytest.skip(reason)
    prefix = tmp_path_factory.mktemp("claude-code")
    done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                           PACKAGE], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"npm install {PACKAGE} failed:\n{done.stderr[-3000:]}"
    return prefix / "node_modules" / ".bin" / "claude"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ending_model(home: Path) -> Path:
    """The embedded model under `home` (a NINFER_HOME), made to end its turns (see the
    module's docstring)."""
    target = home / DEFAULT_MODEL
    shutil.copytree(default_model_dir(), target)
    tokenizer = Tokenizer.from_dir(target)
    tensors = load_file(target / "model.safetensors")
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(embed.shape[1], generator=generator)
    direction /= direction.norm()
    words = [t for t in range(embed.shape[0] - 16) if tokenizer.decode([t]).strip().isalpha()]
    ending = [t for t in words if torch.rand((), generator=generator) < 0.1]
    embed = embed.float()
    # (embeddings have a norm of about 16, the last layer's residual stream about 40: this
    # direction dominates it after an ending token, and the final norm keeps it)
    embed[ending] += 100 * direction
    head = head.float()
    head[tokenizer.special.im_end] = direction
    tensors["model.embed_tokens.weight"] = embed.to(tensors["model.embed_tokens.weight"].dtype)
    tensors["lm_head.weight"] = head.to(tensors["lm_head.weight"].dtype)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@contextlib.contextmanager
def serve(state: Path, home: Path):
    """`ninfer serve` with its defaults (only a free port; the journal under $XDG_STATE_HOME,
    the model under $NINFER_HOME)."""
    port = _free_port()
    env = {**os.environ, "XDG_STATE_HOME": str(state), "NINFER_HOME": str(home)}
    log = open(state / "serve.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.cli", "serve", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (state / "serve.log").read_text()
            time.sleep(0.2)
        else:
            raise AssertionError("the server did not become ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_claude_code_completes_a_turn(claude, tmp_path):
    home, work, state, models = (tmp_path / d for d in ("home", "work", "state", "models"))
    for d in (home, work, state, models):
        d.mkdir()
    model = ending_model(models)
    with serve(state, models) as url:
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home),
               "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "ninfer-local",
               "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
               "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
               "MAX_THINKING_TOKENS": "0"}   # thinking off: the model would end it at once
        done = subprocess.run([str(claude), "-p", "Say hello in one sentence."],
                              cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=900)
    server_log = (state / "serve.log").read_text()
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{server_log[-4000:]}"
    with contextlib.closing(sqlite3.connect(state / "ninfer" / "journal.db")) as db:
        rows = db.execute("SELECT request, kind, data FROM events WHERE kind IN "
                          "('RequestQueued', 'TokensCommitted', 'RequestFinished') "
                          "AND request NOT LIKE 'warmup-%' ORDER BY seq").fetchall()
    queued = {r: json.loads(d) for r, k, d in rows if k == "RequestQueued"}
    assert len(queued) == 1, server_log[-4000:]
    (rid, request), = queued.items()
    assert request["prompt_len"] > 40_000  # its system prompt and tools, in the default context
    assert any(r == rid for r, k, _ in rows if k == "RequestFinished")
    out = [t for r, k, d in rows if r == rid and k == "TokensCommitted"
           for t in json.loads(d)["tokens"]]
    stops = set(request["params"]["stop_tokens"])
    assert out[-1] in stops   # the model ended its turn
    reply = Tokenizer.from_dir(model).decode(out[:-1])
    assert reply.strip() and done.stdout.strip() == reply.strip()
