"""`ninfer bench turn`: where the next turn's time to first token goes, per stage, at long
contexts (4K, 16K, 32K tokens by default).

A server is built in this process as `ninfer serve` builds it (uvicorn on loopback, its own
journal), and for each size a conversation of n tokens is streamed (turn 1, a short reply),
then its reply is sent back with a ~26-token user message (turn 2), `--repeat` times, each a
conversation of its own. Turn 2 is timed two ways:

- served, from its journal (the events' wall times) and the client's clock: sent → the
  engine queued it (HTTP, parsing, the template, tokenising, the conversation's history,
  the submit check, the engine's pick-up), queued → started (the planner's reuse decision,
  the endpoint restored), started → prefill completed (the delta's prefill and the first
  token sampled, the checkpoints captured on the way; the delta's pieces between the
  checkpoints' positions and the model's forwards are counted: a short delta is one
  forward, its checkpoints picked from it), completed → the client's first
  token (the step's journal commit, the event routed, SSE framing, the socket); and the
  journal's bytes of the request's rows up to its first token (the engine thread encodes
  them as JSON before it releases the token);
- host side, by calling the server's own functions on the same request just before it is
  sent: JSON parsing and validation, the template render, the tokenising as served (the
  history's encoder), the anchors' prefix renders, the submit check, hashing the prompt's
  blocks and encoding its journal row as the journal writes it after the turn before's
  (naming that row's lists and packing the new ids: `listrefs`, `events.pack`).

The times are each stage's best over the repeats (the counts: medians); the table has one
column per size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sqlite3
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from .report import write_line

SIZES = (4096, 16384, 32768)
NEW_TOKENS, REPLY_TOKENS = 26, 16

# (key, what is timed); served stages first, then host-side ones
SERVED = [("ttft", "turn 2: time to first token, served"),
          ("to_queued", "  sent -> queued (HTTP .. submit)"),
          ("http_parse", "    of which HTTP + parse (a 404's trip)"),
          ("queued_to_started", "  queued -> started (plan, restore)"),
          ("started_to_prefilled", "  started -> prefilled (delta + 1st token)"),
          ("per_forward", "    per prefill forward (count below)"),
          ("prefilled_to_client", "  prefilled -> client (commit, SSE)")]
HOST = [("parse", "host: JSON parse + validate"),
        ("render", "host: template render (whole chat)"),
        ("tokenise_full", "host: tokenise whole text (no history)"),
        ("tokenise_served", "host: tokenise as served (history)"),
        ("render_chat", "host: render_chat as served (+anchors)"),
        ("submit_check", "host: engine submit check"),
        ("block_hashes", "host: prompt's block hashes, from scratch"),
        ("journal_row", "host: RequestQueued row as journaled")]


COUNTS = ("prompt_tokens", "cached_tokens", "pieces", "forwards", "journal_kib")


def _timed(fn: Callable[[], object], reps: int = 3) -> float:
    """The best of `reps` runs of `fn`, in ms."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return 1000 * best


class InProcessServer:
    """`ninfer serve` with `options`, on a free loopback port, in this process."""

    def __init__(self, options: list[str]) -> None:
        import uvicorn

        from ..server.serve import add_serve_parser, build
        self.journal = str(Path(tempfile.mkdtemp(prefix="ninfer-turn-")) / "journal.db")
        parser = argparse.ArgumentParser()
        add_serve_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(["serve", *options, "--journal", self.journal])
        self.app, self.server = build(args)
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                      access_log=False))
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._uvicorn.serve(sockets=[self._sock])), daemon=True)

    def __enter__(self) -> InProcessServer:
        import httpx
        self._thread.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError("the server did not become ready")

    def __exit__(self, *exc) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(10)
        self._sock.close()


def _read(journal: str, sql: str, *args) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as db:
        return db.execute(sql, args).fetchall()


class Journaled(NamedTuple):
    """What the journal says of one request up to its first token."""

    times: dict[str, float]   # wall time of each kind's first event
    pieces: int               # the delta's pieces between checkpoints: PrefillAdvanced
    kib: float                # its rows' payloads, written before the first token's release


def journaled(journal: str) -> Journaled:
    """The request queued last, up to its `PrefillCompleted`."""
    last = _read(journal, "SELECT request FROM events WHERE kind = 'RequestQueued' "
                          "ORDER BY seq DESC LIMIT 1")[0][0]
    times: dict[str, float] = {}
    pieces, size = 0, 0
    for kind, t, n in _read(journal, "SELECT kind, time, length(data) FROM events "
                                     "WHERE request = ? ORDER BY seq", last):
        if "PrefillCompleted" in times:
            break
        times.setdefault(kind, t)
        pieces += kind == "PrefillAdvanced"
        size += n
    return Journaled(times, pieces, size / 1024)


