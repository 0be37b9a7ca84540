"""Clients that go away: raw HTTP cut by the client in each phase (queued, prefilling,
decoding under MTP speculative rounds, after the last token; streaming and not). The engine
cancels within one step (a cut prefill: detaches it, the server's default, and it goes on
for the retry), the request is journaled as cancelled, and the conversation's next request
succeeds and reuses what was committed. The seed's reproduction end to end."""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time

import httpx

from .test_metrics import scrape

CHAT = "/v1/chat/completions"


def report(n: int) -> str:
    return " ".join(f"Line {i:05d}: the daily report shows stable temperature, normal pressure "
                    f"and no alarm in sector {i % 17}." for i in range(1, n + 1))


class RawClient:
    """One HTTP/1.1 request on a socket the test closes when it likes."""

    def __init__(self, url: str, body: dict, headers: dict | None = None) -> None:
        host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
        self.sock = socket.create_connection((host, int(port)))
        data = json.dumps(body).encode()
        head = [f"POST {CHAT} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
                f"Content-Length: {len(data)}", "Connection: close",
                *[f"{k}: {v}" for k, v in (headers or {}).items()]]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        self.buf = b""
        self.closed_at: float | None = None

    def read_until(self, marker: bytes, timeout: float = 20.0, count: int = 1) -> bytes:
        self.sock.settimeout(timeout)
        while self.buf.count(marker) < count:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.buf += chunk
        return self.buf

    @property
    def status(self) -> int | None:
        m = re.match(rb"HTTP/1.1 (\d+)", self.buf)
        return int(m.group(1)) if m else None

    @property
    def request_id(self) -> str | None:
        m = re.search(rb"x-request-id: (\S+)", self.buf, re.I)
        return m.group(1).decode() if m else None

    def cut(self) -> None:
        self.closed_at = time.time()
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def cancelled(live, request_id: str, at_state: str, closed_at: float) -> float:
    """Seconds from the cut to the event that told the client: RequestCancelled at
    `at_state`, or, for a cut prefill, PrefillDetached (its RequestCancelled comes when the
    detached prefill ends)."""
    kind, data, when = live.wait_told(request_id)
    if at_state == "Prefilling":
        assert kind == "PrefillDetached", (kind, data)
        kind, data, _ = live.wait_terminal(request_id, 30)
        assert kind == "RequestCancelled" and data["at_state"] == "Detached", (kind, data)
        return when - closed_at
    assert kind == "RequestCancelled", (kind, data)
    assert data["at_state"] == at_state
    return when - closed_at


