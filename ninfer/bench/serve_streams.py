"""`ninfer bench serve`'s figures for streams under load, each against a baseline of the same
run:

- 8 streams through HTTP (from a client process of their own) against the bare engine at
  batch 8 (the same prompts and output lengths, runs alternated): total tokens/s each way,
  and their ratio (the goal is ≥ 0.9); the bare engine's decode-only tokens/s beside it;
- the CPU time per token the serving path spends on the event loop's thread (handing tokens
  over, detokenising, parsing, JSON, SSE framing, the socket) and what the engine thread
  spends per token over the bare engine's (routing events to requests), from the threads'
  own CPU clocks, so other processes on the machine do not count;
- a streaming client's gap between received chunks alone, and while another request
  prefills a long prompt (the goal: within 3× the usual gap)."""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

STREAMS = 8


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds `thread` has run (Linux: its own CPU clock)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def bare_batch(spec: str, prompts: list[tuple[int, ...]], output: int, chunk: int) -> dict:
    """The prompts run together on a bare engine (no HTTP): tokens/s from submit to idle,
    decode-only tokens/s (the steps in which every request decoded), and the engine
    thread's CPU time per token."""
    from ..engine.engine import Engine, EngineConfig, Submit
    from ..lifecycle.request import SamplingParams
    from ..model.runtime import open_model
    om = open_model(kv_capacity=16_384, num_slots=32, mtp=spec == "mtp")
    engine = Engine(om.model, EngineConfig(spec=spec, prefill_chunk=chunk, max_context=8192,
                                           max_concurrency=len(prompts)),
                    blocks=om.blocks, slots=om.slots)
    engine.recover()
    best: dict = {}
    for run in range(2):
        for i, ids in enumerate(prompts):
            engine.submit(Submit(f"batch{run}-{i}", ids, None, "bench",
                                 SamplingParams(max_tokens=output)))
        tokens = decode_tokens = 0
        decode_s = 0.0
        start, cpu = time.perf_counter(), time.thread_time()
        while not engine.idle():
            t = time.perf_counter()
            events = engine.step()
            committed = [e for e in events if e.kind == "TokensCommitted"]
            tokens += sum(len(e.tokens) for e in committed)
            if len(committed) == len(prompts) and not any(
                    e.kind == "PrefillAdvanced" for e in events):
                decode_s += time.perf_counter() - t
                decode_tokens += sum(len(e.tokens) for e in committed)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        figures = {"tokens_per_s": tokens / wall, "cpu_us_per_token": 1e6 * cpu / tokens,
                   "decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0}
        if not best or figures["tokens_per_s"] > best["tokens_per_s"]:
            best = figures
    return best


def _clients(url: str, bodies: list[dict]) -> tuple[float, int, int]:
    """In the client process: the bodies streamed together; (seconds, tokens, content
    chunks). They share one `httpx.Client`, made before the clock starts, as a real client
    would: a client of its own per request builds an SSL context each (about 18 ms of CPU,
    even for plain HTTP), which put some 140 ms of the client's own start-up in a run of
    about 1.3 s."""
    import httpx

    from .serve import _stream
    out: list[dict] = []
    lock = threading.Lock()

    def client(body: dict) -> None:
        r = _stream(url, body, client=session)
        with lock:
            out.append(r)
    with httpx.Client(limits=httpx.Limits(max_connections=len(bodies))) as session:
        workers = [threading.Thread(target=client, args=(b,)) for b in bodies]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - start
    return (wall, sum(r["usage"]["completion_tokens"] for r in out),
            sum(r["content_chunks"] for r in out))


def http_batch(clients: ProcessPoolExecutor, url: str, bodies: list[dict],
               loop: threading.Thread, engine: threading.Thread) -> dict:
    """The bodies streamed together through HTTP by a client process of their own (so the
    clients' parsing does not hold the server's interpreter lock): total tokens/s, and the
    CPU time per token of the event loop's thread and of the engine thread."""
    loop_cpu, engine_cpu = thread_cpu_s(loop), thread_cpu_s(engine)
    wall, tokens, chunks = clients.submit(_clients, url, bodies).result()
    return {"tokens_per_s": tokens / wall, "tokens_per_chunk": tokens / chunks,
            "loop_cpu_us_per_token": 1e6 * (thread_cpu_s(loop) - loop_cpu) / tokens,
            "engine_cpu_us_per_token": 1e6 * (thread_cpu_s(engine) - engine_cpu) / tokens}


def through_http_vs_engine(url: str, body: dict, prompt_ids: Callable[[list[dict]], tuple],
                           prompt: Callable[[int, str], list[dict]], spec: str,
                           output: int, chunk: int, loop: threading.Thread,
                           engine: threading.Thread) -> dict:
    """8 streams through HTTP and the bare engine at batch 8, alternated (best of 3 each)."""
    results: dict = {}
    http: list[dict] = []
    bare: list[dict] = []
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        clients.submit(time.time).result()  # started before anything is timed
        for run in range(3):
            messages = [prompt(6, f"s{STREAMS}-{run}-{i}") for i in range(STREAMS)]
            bare.append(bare_batch(spec, [prompt_ids(m) for m in messages], output, chunk))
            http.append(http_batch(clients, url, [{**body, "messages": m} for m in messages],
                                   loop, engine))
    h = max(http, key=lambda r: r["tokens_per_s"])
    b = max(bare, key=lambda r: r["tokens_per_s"])
    results["http_8_streams_tokens_per_s"] = h["tokens_per_s"]
    results["bare_engine_batch_8_tokens_per_s"] = b["tokens_per_s"]
    results["bare_engine_batch_8_decode_tokens_per_s"] = max(r["decode_tokens_per_s"]
                                                             for r in bare)
    results["http_vs_engine_8_streams"] = h["tokens_per_s"] / b["tokens_per_s"]
    results["http_8_streams_vs_engine_decode"] = (
        h["tokens_per_s"] / results["bare_engine_batch_8_decode_tokens_per_s"])
    results["http_8_streams_tokens_per_chunk"] = h["tokens_per_chunk"]
    results["http_loop_cpu_us_per_token"] = min(r["loop_cpu_us_per_token"] for r in http)
    results["engine_thread_serving_cpu_us_per_token"] = (
        min(r["engine_cpu_us_per_token"] for r in http)
        - min(r["cpu_us_per_token"] for r in bare))
    return results


def _chunk_times(url: str, body: dict, until: threading.Event, arrivals: list[float],
                 started: threading.Event) -> None:
    """Stream a long reply, recording when each content chunk arrives, until `until`."""
    import httpx

    from .serve import sse_chunks
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=600) as r:
        for chunk in sse_chunks(r.iter_lines()):
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
                if len(arrivals) >= 8:
                    started.set()
            if until.is_set():
                break
    started.set()