class ForwardTimes:
    """The wall times of the model's forwards (`forward_batch` calls), from now on: the
    engine thread's, while the bench thread reads them."""

    def __init__(self, model) -> None:
        self.model, self.inner = model, model.forward_batch
        self.times: list[float] = []

        def forward_batch(*args, **kw):
            self.times.append(time.time())
            return self.inner(*args, **kw)
        model.forward_batch = forward_batch

    def until(self, t: float) -> int:
        return sum(s <= t for s in self.times)

    def close(self) -> None:
        self.model.forward_batch = self.inner


def host_stages(server, messages: list[dict], session: str) -> dict[str, float]:
    """The host-side work of one chat request, timed by calling the server's own functions
    as `submission.start` calls them (nothing is submitted)."""
    from ..engine.commands import Submit, problem
    from ..lifecycle.events import RequestQueued, to_json
    from ..lifecycle.hashing import block_hashes
    from ..lifecycle.listrefs import Referrer
    from ..lifecycle.request import SamplingParams
    from ..server import sessions
    from ..server.reading import validate
    from ..server.schemas import ChatRequest
    from ..server.submission import encode, render_chat
    from ..server.unified import from_chat

    raw = json.dumps({"model": server.settings.model_id, "messages": messages, "stream": True,
                      "max_tokens": 2, "temperature": 0, "session_id": session,
                      "chat_template_kwargs": {"enable_thinking": False}}).encode()
    budget = server.settings.reasoning_budget
    unified = from_chat(validate(ChatRequest, json.loads(raw)), default_budget=budget)
    tenant = sessions.tenant(None, None)
    key = f"id-{session}"
    text = server.template.render(unified.template_messages(), add_generation_prompt=True,
                                  enable_thinking=unified.reasoning)

    def served_encoder():
        return server.history.encoder(lambda t: encode(server.tokenizer, t), tenant, key)

    ids = render_chat(server, unified, served_encoder()).ids
    submit = Submit(id="bench", prompt=tuple(ids), session=key, tenant=tenant,
                    params=SamplingParams(max_tokens=2))
    vocab = server.vocab_size
    hashes = block_hashes(submit.prompt)
    earlier = submit.prompt[:-NEW_TOKENS]   # (about) the turn before's prompt
    before = RequestQueued(seq=1, tenant=tenant, prompt_len=len(earlier),
                           block_hashes=block_hashes(earlier), tokens=earlier)
    row = RequestQueued(seq=2, tenant=tenant, prompt_len=len(submit.prompt),
                        block_hashes=hashes, tokens=submit.prompt)

    def journaled_row() -> str:
        """The row as the journal writes it after the turn before's: naming that row's
        lists (`listrefs`), the new ids packed."""
        refs = Referrer()
        refs.packer(before)
        return to_json(row, refs.packer(row))
    return {
        "parse": _timed(lambda: from_chat(validate(ChatRequest, json.loads(raw)),
                                          default_budget=budget)),
        "render": _timed(lambda: server.template.render(
            unified.template_messages(), add_generation_prompt=True,
            enable_thinking=unified.reasoning)),
        "tokenise_full": _timed(lambda: server.tokenizer.encode(text)),
        "tokenise_served": _timed(lambda: served_encoder()(text)),
        "render_chat": _timed(lambda: render_chat(server, unified, served_encoder())),
        "submit_check": _timed(lambda: problem(submit, vocab_size=vocab,
                                               max_context=server.settings.max_context)),
        "block_hashes": _timed(lambda: block_hashes(submit.prompt)),
        "journal_row": _timed(journaled_row),
    }


def http_trip(url: str, messages: list[dict], session: str) -> float:
    """The same request's round trip to the 404 that an unknown model gets: the client's
    encoding, HTTP both ways, the body read, parsed and validated (best of 3, ms)."""
    import httpx
    body = {"model": "no-such-model", "messages": messages, "max_tokens": 2, "stream": True,
            "temperature": 0, "reasoning_effort": "none"}
    with httpx.Client(timeout=60) as client:
        def post() -> None:
            status = client.post(url + "/v1/chat/completions", json=body,
                                 headers={"X-Session-Id": session}).status_code
            assert status == 404, status
        return _timed(post)


