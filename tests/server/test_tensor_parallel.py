"""`ninfer serve --tensor-parallel 2` as a supervisor runs it (a process of its own, gloo on
the CPU): greedy output equals the single-process server's, a cancel storm leaves a sound
journal and server, a restart with another degree loses the old endpoints rather than
loading them, a follower killed mid-step gives 503s and exit status 3 with a journal that
passes `ninfer journal check`, and a model that cannot be split is refused with status 2."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen3-next-v1"
OPTIONS = ["--spec", "mtp", "--max-concurrency", "2", "--prefill-chunk", "32",
           "--torch-threads", "1", "--max-context", "1024", "--kv-capacity", "4096",
           "--default-max-tokens", "8", "--log-level", "WARNING"]
PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "{\"name\": \"tiny\", \"size\":"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, tmp: Path, name: str, *extra: str, journal: Path | None = None) -> None:
        self.port = _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.journal = journal or tmp / f"{name}.db"
        self.log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ninfer.server.serve", *OPTIONS, "--port", str(self.port),
             "--journal", str(self.journal), *extra],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=self.log,
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (tmp / f"{name}.log").read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise AssertionError("the server did not become ready")

    def complete(self, prompt: str, max_tokens: int = 12, session: str | None = None,
                 timeout: float = 60) -> httpx.Response:
        headers = {"X-Session-Id": session} if session else {}
        return httpx.post(f"{self.url}/v1/completions", headers=headers, timeout=timeout,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0})

    def chat(self, messages: list[dict], session: str) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/chat/completions", headers={"X-Session-Id": session},
                          timeout=60, json={"model": MODEL, "messages": messages,
                                            "max_tokens": 12, "temperature": 0})

    def followers(self) -> list[int]:
        """The server's child processes, whichever of its threads spawned them: the loading
        thread does, and a child moves to another thread when that one exits."""
        tasks = Path(f"/proc/{self.process.pid}/task").glob("*/children")
        return sorted({int(p) for task in tasks for p in _read(task).split()})

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
        return self.process.wait()

    def events(self, kind: str) -> list[tuple[str, str]]:
        with contextlib.closing(sqlite3.connect(f"file:{self.journal}?mode=ro", uri=True)) as db:
            return db.execute("SELECT request, data FROM events WHERE kind = ? ORDER BY seq",
                              (kind,)).fetchall()


def _read(path: Path) -> str:
    """A /proc file's text, or nothing when its thread has just exited."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _journal_check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer.cli", "journal", "check", str(path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-serve")
    persist = tmp / "endpoints"
    one = Served(tmp, "one")
    two = Served(tmp, "two", "--tensor-parallel", "2", "--persist-endpoints", str(persist))
    yield one, two, tmp, persist
    one.stop()
    two.stop()


def test_greedy_output_equals_the_single_process_servers(servers):
    one, two, _, _ = servers
    assert len(two.followers()) == 1
    for i, prompt in enumerate(PROMPTS):
        a, b = one.complete(prompt), two.complete(prompt)
        assert a.status_code == b.status_code == 200
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
        # a conversation's next turn reuses the first's endpoint, every rank's parts of it
        turn = [{"role": "user", "content": (prompt + " ") * 6}]
        a, b = one.chat(turn, f"g{i}"), two.chat(turn, f"g{i}")
        assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
        turn += [a.json()["choices"][0]["message"], {"role": "user", "content": "go on"}]
        a, b = one.chat(turn, f"g{i}"), two.chat(turn, f"g{i}")
        assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
        cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (a, b)]
        assert cached[0] == cached[1] > 0