def _gaps(arrivals: list[float], during: tuple[float, float] | None = None) -> list[float]:
    """Gaps between arrivals: those overlapping `during`, or (None) all but the first two
    (the stream's start)."""
    pairs = list(zip(arrivals, arrivals[1:], strict=False))
    if during is None:
        return [b - a for a, b in pairs[2:]]
    return [b - a for a, b in pairs if a < during[1] and b > during[0]]


def gap_during_prefill(url: str, body: dict, long_prompt: list[dict], *,
                       alone_tokens: int = 60) -> dict:
    """A streaming client's gaps between chunks: alone, then while a request of
    `long_prompt` prefills (from its submission to its answer)."""
    import httpx
    alone: list[float] = []
    done, started = threading.Event(), threading.Event()
    _chunk_times(url, {**body, "max_tokens": alone_tokens}, done, alone, started)
    arrivals: list[float] = []
    done, started = threading.Event(), threading.Event()
    reader = threading.Thread(target=_chunk_times, args=(
        url, {**body, "max_tokens": 4000}, done, arrivals, started))
    reader.start()
    started.wait(60)
    t0 = time.perf_counter()
    reply = httpx.post(url + "/v1/chat/completions", json={
        **body, "messages": long_prompt, "max_tokens": 1}, timeout=600).json()
    t1 = time.perf_counter()
    done.set()
    reader.join()
    usual, during = _gaps(alone), _gaps(arrivals, (t0, t1))
    median = statistics.median(usual)
    return {"gap_alone_ms_median": 1000 * median, "gap_alone_ms_max": 1000 * max(usual),
            "gap_during_prefill_ms_median": 1000 * statistics.median(during),
            "gap_during_prefill_ms_max": 1000 * max(during),
            "gap_during_prefill_max_vs_usual": max(during) / median,
            "gap_prefill_tokens": reply["usage"]["prompt_tokens"],
            "gap_prefill_s": t1 - t0}
