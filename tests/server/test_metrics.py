"""`/metrics`: the exposition as Prometheus reads it (prometheus-client's own parser), with
values that follow what the server did: counters after N requests, histograms' buckets,
sums and counts, the engine's gauges."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ninfer.server.metrics import LATENCY_BUCKETS, EngineFigures, Metrics

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


class Scrape:
    """One parsed exposition: each family's type, and every sample's value."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.values: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for s in family.samples:
                self.values[(s.name, frozenset(s.labels.items()))] = s.value

    def __call__(self, name: str, **labels: str) -> float:
        return self.values[(name, frozenset(labels.items()))]

    def total(self, name: str, **labels: str) -> float:
        """The sum over the samples of `name` whose labels include `labels`."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.values.items() if n == name and want <= ls)

    def buckets(self, name: str) -> dict[str, float]:
        return {dict(ls)["le"]: v for (n, ls), v in self.values.items()
                if n == f"{name}_bucket"}


FIGURES = EngineFigures(
    queue_depth=1, live_requests=2, kv_blocks_total=100, kv_blocks_used=7,
    kv_blocks_held_by_endpoints=4, kv_blocks_held_by_requests=3, state_slots_total=10,
    state_slots_used=5, state_slots_held_by_endpoints=2, engine_steps=42,
    endpoints={"private": 3, "anchor": 1, "shared": 0})


def test_exposition_of_the_figures():
    metrics = Metrics()
    for n in range(3):
        metrics.request_done("openai-chat", "stop", "Root", prompt=10 + n, completion=4,
                             cached=n, drafted=6, accepted=2 + n)
    metrics.request_done("openai-completion", "length", "SharedPrefix", prompt=5)
    for status in (200, 200, 499, 400):
        metrics.response(status)
    for seconds, steps in ((0.003, 0), (0.02, 1), (0.3, 2), (7.0, 9)):
        metrics.cancelled(seconds, steps)
    metrics.first_token(0.07)
    metrics.pending = 2
    scrape = Scrape(metrics.exposition(FIGURES).decode())

    assert scrape.types["ninfer_requests"] == "counter"
    assert scrape("ninfer_requests_total", route="openai-chat", outcome="stop", plan="Root") == 3
    assert scrape("ninfer_requests_total", route="openai-completion", outcome="length",
                  plan="SharedPrefix") == 1
    assert scrape("ninfer_http_responses_total", status="200") == 2
    assert scrape("ninfer_http_responses_total", status="499") == 1
    assert scrape("ninfer_prompt_tokens_total") == 10 + 11 + 12 + 5
    assert scrape("ninfer_completion_tokens_total") == 12
    assert scrape("ninfer_cached_tokens_total") == 0 + 1 + 2
    assert scrape("ninfer_drafted_tokens_total") == 18
    assert scrape("ninfer_accepted_tokens_total") == 2 + 3 + 4

    assert scrape.types["ninfer_disconnect_cancel_seconds"] == "histogram"
    latency = scrape.buckets("ninfer_disconnect_cancel_seconds")
    assert len(latency) == len(LATENCY_BUCKETS) + 1  # and +Inf
    assert (latency["0.0025"], latency["0.005"], latency["0.025"], latency["0.5"],
            latency["2.5"], latency["+Inf"]) == (0, 1, 2, 3, 3, 4)
    assert abs(scrape("ninfer_disconnect_cancel_seconds_sum") - 7.323) < 1e-9
    assert scrape("ninfer_disconnect_cancel_seconds_count") == 4
    steps = scrape.buckets("ninfer_disconnect_cancel_steps")
    assert [steps[k] for k in ("0.0", "1.0", "2.0", "4.0", "8.0", "+Inf")] == [1, 2, 3, 3, 3, 4]
    ttft = scrape.buckets("ninfer_time_to_first_token_seconds")
    assert (ttft["0.05"], ttft["0.1"], ttft["+Inf"]) == (0, 1, 1)
    assert scrape("ninfer_pending_requests") == 2

    for name, value in FIGURES._asdict().items():
        if name != "endpoints":
            assert scrape.types[f"ninfer_{name}"] == "gauge"
            assert scrape(f"ninfer_{name}") == value
    assert scrape("ninfer_endpoints", kind="private") == 3
    assert scrape("ninfer_endpoints", kind="anchor") == 1
    assert scrape("ninfer_endpoints", kind="shared") == 0


def test_without_the_engine_its_gauges_are_left_out():
    metrics = Metrics()
    metrics.request_done("openai-chat", "stop", "Root", prompt=3)
    scrape = Scrape(metrics.exposition(None).decode())
    assert scrape("ninfer_prompt_tokens_total") == 3
    assert "ninfer_kv_blocks_used" not in scrape.types
    assert scrape.types["ninfer_endpoints"] == "gauge"
    assert scrape.total("ninfer_endpoints") == 0


def scrape(live) -> Scrape:
    r = httpx.get(live.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text)


def settle(live) -> Scrape:
    """A scrape once the engine is idle and every earlier request is reported."""
    deadline = time.monotonic() + 20
    while True:
        idle = not live.server.thread.call(lambda e: len(e.live) + len(e.waiting)).result(5)
        now = scrape(live)
        if idle and now("ninfer_pending_requests") == 0:
            time.sleep(0.2)  # a response's report follows its last byte
            again = scrape(live)
            if again.values == now.values:
                return now
        assert time.monotonic() < deadline, "the server did not settle"
        time.sleep(0.05)


def test_counts_follow_requests(live):
    """After N requests the counters moved by exactly what those requests report (usage,
    finish reasons, the journal's drafted and accepted tokens), the time-to-first-token
    histogram counted each, and a refused request counted its status."""
    before = settle(live)
    replies = []
    for n in range(3):
        replies.append(("openai-chat", httpx.post(live.url + CHAT, timeout=60, json={
            "messages": [{"role": "user", "content": f"Count me, number {n}."}],
            "max_tokens": 6, "temperature": 0, "session_id": f"metrics-{n}"})))
    replies.append(("openai-completion", httpx.post(live.url + TEXT, timeout=60, json={
        "prompt": "Counting requests", "max_tokens": 5, "temperature": 0})))
    bad = httpx.post(live.url + CHAT, json={"messages": []})
    assert bad.status_code == 400 and all(r.status_code == 200 for _, r in replies)
    after = settle(live)

    def moved(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    bodies = [(route, r.json()) for route, r in replies]
    for route in ("openai-chat", "openai-completion"):
        for reason in ("stop", "length"):
            expected = sum(1 for rt, b in bodies
                           if rt == route and b["choices"][0]["finish_reason"] == reason)
            assert moved("ninfer_requests_total", route=route, outcome=reason) == expected
    usage = [b["usage"] for _, b in bodies]
    assert moved("ninfer_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert moved("ninfer_completion_tokens_total") == sum(u["completion_tokens"] for u in usage)
    assert moved("ninfer_cached_tokens_total") == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    commits = [d for _, r in replies for k, d, _ in live.events(r.headers["x-request-id"])
               if k == "TokensCommitted"]
    assert moved("ninfer_drafted_tokens_total") == sum(d["drafted"] for d in commits)
    assert moved("ninfer_accepted_tokens_total") == sum(d["accepted"] for d in commits)
    assert moved("ninfer_http_responses_total", status="200") == len(replies)
    assert moved("ninfer_http_responses_total", status="400") == 1
    assert moved("ninfer_time_to_first_token_seconds_count") == len(replies)
    assert moved("ninfer_time_to_first_token_seconds_sum") > 0
    assert moved("ninfer_engine_steps") >= sum(u["completion_tokens"] for u in usage) / 4
    assert after("ninfer_queue_depth") == after("ninfer_live_requests") == 0
    assert after("ninfer_kv_blocks_used") >= after("ninfer_kv_blocks_held_by_endpoints") > 0
    assert after("ninfer_endpoints", kind="private") >= 3  # one per session


def test_time_to_first_token_counts_until_the_token_reached_the_server(live):
    """A slow commit of the step that made the first token (its journal rows written before
    any client may see the token) is part of the time to first token the server reports,
    as it is of the client's: the figure is not the token's time inside the engine."""
    before = settle(live)
    engine = live.engine
    real = engine._commit
    slept = []

    def slow_commit():
        if not slept and any(e.kind == "TokensCommitted" for e in engine.log.pending):
            slept.append(True)
            time.sleep(0.3)
        return real()
    engine._commit = slow_commit
    try:
        sent = time.monotonic()
        r = httpx.post(live.url + CHAT, timeout=60, json={
            "messages": [{"role": "user", "content": "first token"}], "max_tokens": 1,
            "temperature": 0})
        took = time.monotonic() - sent
    finally:
        del engine._commit
    assert r.status_code == 200 and slept
    after = settle(live)
    ttft = after("ninfer_time_to_first_token_seconds_sum") - \
        before("ninfer_time_to_first_token_seconds_sum")
    assert after("ninfer_time_to_first_token_seconds_count") == \
        before("ninfer_time_to_first_token_seconds_count") + 1
    assert 0.3 <= ttft <= took
