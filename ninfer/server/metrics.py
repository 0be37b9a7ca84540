"""`/metrics` through prometheus-client: the server's own figures (counters it keeps,
histograms it observes) and one snapshot of the engine's gauges, each a custom collector,
exposed in the Prometheus text format by the library.

The engine's gauges are read on the engine thread (`EngineThread.call`), between steps, so
what pools and endpoints hold is one consistent snapshot."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STEP_BUCKETS = (0, 1, 2, 4, 8)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# the exposition's version 0.0.4, which is what generate_latest writes
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TOKEN_COUNTERS = {"prompt": "prompt tokens", "completion": "generated tokens",
                  "cached": "prompt tokens reused from endpoints",
                  "drafted": "speculative tokens drafted",
                  "accepted": "speculative tokens accepted"}


class Metrics:
    """What the HTTP side counts and times. A prometheus-client collector: `collect` reads
    the live figures under the lock, so one scrape sees one consistent set."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str, str]] = Counter()   # route, outcome, plan
        self.responses: Counter[int] = Counter()                   # HTTP status
        self.tokens: Counter[str] = Counter()                      # keys of TOKEN_COUNTERS
        # registry=None: each server has its own, never the process-wide default registry
        self.cancel_latency = Histogram(
            "ninfer_disconnect_cancel_seconds",
            "from noticing a client disconnect to the request's RequestCancelled",
            buckets=LATENCY_BUCKETS, registry=None)
        self.cancel_steps = Histogram(
            "ninfer_disconnect_cancel_steps",
            "engine steps begun between a cancel and its RequestCancelled",
            buckets=STEP_BUCKETS, registry=None)
        self.ttft = Histogram(
            "ninfer_time_to_first_token_seconds",
            "from the request's arrival to its first token reaching the HTTP side (its "
            "step's journal commit included)",
            buckets=TTFT_BUCKETS, registry=None)
        self.pending = 0   # requests admitted, not yet started (event loop thread only)

    def request_done(self, route: str, outcome: str, plan: str, *, prompt: int = 0,
                     completion: int = 0, cached: int = 0, drafted: int = 0,
                     accepted: int = 0) -> None:
        with self._lock:
            self.requests[(route, outcome, plan)] += 1
            self.tokens.update(prompt=prompt, completion=completion, cached=cached,
                               drafted=drafted, accepted=accepted)

    def response(self, status: int) -> None:
        with self._lock:
            self.responses[status] += 1

    def cancelled(self, seconds: float, steps: int) -> None:  # engine thread
        self.cancel_latency.observe(seconds)
        self.cancel_steps.observe(steps)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            requests = CounterMetricFamily("ninfer_requests", "finished requests by outcome "
                                           "and plan", labels=("route", "outcome", "plan"))
            for labels, n in sorted(self.requests.items()):
                requests.add_metric(labels, n)
            responses = CounterMetricFamily("ninfer_http_responses",
                                            "responses by HTTP status", labels=("status",))
            for status, n in sorted(self.responses.items()):
                responses.add_metric((str(status),), n)
            tokens = [CounterMetricFamily(f"ninfer_{key}_tokens", help_, self.tokens[key])
                      for key, help_ in TOKEN_COUNTERS.items()]
            pending = self.pending
        yield requests
        yield responses
        yield from tokens
        for histogram in (self.cancel_latency, self.cancel_steps, self.ttft):
            yield from histogram.collect()
        yield GaugeMetricFamily("ninfer_pending_requests", "requests admitted, not yet started",
                                pending)

    def exposition(self, engine: EngineFigures | None) -> bytes:
        """The text exposition of these figures and of `engine`'s gauges (None when the
        engine could not be read: its gauges are left out)."""
        registry = CollectorRegistry()
        registry.register(self)
        registry.register(EngineGauges(engine))
        return generate_latest(registry)


class EngineFigures(NamedTuple):
    """Pool and store gauges at one moment between engine steps."""

    queue_depth: int
    live_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_held_by_endpoints: int
    kv_blocks_held_by_requests: int
    state_slots_total: int
    state_slots_used: int
    state_slots_held_by_endpoints: int
    engine_steps: int
    endpoints: dict[str, int]   # by kind: private, anchor, shared


ENGINE_GAUGES = {
    "queue_depth": "requests waiting in the engine",
    "live_requests": "requests holding a lane",
    "kv_blocks_total": "KV blocks in the pool",
    "kv_blocks_used": "KV blocks in use",
    "kv_blocks_held_by_endpoints": "KV blocks some endpoint holds",
    "kv_blocks_held_by_requests": "KV blocks some live request holds",
    "state_slots_total": "recurrent-state slots in the pool",
    "state_slots_used": "recurrent-state slots in use",
    "state_slots_held_by_endpoints": "slots endpoints hold",
    "engine_steps": "engine steps run",
}


class EngineGauges:
    """A prometheus-client collector over one `EngineFigures` snapshot."""

    def __init__(self, figures: EngineFigures | None) -> None:
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        figures = self.figures
        if figures is not None:
            values = figures._asdict()
            for key, help_ in ENGINE_GAUGES.items():
                yield GaugeMetricFamily(f"ninfer_{key}", help_, values[key])
        endpoints = GaugeMetricFamily("ninfer_endpoints", "endpoints held, by kind",
                                      labels=("kind",))
        for kind, n in sorted(figures.endpoints.items() if figures else ()):
            endpoints.add_metric((kind,), n)
        yield endpoints


def engine_snapshot(engine) -> EngineFigures:
    """Pool and store gauges; runs on the engine thread."""
    endpoint_blocks: set[int] = set()
    endpoint_slots: set[int] = set()
    for held in engine.held.values():
        endpoint_blocks.update(held.attn_blocks + held.mtp_blocks)
        endpoint_slots.add(held.slot)
    request_blocks: set[int] = set()
    for live in engine.live.values():
        request_blocks.update(live.lane.attn_blocks + live.lane.mtp_blocks)
        for held in live.captures:
            request_blocks.update(held.attn_blocks + held.mtp_blocks)
    kinds = Counter(s.facts.kind for s in engine.store.endpoints.values())
    return EngineFigures(
        queue_depth=len(engine.waiting),
        live_requests=len(engine.live),
        kv_blocks_total=engine.blocks.num_blocks,
        kv_blocks_used=engine.blocks.used,
        kv_blocks_held_by_endpoints=len(endpoint_blocks),
        kv_blocks_held_by_requests=len(request_blocks),
        state_slots_total=engine.slots.num_slots,
        state_slots_used=engine.slots.used,
        state_slots_held_by_endpoints=len(endpoint_slots),
        engine_steps=engine.steps,
        endpoints={k: kinds.get(k, 0) for k in ("private", "anchor", "shared")})
