"""`ninfer bench serve`: the HTTP server measured against the bare engine, on the embedded
tiny model, in one process (uvicorn on loopback; clients on threads, so on a small machine
they share the cores with the server: the figures are an upper bound on overhead).

Measures: time to first token (cold prompt, and the next turn reusing it), streaming
overhead per token over the bare engine (chat completions, and the Responses API and
Anthropic's Messages API against it: the same prompt and output, runs alternated), total
tokens/s at 1/4/8 concurrent streams, 8 streams through HTTP against the bare engine at
batch 8 with the serving path's CPU time per token, a stream's gaps between tokens while a
long prompt prefills (serve_streams.py), and disconnect-to-cancel latency (client cut to
RequestCancelled, and in engine steps)."""

from __future__ import annotations

import argparse
import json
import re
import socket
import sqlite3
import statistics
import tempfile
import threading
import time
from pathlib import Path

from . import serve_streams as streams

OUTPUT = 64
PREFILL_CHUNK = 512       # the server's default on the CPU
LONG_PROMPT_LINES = 260   # about 7.9K tokens: the prompt prefilling beside a stream


def _server(options: list[str]):
    import uvicorn

    from ..server.serve import add_serve_parser, build
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *options])
    app, server = build(args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    userver = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=userver.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    import httpx
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    return url, server, userver, thread


def _prompt(n_lines: int, tag: str) -> list[dict]:
    text = " ".join(f"{tag} line {i}: the daily report shows stable temperature." for i in
                    range(n_lines))
    return [{"role": "user", "content": text}]


def sse_chunks(lines):
    """The JSON chunks of an OpenAI-style event stream's `data:` lines, to `[DONE]`."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _stream(url: str, body: dict, headers: dict | None = None, client=None) -> dict:
    """One streaming request: time to first content chunk, total time, tokens. `client`: an
    `httpx.Client` to send it with (None: httpx's own, made for this request)."""
    import httpx
    start = time.perf_counter()
    first = None
    usage = None
    deltas = 0
    with (client or httpx).stream("POST", url + "/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}},
            headers=headers or {}, timeout=600) as r:
        for chunk in sse_chunks(r.iter_lines()):
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif first is None and chunk["choices"] and "role" not in chunk["choices"][0][
                    "delta"]:
                first = time.perf_counter() - start
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                deltas += 1
    return {"ttft": first, "total": time.perf_counter() - start, "usage": usage,
            "content_chunks": deltas}


def _stream_responses(url: str, body: dict, headers: dict | None = None) -> dict:
    """One streaming request of the Responses API, measured as `_stream` measures chat
    completions: time to the first text delta, total time, and usage in chat's terms."""
    import httpx
    start = time.perf_counter()
    first = None
    usage = None
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True},
                      headers=headers or {}, timeout=600) as r:
        for event in sse_chunks(r.iter_lines()):
            if first is None and event["type"].endswith("_text.delta"):
                first = time.perf_counter() - start
            elif event["type"] in ("response.completed", "response.incomplete"):
                u = event["response"]["usage"]
                usage = {"prompt_tokens": u["input_tokens"],
                         "completion_tokens": u["output_tokens"],
                         "prompt_tokens_details": u["input_tokens_details"]}
    return {"ttft": first, "total": time.perf_counter() - start, "usage": usage}


def _stream_messages(url: str, body: dict, headers: dict | None = None) -> dict:
    """One streaming request of Anthropic's Messages API, measured as `_stream` measures chat
    completions: time to the first text delta, total time, and usage in chat's terms (the
    prompt is the tokens computed and the ones read from the cache together)."""
    import httpx
    start = time.perf_counter()
    first = None
    usage = None
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True},
                      headers=headers or {}, timeout=600) as r:
        for event in sse_chunks(r.iter_lines()):
            if first is None and event["type"] == "content_block_delta" \
                    and event["delta"]["type"] == "text_delta":
                first = time.perf_counter() - start
            elif event["type"] == "message_delta":
                u = event["usage"]
                cached = u["cache_read_input_tokens"]
                usage = {"prompt_tokens": u["input_tokens"] + cached,
                         "completion_tokens": u["output_tokens"],
                         "prompt_tokens_details": {"cached_tokens": cached}}
    return {"ttft": first, "total": time.perf_counter() - start, "usage": usage}


