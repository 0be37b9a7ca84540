"""Prometheus text exposition: counters the server keeps, gauges read from the engine.

The engine's gauges are read on the engine thread (`EngineThread.call`), between steps, so
what pools and endpoints hold is one consistent snapshot."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STEP_BUCKETS = (0, 1, 2, 4, 8)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts,
                                                                 strict=True)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total}",
                f"{name}_count {self.n}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str, str]] = Counter()   # route, outcome, plan
        self.responses: Counter[int] = Counter()                   # HTTP status
        self.tokens: Counter[str] = Counter()   # prompt, completion, cached, drafted, accepted
        self.cancel_latency = Histogram(LATENCY_BUCKETS)
        self.cancel_steps = Histogram(STEP_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.pending = 0

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
        with self._lock:
            self.cancel_latency.observe(seconds)
            self.cancel_steps.observe(steps)

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def render(self, engine: dict) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

        with self._lock:
            metric("ninfer_requests_total", "counter", "finished requests by outcome and plan",
                   [f'ninfer_requests_total{{route="{r}",outcome="{o}",plan="{p}"}} {n}'
                    for (r, o, p), n in sorted(self.requests.items())])
            metric("ninfer_http_responses_total", "counter", "responses by HTTP status",
                   [f'ninfer_http_responses_total{{status="{s}"}} {n}'
                    for s, n in sorted(self.responses.items())])
            for key, help_ in (("prompt", "prompt tokens"), ("completion", "generated tokens"),
                               ("cached", "prompt tokens reused from endpoints"),
                               ("drafted", "speculative tokens drafted"),
                               ("accepted", "speculative tokens accepted")):
                metric(f"ninfer_{key}_tokens_total", "counter", help_,
                       [f"ninfer_{key}_tokens_total {self.tokens[key]}"])
            metric("ninfer_disconnect_cancel_seconds", "histogram",
                   "from noticing a client disconnect to the request's RequestCancelled",
                   self.cancel_latency.lines("ninfer_disconnect_cancel_seconds"))
            metric("ninfer_disconnect_cancel_steps", "histogram",
                   "engine steps begun between a cancel and its RequestCancelled",
                   self.cancel_steps.lines("ninfer_disconnect_cancel_steps"))
            metric("ninfer_time_to_first_token_seconds", "histogram",
                   "from the request's arrival to its first token",
                   self.ttft.lines("ninfer_time_to_first_token_seconds"))
            metric("ninfer_pending_requests", "gauge", "requests admitted, not yet started",
                   [f"ninfer_pending_requests {self.pending}"])
        gauges = {
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
        for key, help_ in gauges.items():
            if key in engine:
                metric(f"ninfer_{key}", "gauge", help_, [f"ninfer_{key} {engine[key]}"])
        metric("ninfer_endpoints", "gauge", "endpoints held, by kind",
               [f'ninfer_endpoints{{kind="{k}"}} {n}'
                for k, n in sorted(engine.get("endpoints", {}).items())])
        return "\n".join(lines) + "\n"


def engine_snapshot(engine) -> dict:
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
    return {
        "queue_depth": len(engine.waiting),
        "live_requests": len(engine.live),
        "kv_blocks_total": engine.blocks.num_blocks,
        "kv_blocks_used": engine.blocks.used,
        "kv_blocks_held_by_endpoints": len(endpoint_blocks),
        "kv_blocks_held_by_requests": len(request_blocks),
        "state_slots_total": engine.slots.num_slots,
        "state_slots_used": engine.slots.used,
        "state_slots_held_by_endpoints": len(endpoint_slots),
        "engine_steps": engine.steps,
        "endpoints": {k: kinds.get(k, 0) for k in ("private", "anchor", "shared")},
    }