def one_turn(url: str, server, journal: str, prompts, n: int, key: int) -> dict[str, float]:
    """Turn 1 of n tokens, then turn 2, on the server at `url` (`server` its `Server`,
    `journal` its journal's path): turn 2's stages in ms."""
    from .timed_stream import stream_chat
    session = f"turn-{key}"
    history = prompts.messages(n, key)
    turn1 = stream_chat(url, history, session=session, max_tokens=REPLY_TOKENS)
    history = [*history, {"role": "assistant", "content": turn1.text}]
    messages = prompts.follow_up(history, NEW_TOKENS, key)
    out = host_stages(server, messages, session)
    out["http_parse"] = http_trip(url, messages, session)
    wall_minus_perf = time.time() - time.perf_counter()
    watch = ForwardTimes(server.thread.engine.model)
    try:
        turn2 = stream_chat(url, messages, session=session, max_tokens=2)
    finally:
        watch.close()
    events, pieces, kib = journaled(journal)
    forwards = watch.until(events["PrefillCompleted"])
    sent, first = turn2.sent + wall_minus_perf, turn2.arrivals[0] + wall_minus_perf
    queued, started = events["RequestQueued"], events["RequestStarted"]
    prefilled = events["PrefillCompleted"]
    out.update(ttft=1000 * turn2.ttft, to_queued=1000 * (queued - sent),
               queued_to_started=1000 * (started - queued),
               started_to_prefilled=1000 * (prefilled - started),
               prefilled_to_client=1000 * (first - prefilled),
               per_forward=1000 * (prefilled - started) / max(forwards, 1),
               prompt_tokens=turn2.prompt_tokens, cached_tokens=turn2.cached_tokens,
               pieces=pieces, forwards=forwards, journal_kib=kib)
    return out


def summary(runs: dict[int, list[dict]], repeat: int) -> dict:
    """Each stage's least time per size over the repeats, each stage on its own (the run
    the shared machine disturbed least: `<stage>_ms_<n>`), and the counts' medians
    (`<what>_n_<n>`), printed as a table with a column per size."""
    sizes = list(runs)
    results: dict = {}
    for n in sizes:
        for key in runs[n][0]:
            results[f"{key}_{'n' if key in COUNTS else 'ms'}"
                    f"_{n}"] = (statistics.median if key in COUNTS else min)(
                        run[key] for run in runs[n])
    print(f"next turn ({NEW_TOKENS} new tokens), ms, each stage's best of {repeat}")
    print(f"{'stage':<44}" + "".join(f"{n:>10,}" for n in sizes))
    for key, label in [*SERVED, *HOST]:
        print(f"{label:<44}" + "".join(f"{results[f'{key}_ms_{n}']:>10.2f}" for n in sizes))
    for key in COUNTS:
        print(f"{key:<44}" + "".join(f"{results[f'{key}_n_{n}']:>10,.0f}" for n in sizes))
    return results


def server_options(sizes: tuple[int, ...], threads: int, device: str = "cpu",
                   model: str | None = None) -> list[str]:
    """A context that holds the longest conversation, KV for three, the device's dtype."""
    from ..server.serve import default_dtype
    longest = max(sizes) + 1024
    return [*([model] if model else []), "--device", device, "--dtype", default_dtype(device),
            "--prefill-chunk", "2048", "--max-context", str(longest),
            "--kv-capacity", str(3 * longest), "--max-concurrency", "2",
            "--torch-threads", str(threads), "--log-level", "WARNING"]


def main(sizes: tuple[int, ...] = SIZES, repeat: int = 5, threads: int = 1,
         json_path: str | None = None, device: str = "cpu", model: str | None = None) -> int:
    from ..model.runtime import benchmark_on_the_random_model
    from .sized_prompts import PromptMaker
    benchmark_on_the_random_model()
    prompts = PromptMaker.for_model(model)
    options = server_options(sizes, threads, device, model)
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    with InProcessServer(options) as running:
        for r in range(repeat):
            for n in sizes:  # sizes interleaved: a drift of the shared machine hits all
                runs[n].append(one_turn(running.url, running.server, running.journal, prompts,
                                        n, key=1000 * r + n))
    print(f"{device}, {model or 'the random tiny model'}")
    results = summary(runs, repeat)
    write_line({"bench": "turn", "results": results, "server_options": options,
                "device": device, "sizes": list(sizes), "repeat": repeat}, json_path)
    return 0


def add_bench_parser(sub) -> None:
    p = sub.add_parser("turn", help="the next turn's time to first token, per stage, at long "
                                    "contexts (an in-process server; the CPU and the random "
                                    "tiny model unless told)")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)),
                   help="conversation lengths in tokens before the next turn (comma-separated)")
    p.add_argument("--repeat", type=int, default=5, help="conversations per size")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="a model directory or .ninfer file")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=lambda a: main(tuple(int(s) for s in a.sizes.split(",")), a.repeat,
                                       a.torch_threads, a.json, a.device, a.model))