def _bare_engine_seconds(args, prompt_ids: tuple[int, ...]) -> tuple[float, float]:
    """Prefill and decode time of one request on a bare engine (no HTTP)."""
    from ..engine.engine import Engine, EngineConfig, Submit
    from ..lifecycle.request import SamplingParams
    from ..model.runtime import open_model
    om = open_model(kv_capacity=16_384, num_slots=32, mtp=args.spec == "mtp")
    engine = Engine(om.model, EngineConfig(spec=args.spec, prefill_chunk=512,
                                           max_context=8192), blocks=om.blocks, slots=om.slots)
    engine.recover()
    best = (float("inf"), float("inf"))
    for i in range(3):
        engine.submit(Submit(f"bare{i}", prompt_ids, None, "bench",
                             SamplingParams(max_tokens=OUTPUT)))
        start, first = time.perf_counter(), None
        while not engine.idle():
            for event in engine.step():
                if event.kind == "TokensCommitted" and first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
        best = min(best, (first - start, end - first))
    return best


def main(spec: str = "none", threads: int = 1, json_path: str | None = None) -> int:
    from ..model.runtime import benchmark_on_the_random_model
    benchmark_on_the_random_model()
    import httpx
    import torch

    from ..model.runtime import open_model
    torch.set_num_threads(threads)
    journal = Path(tempfile.mkdtemp(prefix="ninfer-bench-")) / "journal.db"
    url, server, userver, thread = _server([
        "--spec", spec, "--max-concurrency", "8", "--prefill-chunk", str(PREFILL_CHUNK),
        "--max-context", "8192", "--kv-capacity", "65536", "--journal", str(journal),
        "--torch-threads", str(threads), "--log-level", "WARNING", "--max-endpoints", "64"])
    results: dict = {"spec": spec, "torch_threads": threads, "output_tokens": OUTPUT}
    body = {"max_tokens": OUTPUT, "temperature": 0, "reasoning_effort": "none"}

    # time to first token: cold, then the next turn of the same session
    messages = _prompt(120, "ttft")
    _stream(url, {**body, "messages": _prompt(120, "warm-up")})
    cold = _stream(url, {**body, "messages": messages}, {"X-Session-Id": "ttft"})
    reply = httpx.post(url + "/v1/chat/completions", json={**body, "messages": messages},
                       headers={"X-Session-Id": "ttft"}, timeout=600).json()
    turn2 = [*messages, {"role": "assistant", "content": reply["choices"][0]["message"][
        "content"]}, {"role": "user", "content": "And then?"}]
    warm = _stream(url, {**body, "messages": turn2}, {"X-Session-Id": "ttft"})
    results["ttft_cold_s"] = cold["ttft"]
    results["ttft_cold_prompt_tokens"] = cold["usage"]["prompt_tokens"]
    results["ttft_next_turn_s"] = warm["ttft"]
    results["next_turn_cached_tokens"] = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    results["next_turn_prompt_tokens"] = warm["usage"]["prompt_tokens"]

    # streaming overhead per token over the bare engine (same prompt and output length)
    om = open_model(kv_capacity=64, num_slots=2)
    short = _prompt(4, "overhead")
    ids = tuple(om.tokenizer.encode(om.template.render(short, add_generation_prompt=True,
                                                       enable_thinking=False)))
    server.thread.step_delay = 0
    # chat completions, the Responses API and the Messages API alternated, the same prompt
    # and greedy output (thinking off on each)
    responses_body = {"max_output_tokens": OUTPUT, "temperature": 0,
                      "reasoning": {"effort": "none"}, "input": short}
    messages_body = {"model": "claude-bench", "max_tokens": OUTPUT, "temperature": 0,
                     "thinking": {"type": "disabled"}, "messages": short}
    runs, responses_runs, messages_runs = [], [], []
    for _ in range(3):
        runs.append(_stream(url, {**body, "messages": short}))
        responses_runs.append(_stream_responses(url, responses_body))
        messages_runs.append(_stream_messages(url, messages_body))
    http_decode = min(r["total"] - r["ttft"] for r in runs)
    responses_decode = min(r["total"] - r["ttft"] for r in responses_runs)
    messages_decode = min(r["total"] - r["ttft"] for r in messages_runs)
    bare_prefill, bare_decode = _bare_engine_seconds(argparse.Namespace(spec=spec), ids)
    results["bare_decode_ms_per_token"] = 1000 * bare_decode / (OUTPUT - 1)
    results["http_decode_ms_per_token"] = 1000 * http_decode / (OUTPUT - 1)
    results["stream_overhead_ms_per_token"] = (results["http_decode_ms_per_token"]
                                               - results["bare_decode_ms_per_token"])
    results["responses_output_tokens"] = min(r["usage"]["completion_tokens"]
                                             for r in responses_runs)
    results["responses_decode_ms_per_token"] = 1000 * responses_decode / (OUTPUT - 1)
    results["responses_stream_overhead_ms_per_token"] = (
        results["responses_decode_ms_per_token"] - results["bare_decode_ms_per_token"])
    # the Responses API's decode per token over chat completions' (goal: within 10%)
    results["responses_vs_chat_decode"] = responses_decode / http_decode
    results["messages_output_tokens"] = min(r["usage"]["completion_tokens"]
                                            for r in messages_runs)
    results["messages_decode_ms_per_token"] = 1000 * messages_decode / (OUTPUT - 1)
    results["messages_stream_overhead_ms_per_token"] = (
        results["messages_decode_ms_per_token"] - results["bare_decode_ms_per_token"])
    # the Messages API's decode per token over chat completions' (goal: within 10%)
    results["messages_vs_chat_decode"] = messages_decode / http_decode

    # total tokens/s at 1, 4, 8 concurrent streams
    for n in (1, 4, 8):
        out: list[dict] = []
        lock = threading.Lock()

        def client(i: int, n=n, out=out, lock=lock) -> None:
            r = _stream(url, {**body, "messages": _prompt(6, f"c{n}-{i}")})
            with lock:
                out.append(r)
        start = time.perf_counter()
        workers = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - start
        results[f"tokens_per_s_{n}_streams"] = sum(r["usage"]["completion_tokens"]
                                                   for r in out) / elapsed

    # 8 streams through HTTP against the bare engine at batch 8, and the CPU time per token
    # of the serving path; a stream's gaps between tokens while a long prompt prefills
    def prompt_ids(messages: list[dict]) -> tuple[int, ...]:
        return tuple(om.tokenizer.encode(om.template.render(
            messages, add_generation_prompt=True, enable_thinking=False)))
    results.update(streams.through_http_vs_engine(
        url, body, prompt_ids, _prompt, spec, OUTPUT, PREFILL_CHUNK, thread,
        server.thread.native))
    results.update(streams.gap_during_prefill(url, {**body, "messages": short},
                                              _prompt(LONG_PROMPT_LINES, "long")))

    # disconnect-to-cancel: cut streams mid-decode
    server.thread.step_delay = 0.01
    host, port = url.removeprefix("http://").split(":")
    before = len(server.thread.cancel_latencies)
    closed: dict[str, float] = {}
    for i in range(10):
        data = json.dumps({**body, "max_tokens": 400, "stream": True,
                           "messages": _prompt(3, f"cut{i}")}).encode()
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(data)).encode()
                  + b"\r\n\r\n" + data)
        buf = b""
        while buf.count(b"data: ") < 3:
            buf += s.recv(65536)
        rid = re.search(rb"x-request-id: (\S+)", buf, re.I).group(1).decode()
        closed[rid] = time.time()
        s.close()
        deadline = time.monotonic() + 10
        while len(server.thread.cancel_latencies) <= before + i and time.monotonic() < deadline:
            time.sleep(0.001)
    server.thread.step_delay = 0
    cut_latency = server.thread.cancel_latencies[before:]
    seconds = [s for s, _ in cut_latency]
    results["cancel_latency_ms_median"] = 1000 * statistics.median(seconds)
    results["cancel_latency_ms_max"] = 1000 * max(seconds)
    results["cancel_steps_max"] = max(st for _, st in cut_latency)
    with sqlite3.connect(journal) as db:  # from the client's close to the journaled event
        rows = db.execute("SELECT request, time FROM events WHERE kind = 'RequestCancelled'")
        from_close = [t - closed[r] for r, t in rows if r in closed]
    results["close_to_cancelled_ms_median"] = 1000 * statistics.median(from_close)
    results["close_to_cancelled_ms_max"] = 1000 * max(from_close)
    userver.should_exit = True
    thread.join(10)

    rows = [("time to first token, cold "
             f"({results['ttft_cold_prompt_tokens']} prompt tokens)",
             f"{results['ttft_cold_s'] * 1000:.0f} ms"),
            (f"time to first token, next turn ({results['next_turn_cached_tokens']} of "
             f"{results['next_turn_prompt_tokens']} cached)",
             f"{results['ttft_next_turn_s'] * 1000:.0f} ms"),
            ("decode per token: bare engine / over HTTP streaming",
             f"{results['bare_decode_ms_per_token']:.2f} / "
             f"{results['http_decode_ms_per_token']:.2f} ms"),
            ("streaming overhead per token", f"{results['stream_overhead_ms_per_token']:.2f} ms"),
            ("Responses API: decode per token / overhead per token",
             f"{results['responses_decode_ms_per_token']:.2f} / "
             f"{results['responses_stream_overhead_ms_per_token']:.2f} ms"),
            ("Responses API decode per token over chat completions'",
             f"{100 * (results['responses_vs_chat_decode'] - 1):+.1f}%"),
            ("Messages API: decode per token / overhead per token",
             f"{results['messages_decode_ms_per_token']:.2f} / "
             f"{results['messages_stream_overhead_ms_per_token']:.2f} ms"),
            ("Messages API decode per token over chat completions'",
             f"{100 * (results['messages_vs_chat_decode'] - 1):+.1f}%")]
    rows += [(f"total tokens/s, {n} concurrent streams",
              f"{results[f'tokens_per_s_{n}_streams']:.0f}") for n in (1, 4, 8)]
    rows += [("8 streams through HTTP / bare engine at batch 8, total tokens/s",
              f"{results['http_8_streams_tokens_per_s']:.0f} / "
              f"{results['bare_engine_batch_8_tokens_per_s']:.0f} "
              f"({results['http_vs_engine_8_streams']:.2f}x; goal 0.9x)"),
             ("  against the bare engine's batch-8 decode-only tokens/s",
              f"{results['bare_engine_batch_8_decode_tokens_per_s']:.0f} "
              f"({results['http_8_streams_vs_engine_decode']:.2f}x)"),
             ("  tokens per content chunk at 8 streams (tokens ready together)",
              f"{results['http_8_streams_tokens_per_chunk']:.2f}"),
             ("serving CPU per token: event loop / engine thread over bare",
              f"{results['http_loop_cpu_us_per_token']:.0f} / "
              f"{results['engine_thread_serving_cpu_us_per_token']:.0f} us"),
             ("gap between chunks alone, median / max",
              f"{results['gap_alone_ms_median']:.1f} / {results['gap_alone_ms_max']:.1f} ms"),
             (f"  while {results['gap_prefill_tokens']} prompt tokens prefill "
              f"({results['gap_prefill_s']:.1f} s), median / max",
              f"{results['gap_during_prefill_ms_median']:.1f} / "
              f"{results['gap_during_prefill_ms_max']:.1f} ms "
              f"(max {results['gap_during_prefill_max_vs_usual']:.1f}x usual; goal 3x)")]
    rows.append(("client close to journaled RequestCancelled, median / max",
                 f"{results['close_to_cancelled_ms_median']:.1f} / "
                 f"{results['close_to_cancelled_ms_max']:.1f} ms"))
    rows.append(("disconnect noticed to RequestCancelled, median / max (steps)",
                 f"{results['cancel_latency_ms_median']:.1f} / "
                 f"{results['cancel_latency_ms_max']:.1f} ms ({results['cancel_steps_max']})"))
    width = max(len(r[0]) for r in rows)
    print(f"ninfer bench serve (spec {spec}, {threads} torch thread(s), {OUTPUT} output tokens)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(json.dumps(results, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    return 0


def add_bench_parser(bench_subparsers) -> argparse.ArgumentParser:
    """`ninfer bench serve` (its func is `run`)."""
    p = bench_subparsers.add_parser(
        "serve", help="HTTP server vs bare engine: TTFT, streaming overhead per token (chat "
                      "completions, and the Responses API against it), tokens/s at 1/4/8 "
                      "streams, 8 streams against the bare engine at batch 8, gaps between "
                      "tokens during a long prefill, disconnect-to-cancel latency")
    p.add_argument("--spec", choices=["none", "mtp", "ngram"], default="none")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    return main(spec=args.spec, threads=args.torch_threads, json_path=args.json)


if __name__ == "__main__":
    import sys
    parser = argparse.ArgumentParser(prog="ninfer bench")
    add_bench_parser(parser.add_subparsers(dest="target", required=True))
    parsed = parser.parse_args(["serve", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
