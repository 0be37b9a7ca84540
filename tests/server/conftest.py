"""A real ninfer server (uvicorn on loopback, a free port) for the session, built by the same
`build(args)` as `ninfer serve`: model loading and warm-up in the background, /health 503
until ready. Tests change options through `configured(...)` and read the journal through
their own read-only SQLite connection; `scripted` makes the random model 'write' a text."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sqlite3
import threading
import time

import httpx
import pytest
import uvicorn

from ninfer.lifecycle.reader import JournalReader
from ninfer.server.serve import add_serve_parser, build

OPTIONS = ["--spec", "mtp", "--max-concurrency", "2", "--prefill-chunk", "48",
           "--torch-threads", "1",
           "--max-context", "2048", "--kv-capacity", "8192", "--max-endpoints", "24",
           "--default-max-tokens", "8", "--auto-long-anchors", "2", "--keepalive", "0.5",
           "--log-level", "INFO",
           # NINFER_TEST_TENSOR_PARALLEL=N: the session's server shards its model over N ranks
           "--tensor-parallel", os.environ.get("NINFER_TEST_TENSOR_PARALLEL", "1")]


@dataclasses.dataclass
class Running:
    url: str
    server: object        # ninfer.server.app.Server
    journal_path: str
    health_before_ready: int

    @property
    def engine(self):
        return self.server.thread.engine

    def events(self, request_id: str) -> list[tuple[str, dict, float]]:
        """(kind, data, time) of one request's journaled events, in order."""
        # (a reader on a plain read-only connection: `open`'s look at the live WAL is not
        # needed); it reads lists that name earlier rows' whole
        with JournalReader(sqlite3.connect(f"file:{self.journal_path}?mode=ro", uri=True),
                           self.journal_path) as reader:
            rows = [reader.readable(r) for r in reader.rows(request=request_id)]
        return [(r["kind"], r["data"], r["time"]) for r in rows]

    def wait_terminal(self, request_id: str, timeout: float = 10.0,
                      kinds=("RequestFinished", "RequestCancelled", "RequestFailed")):
        """The first of `kinds` journaled for the request (its terminal event by default)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for kind, data, t in self.events(request_id):
                if kind in kinds:
                    return kind, data, t
            time.sleep(0.01)
        raise AssertionError(f"{request_id} did not end within {timeout} s")

    def wait_told(self, request_id: str, timeout: float = 10.0):
        """The event that ended the request for its client: its terminal one, or the
        detaching of its cut prefill."""
        return self.wait_terminal(request_id, timeout, (
            "RequestFinished", "RequestCancelled", "RequestFailed", "PrefillDetached"))

    def started(self, request_id: str) -> dict:
        return [d for k, d, _ in self.events(request_id) if k == "RequestStarted"][-1]

    @contextlib.contextmanager
    def configured(self, *, step_delay: float | None = None, **settings):
        """Change settings (and the engine's step delay) for the block's duration."""
        old_settings, old_delay = self.server.settings, self.server.thread.step_delay
        self.server.settings = dataclasses.replace(old_settings, **settings)
        if step_delay is not None:
            self.server.thread.step_delay = step_delay
        try:
            yield self
        finally:
            self.server.settings, self.server.thread.step_delay = old_settings, old_delay

    def integrity(self) -> None:
        self.server.thread.call(lambda e: e.check_integrity()).result(10)


def _parse(options: list[str]):
    import argparse
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *options])


@pytest.fixture(scope="session")
def live(tmp_path_factory) -> Running:
    import torch
    threads = torch.get_num_threads()  # the server sets it for the process; restored after
    journal = str(tmp_path_factory.mktemp("serve") / "journal.db")
    args = _parse([*OPTIONS, "--journal", journal])
    # loading waits for the first /health answer, so that answer is the one given while
    # loading (it raced the load: a busy machine once polled first after it, 200)
    from ninfer.server import serve as serving
    answered, real_load = threading.Event(), serving.load

    def load_after_the_first_answer(a):
        answered.wait(60)
        return real_load(a)
    serving.load = load_after_the_first_answer
    app, server = build(args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=2)
    userver = uvicorn.Server(config)
    thread = threading.Thread(target=userver.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    first = None
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            try:
                response = httpx.get(f"{url}/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            status = response.status_code
            if first is None:
                first = status
                answered.set()
                if status == 503:  # that very answer (a second request may find it ready)
                    assert int(response.headers["retry-after"]) >= 1
            if status == 200:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the server did not become ready")
    finally:
        answered.set()
        serving.load = real_load
    running = Running(url, server, journal, first)
    degree = int(os.environ.get("NINFER_TEST_TENSOR_PARALLEL", "1"))
    if degree > 1:  # the suite runs on what it says it runs on
        assert running.engine.model.identity.endswith(f"-tp{degree}")
    yield running
    userver.should_exit = True
    thread.join(10)
    sock.close()
    torch.set_num_threads(threads)


class ScriptedText:
    """A detokenizer stub: whatever ids arrive, the text is the script, one piece per call."""

    def __init__(self, pieces):
        self.pieces = list(pieces)

    def push(self, ids):
        return self.pieces.pop(0) if self.pieces else ""

    def finish(self):  # whatever the model's token count, the whole script is written
        rest, self.pieces[:] = "".join(self.pieces), []
        return rest


@pytest.fixture
def scripted(live, monkeypatch):
    """Make the next generations 'write' a given text (the model is random)."""
    tokenizer = live.server.tokenizer
    script: list[str] = []

    class Stub:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def stream(self, **kw):
            return ScriptedText(script)

    monkeypatch.setattr(live.server, "tokenizer", Stub())
    return script


class _Special:
    """The tokenizer's special tokens, with every id an end-of-text one."""

    def __init__(self, special, vocab_size: int) -> None:
        self._special, self.stop_ids = special, frozenset(range(vocab_size))

    def __getattr__(self, name):
        return getattr(self._special, name)


@pytest.fixture
def ends_at_once(live, monkeypatch):
    """The next generations 'write' a given text and end at their first token, as a model
    that stops by itself does (the random model almost never does)."""
    tokenizer = live.server.tokenizer
    script: list[str] = []
    special = _Special(tokenizer.special, live.server.vocab_size)

    class Stub:
        def __getattr__(self, name):
            return special if name == "special" else getattr(tokenizer, name)

        def stream(self, **kw):
            return ScriptedText(script)

    monkeypatch.setattr(live.server, "tokenizer", Stub())
    return script

