"""One streamed chat completion timed as its client sees it: when it was sent, when each
streamed delta arrived (the first is the time to first token), the reply's text and the
server's usage (prompt, completion and cached tokens). Plain httpx and SSE, as a user's
client would read it."""

from __future__ import annotations

import re
import threading
import time
from typing import NamedTuple

from .serve import sse_chunks


class Timed(NamedTuple):
    sent: float                 # perf_counter when the request was sent
    arrivals: list[float]       # perf_counter at each streamed delta (role-only ones aside)
    #                             or at the finish when no delta came before it
    end: float                  # perf_counter when the stream ended
    text: str                   # the reply's content
    usage: dict                 # the server's: prompt_tokens, completion_tokens, cached

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first delta."""
        return self.arrivals[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive deltas."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    @property
    def completion_tokens(self) -> int:
        return self.usage["completion_tokens"]

    @property
    def prompt_tokens(self) -> int:
        return self.usage["prompt_tokens"]

    @property
    def cached_tokens(self) -> int:
        return (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time from the first delta to the last."""
        span = self.arrivals[-1] - self.arrivals[0]
        return (self.completion_tokens - 1) / span if span > 0 else 0.0


def stream_chat(url: str, messages: list[dict], *, session: str, max_tokens: int,
                ignore_eos: bool = False, stop: threading.Event | None = None,
                arrivals: list[float] | None = None) -> Timed:
    """Stream one greedy chat completion (thinking off) in conversation `session`. `stop`:
    close the stream once it is set (a client leaving; no usage then); `arrivals`: the list
    each delta's time is appended to as it comes (another thread may watch it)."""
    import httpx
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "reasoning_effort": "none", "ignore_eos": ignore_eos, "stream": True,
            "stream_options": {"include_usage": True}}
    arrivals = [] if arrivals is None else arrivals
    text: list[str] = []
    usage: dict = {}
    # the client is made before the clock starts: making one loads an SSL context (~20 ms
    # on a CPU), which a real client pays once, not per request
    with httpx.Client(timeout=1800) as client:
        sent = time.perf_counter()
        with client.stream("POST", url + "/v1/chat/completions", json=body,
                           headers={"X-Session-Id": session}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{response.status_code}: {response.read().decode()[:500]}")
            for chunk in sse_chunks(response.iter_lines()):
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    # the role chunk (`content: ""`, sent when the request starts) is no token
                    delta = {k: v for k, v in choice["delta"].items() if k != "role" and v}
                    # the finish counts when nothing came before it: a reply whose tokens decode
                    # to no text had its first token by then
                    if delta or (choice.get("finish_reason") and not arrivals):
                        arrivals.append(time.perf_counter())
                        text.append(delta.get("content") or "")
                if stop is not None and stop.is_set():
                    break
    return Timed(sent, arrivals, time.perf_counter(), "".join(text), usage)


def metric(url: str, name: str) -> float:
    """One unlabelled figure of the server's /metrics (0 when absent)."""
    import httpx
    body = httpx.get(url + "/metrics", timeout=60).text
    found = re.search(rf"^{name} ([0-9.e+-]+)$", body, re.M)
    return float(found.group(1)) if found else 0.0
