"""A server killed with SIGKILL mid-stream restarts on the same journal: recovery closes the
interrupted request and drops endpoints whose tensors died, then serves; `journal check`
passes on the result. A real subprocess and a real SIGKILL."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from ninfer.engine.durable import _metadata
from ninfer.tools.journal import main as journal_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path, port, *extra):
    env = {**os.environ, "NINFER_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ninfer.cli", "serve", "--port", str(port), "--spec", "mtp",
         "--journal", str(tmp_path / "journal.db"), "--prefill-chunk", "48",
         "--step-delay-ms", "20", "--torch-threads", "1", "--log-level", "WARNING", *extra],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert proc.poll() is None, "the server exited"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not become ready")


def _chat(port, content, stream=False, max_tokens=8):
    return {"url": f"http://127.0.0.1:{port}/v1/chat/completions",
            "json": {"model": "tiny-qwen3-next-v1", "max_tokens": max_tokens, "stream": stream,
                     "messages": [{"role": "user", "content": content}]},
            "headers": {"X-Session-Id": "crash"}}


def test_sigkill_mid_stream_then_restart(tmp_path, capsys):
    port = _free_port()
    proc = _serve(tmp_path, port)
    try:
        done = httpx.post(timeout=60, **_chat(port, "A first turn that finishes."))
        assert done.status_code == 200
        with httpx.stream("POST", timeout=60, **_chat(port, "A long one.", True, 400)) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data:")
                if chunks >= 5:
                    break  # mid-stream: tokens are flowing
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = _serve(tmp_path, port)  # the same journal
    try:
        again = httpx.post(timeout=60, **_chat(port, "After the crash."))
        assert again.status_code == 200
    finally:
        proc.terminate()
        proc.wait(10)
    assert journal_main(["journal", "check", str(tmp_path / "journal.db")]) == 0
    capsys.readouterr()
    assert journal_main(["journal", "export", str(tmp_path / "journal.db")]) == 0
    events = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    failed = [e for e in events if e["kind"] == "RequestFailed"]
    assert any(e["data"]["failure"] == "interrupted" for e in failed)
    assert any(e["kind"] == "EndpointLost" for e in events)
    assert sum(e["kind"] == "ServerStarted" for e in events) == 2


def _positions(folder) -> set[int]:
    """The positions the durable endpoint files in `folder` cover (whole files only)."""
    found = set()
    for f in folder.glob("*.safetensors"):
        found.add(int(_metadata(f.read_bytes())["position"]))
    return found


def test_sigkill_then_restart_resumes_with_reuse_from_durable_endpoints(tmp_path):
    port, folder = _free_port(), tmp_path / "endpoints"
    proc = _serve(tmp_path, port, "--persist-endpoints", str(folder))
    turn = [{"role": "user", "content": "Remember the number forty-two, please."}]
    body = _chat(port, turn[0]["content"])
    body["json"]["reasoning_effort"] = "none"  # the reply is content, sent back as it is
    try:
        first = httpx.post(timeout=60, **body)
        assert first.status_code == 200
        usage = first.json()["usage"]
        whole = usage["prompt_tokens"] + usage["completion_tokens"] - 1
        # written in the background, an earlier endpoint of the turn (a prefill chunk's)
        # maybe first: wait for the file of the one that covers the whole turn
        deadline = time.monotonic() + 30
        while whole not in _positions(folder) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert whole in _positions(folder)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = _serve(tmp_path, port, "--persist-endpoints", str(folder))
    try:
        reply = first.json()["choices"][0]["message"]["content"]
        assert reply
        body["json"]["messages"] = turn + [{"role": "assistant", "content": reply},
                                           {"role": "user", "content": "Which number?"}]
        second = httpx.post(timeout=60, **body)
        assert second.status_code == 200
        # everything the first turn computed, its prompt and output but the last token
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == whole
    finally:
        proc.terminate()
        proc.wait(10)
    assert journal_main(["journal", "check", str(tmp_path / "journal.db")]) == 0