def test_a_cancel_storm_leaves_a_sound_server_and_journal(servers):
    one, two, _, _ = servers

    def cut(i: int) -> None:
        body = {"model": MODEL, "prompt": PROMPTS[i % 3] + " storm", "max_tokens": 64,
                "temperature": 0, "stream": True}
        with contextlib.suppress(httpx.HTTPError), httpx.stream(
                "POST", f"{two.url}/v1/completions", json=body, timeout=30,
                headers={"X-Session-Id": f"storm{i % 4}"}) as response:
            for n, _ in enumerate(response.iter_lines()):
                if n >= i % 5:
                    break  # the client goes away mid-stream (or at once)

    threads = [threading.Thread(target=cut, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert httpx.get(f"{two.url}/health", timeout=5).status_code == 200
    after = "after the storm"
    assert (two.complete(after).json()["choices"][0]["text"]
            == one.complete(after).json()["choices"][0]["text"])
    assert two.events("RequestCancelled")
    done = _journal_check(two.journal)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_restart_with_another_degree_loses_the_endpoints_never_loads_them(servers):
    _, two, tmp, persist = servers
    assert two.complete("remember this conversation", session="keep").status_code == 200
    published = {json.loads(d)["endpoint"]["id"] for _, d in two.events("EndpointPublished")}
    gone = {json.loads(d)["endpoint"] for _, d in two.events("EndpointEvicted")}
    assert published - gone and any(persist.iterdir())
    assert two.stop() in (0, -signal.SIGINT)  # uvicorn re-raises the signal it handled
    again = Served(tmp, "two-as-one", "--persist-endpoints", str(persist), journal=two.journal)
    try:
        lost = again.events("EndpointLost")
        assert {json.loads(d)["endpoint"] for _, d in lost} == published - gone  # every one
        assert all("-tp2' is not the server's" in data for _, data in lost), lost
        r = again.complete("remember this conversation more", session="keep")
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        assert again.stop() in (0, -signal.SIGINT)
    done = _journal_check(two.journal)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
def test_a_follower_lost_mid_step_fails_the_requests_and_the_server_exits(tmp_path, how):
    """Killed: the collectives fail at once; stopped: they time out after --tp-timeout."""
    served = Served(tmp_path, "lost", "--tensor-parallel", "2", "--tp-timeout", "3",
                    "--step-delay-ms", "20")
    [follower] = served.followers()
    answers: list[httpx.Response] = []
    inflight = threading.Thread(target=lambda: answers.append(
        served.complete("a long answer " * 4, max_tokens=400)))
    inflight.start()
    deadline = time.monotonic() + 30
    while not [r for r, _ in served.events("TokensCommitted") if not r.startswith("warmup")]:
        assert time.monotonic() < deadline  # until it decodes: the ranks are mid-steps
        time.sleep(0.02)
    lost_at = time.monotonic()
    os.kill(follower, how)
    inflight.join(60)
    assert answers and answers[0].status_code == 503, answers
    assert answers[0].json()["error"]["code"] == "engine_stopped"
    assert served.process.wait(60) == 3  # for a supervisor to restart it
    assert time.monotonic() - lost_at < 30  # bounded: never a hang
    served.stop()
    with contextlib.suppress(ProcessLookupError):
        os.kill(follower, signal.SIGKILL)  # a stopped follower (rank 0 killed it already)
    failed = served.events("RequestFailed")
    assert failed and all('"interrupted"' in data for _, data in failed)
    done = _journal_check(served.journal)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_model_that_cannot_be_split_is_refused_with_status_2():
    done = subprocess.run([sys.executable, "-m", "ninfer.server.serve", "--tensor-parallel",
                           "3", "--journal", os.devnull], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2
    assert "--tensor-parallel 3: this model cannot be split over 3 ranks: attention heads (2)" \
        in done.stderr
    assert "Traceback" not in done.stderr


def test_a_follower_that_dies_while_the_server_is_idle_makes_it_exit_too(tmp_path):
    served = Served(tmp_path, "idle", "--tensor-parallel", "2")
    [follower] = served.followers()
    os.kill(follower, signal.SIGKILL)
    assert served.process.wait(30) == 3  # no request needed to find out
    served.stop()
    done = _journal_check(served.journal)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_disconnect_and_session_tests_pass_on_a_two_rank_server():
    """A representative part of the server suite against its session server sharded over
    two ranks (the whole suite runs so with NINFER_TEST_TENSOR_PARALLEL=2)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "tests/server/test_disconnect.py", "tests/server/test_sessions.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT), "NINFER_TEST_TENSOR_PARALLEL": "2"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