def next_turn(live, body: dict, headers: dict) -> dict:
    body = {**body, "stream": False, "max_tokens": 2}
    r = httpx.post(live.url + CHAT, json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()
    started = live.started(r.headers["x-request-id"])
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == started["reuse_base"]
    return {"cached": started["reuse_base"], "plan": started["plan"]}


def cancels_recorded(live) -> int:
    return len(live.server.thread.cancel_latencies)


def steps_of_cancel(live, index: int) -> int:
    """Engine steps of the cancel recorded `index`-th; the engine thread records it just
    after the journal's RequestCancelled, which the test may read first, so wait for it."""
    deadline = time.monotonic() + 5
    while cancels_recorded(live) <= index:
        assert time.monotonic() < deadline, "the cancel was not recorded"
        time.sleep(0.005)
    return live.server.thread.cancel_latencies[index][1]


def request_ids(live, session: str) -> list[str]:
    import sqlite3
    with sqlite3.connect(f"file:{live.journal_path}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT request FROM events WHERE kind = 'RequestQueued' AND "
                          "conversation = ? ORDER BY seq", ("id-" + session,)).fetchall()
    return [r[0] for r in rows]


def test_seed_reproduction_cut_mid_prefill_then_same_messages(live):
    """A streaming request cut while it prefills, then the same messages: HTTP 200, and
    cached_tokens equal to the plan's reuse base in the journal (the seed answered 500)."""
    headers = {"X-Session-Id": "seed"}
    body = {"model": "tiny-qwen3-next-v1", "stream": True, "max_tokens": 64, "messages": [
        {"role": "user", "content": report(12) + " Summarize in one sentence."}]}
    with live.configured(step_delay=0.03):
        client = RawClient(live.url, body, headers)
        client.read_until(b"\r\n\r\n")  # headers come once the request has started
        assert client.status == 200
        rid = client.request_id
        deadline = time.monotonic() + 10
        while sum(k == "PrefillAdvanced" for k, _, _ in live.events(rid)) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        recorded = cancels_recorded(live)
        client.cut()
        latency = cancelled(live, rid, "Prefilling", client.closed_at)
        detached = [d for k, d, _ in live.events(rid) if k == "PrefillDetached"][0]
    assert steps_of_cancel(live, recorded) <= 1
    assert latency < 0.5
    after = next_turn(live, body, headers)
    # the detached prefill went on to the end of the prompt and published it there
    assert after["plan"] == "PrivateEndpoint" and after["cached"] == detached["goal"]


def test_a_resend_adopts_the_cut_prefill_in_place(live):
    """An agent's cancel and resend: the cut prefill goes on detached, the resend takes it
    over where it stands; no prompt token is computed twice; the answer is a Root run's."""
    headers = {"X-Session-Id": "resend"}
    body = {"model": "tiny-qwen3-next-v1", "stream": True, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": report(14) + " What changed?"}]}
    with live.configured(step_delay=0.05):
        client = RawClient(live.url, body, headers)
        client.read_until(b"\r\n\r\n")
        cut = client.request_id
        deadline = time.monotonic() + 10
        while sum(k == "PrefillAdvanced" for k, _, _ in live.events(cut)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        client.cut()
        live.wait_told(cut)
        r = httpx.post(live.url + CHAT, json={**body, "stream": False}, headers=headers,
                       timeout=60)
    assert r.status_code == 200, r.text
    retry = r.headers["x-request-id"]
    started = live.started(retry)
    adopted = [d for k, d, _ in live.events(cut) if k == "PrefillAdopted"]
    assert started["plan"] == "Adopted" and started["adopted"] == cut
    assert adopted == [{"by": retry, "cursor": started["reuse_base"]}]
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == started["reuse_base"] > 0
    computed = sum(_prefilled(live, rid) for rid in (cut, retry))
    assert computed == usage["prompt_tokens"]
    again = httpx.post(live.url + CHAT, json={**body, "stream": False},
                       headers={"X-Session-Id": "resend-plain"}, timeout=60)
    assert again.json()["choices"][0]["message"] == r.json()["choices"][0]["message"]


def _prefilled(live, rid: str) -> int:
    """Prompt positions a request computed itself, from its journal events."""
    events = live.events(rid)
    base = [d["reuse_base"] for k, d, _ in events if k == "RequestStarted"][0]
    cursors = [d["cursor"] for k, d, _ in events if k == "PrefillAdvanced"]
    return (cursors[-1] if cursors else base) - base


def test_cut_while_decoding_under_speculation_and_after_last_token(live):
    headers = {"X-Session-Id": "decode-cut"}
    body = {"stream": True, "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": report(2)}]}
    with live.configured(step_delay=0.02):
        client = RawClient(live.url, body, headers)
        client.read_until(b"data: ", count=4)
        rid = client.request_id
        recorded = cancels_recorded(live)
        client.cut()
        latency = cancelled(live, rid, "Active", client.closed_at)
    assert steps_of_cancel(live, recorded) <= 1 and latency < 0.5
    after = next_turn(live, body, headers)
    assert after["cached"] > 0

    short = {**body, "max_tokens": 3}
    client = RawClient(live.url, short, headers)
    client.read_until(b'"finish_reason": "length"')
    client.cut()
    kind, _, _ = live.wait_terminal(client.request_id)
    assert kind in ("RequestFinished", "RequestCancelled")
    next_turn(live, body, headers)


def test_cut_while_queued_and_non_streaming_cut(live):
    headers = {"X-Session-Id": "queued"}
    long = {"stream": True, "max_tokens": 300, "messages": [{"role": "user", "content": "go"}]}
    with live.configured(step_delay=0.02):
        holders = [RawClient(live.url, long, {"X-Session-Id": f"holder{i}"}) for i in range(2)]
        for h in holders:
            h.read_until(b"data: ")
        waiting = RawClient(live.url, {**long, "max_tokens": 2}, headers)
        time.sleep(0.1)
        waiting.cut()
        for h in holders:
            h.cut()
        for h in holders:
            cancelled(live, h.request_id, "Active", h.closed_at)
        rid = request_ids(live, "queued")[-1]
        cancelled(live, rid, "Queued", waiting.closed_at)

        body = {"max_tokens": 4, "messages": [{"role": "user", "content": report(10)}]}
        plain = RawClient(live.url, body, {"X-Session-Id": "plain-cut"})
        time.sleep(0.15)
        plain.cut()
        rid = request_ids(live, "plain-cut")[-1]
        kind, data, _ = live.wait_terminal(rid)
        assert kind == "RequestCancelled" and data["at_state"] in ("Queued", "Detached")
    next_turn(live, body, {"X-Session-Id": "plain-cut"})


def test_many_clients_disconnecting_at_random(live):
    """No 5xx; afterwards the blocks in use are exactly what endpoints hold, and the pools are
    full once the store is cleared."""
    statuses: list[int | None] = []
    lock = threading.Lock()

    def one(n: int) -> None:
        rng = random.Random(n)
        for _ in range(3):
            body = {"stream": rng.random() < 0.6, "max_tokens": rng.randrange(2, 24),
                    "messages": [{"role": "user", "content": report(rng.randrange(1, 6))}]}
            client = RawClient(live.url, body, {"X-Session-Id": f"crowd{n % 4}"})
            if rng.random() < 0.6:
                time.sleep(rng.random() * 0.4)
                client.cut()
            else:
                client.read_until(b"\x00never", 30)
            with lock:
                statuses.append(client.status)

    with live.configured(step_delay=0.005):
        threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert all(s is None or s < 500 for s in statuses), statuses
    deadline = time.monotonic() + 20
    while live.server.thread.call(lambda e: len(e.live) + len(e.waiting)).result(5):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    live.integrity()
    gauges = scrape(live)
    assert gauges("ninfer_kv_blocks_used") == gauges("ninfer_kv_blocks_held_by_endpoints")
    assert gauges("ninfer_state_slots_used") == gauges("ninfer_state_slots_held_by_endpoints")
    assert httpx.post(live.url + "/admin/evict").status_code == 200
    gauges = scrape(live)
    assert gauges("ninfer_kv_blocks_used") == 0 and gauges("ninfer_state_slots_used") == 0
    assert gauges("ninfer_http_responses_total", status="499") >= 1
    assert not [labels for (name, labels) in gauges.values
                if name == "ninfer_http_responses_total" and dict(labels)["status"][0] == "5"]


def test_log_lines(live, caplog):
    caplog.set_level("INFO", logger="ninfer.server")
    body = {"stream": True, "max_tokens": 100, "messages": [{"role": "user", "content": "log"}]}
    with live.configured(step_delay=0.01):
        client = RawClient(live.url, body, {"X-Session-Id": "logs"})
        client.read_until(b"data: ", count=3)
        client.cut()
        live.wait_terminal(client.request_id)
    r = httpx.post(live.url + CHAT, json={**body, "stream": False, "max_tokens": 2},
                   headers={"X-Session-Id": "logs"})
    rid = r.headers["x-request-id"]
    deadline = time.monotonic() + 5
    while not any(f"req#{rid} done" in m for m in caplog.messages):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    cut = [m for m in caplog.messages if m.startswith(f"req#{client.request_id} ")]
    assert any("| cancelled |" in m for m in cut)
    assert any("client disconnected | HTTP 499" in m and "during decode" in m and "1 step" in m
               for m in cut)
    done = next(m for m in caplog.messages if m.startswith(f"req#{rid} done"))
    assert "| openai-chat | length | prompt 13 | output 2 | cache 8 (61.5%, private anchor)" in done


def test_a_slow_reader_does_not_hold_the_engine(live):
    """A streaming client that stops reading after the headers: its request still runs to
    its end at engine speed (the engine never waits on a reader), and another client's
    request is answered meanwhile."""
    body = {"model": "tiny-qwen3-next-v1", "stream": True, "max_tokens": 48,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    slow = RawClient(live.url, body, {"X-Session-Id": "slow-reader"})
    slow.read_until(b"\r\n\r\n")
    rid = slow.request_id
    other = httpx.post(f"{live.url}{CHAT}", timeout=30, json={
        "model": "tiny-qwen3-next-v1", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert other.status_code == 200
    kind, data, _ = live.wait_terminal(rid, timeout=30)  # no byte of the body read yet
    assert kind == "RequestFinished" and data["completion_tokens"] >= 1
    slow.cut()
