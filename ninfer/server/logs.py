"""One line a person can read per finished request, and one per client disconnect:

  req#12 done | openai-chat | stop | prompt 23,558 | output 64 | cache 23,401 (99.3%, private
  endpoint) | TTFT 31 ms | total 1.2 s | prefill 3.1k tok/s | decode 164 tok/s | mtp accepted 41/60
  req#13 client disconnected | HTTP 499 | openai-chat | during prefill | cancelled in 2.1 ms
  (1 step)
"""

from __future__ import annotations

import logging

log = logging.getLogger("ninfer.server")

PLAN_WORDS = {"Root": "none", "PrivateEndpoint": "private endpoint",
              "PrivateAnchor": "private anchor", "SharedPrefix": "shared prefix"}


def duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def rate(tokens: int, seconds: float) -> str:
    if seconds <= 0 or tokens <= 0:
        return "-"
    r = tokens / seconds
    return f"{r / 1000:.1f}k tok/s" if r >= 1000 else f"{r:.0f} tok/s"


def request_line(rid: str, route: str, outcome: str, *, prompt: int, output: int, cached: int,
                 plan: str | None, ttft: float | None, total: float, prefill_s: float,
                 decode_s: float, spec: str, drafted: int, accepted: int) -> str:
    pct = 100.0 * cached / prompt if prompt else 0.0
    where = f", {PLAN_WORDS.get(plan or 'Root', plan)}" if cached else ""
    parts = [f"{rid} done", route, outcome, f"prompt {prompt:,}", f"output {output:,}",
             f"cache {cached:,} ({pct:.1f}%{where})"]
    if ttft is not None:
        parts.append(f"TTFT {duration(ttft)}")
    parts += [f"total {duration(total)}", f"prefill {rate(prompt - cached, prefill_s)}",
              f"decode {rate(output - 1, decode_s)}"]
    if spec != "none" and drafted:
        parts.append(f"{spec} accepted {accepted}/{drafted}")
    return " | ".join(parts)


def disconnect_line(rid: str, route: str, phase: str, latency: float | None,
                    steps: int | None) -> str:
    parts = [f"{rid} client disconnected", "HTTP 499", route, f"during {phase}"]
    if latency is not None:
        parts.append(f"cancelled in {latency * 1000:.1f} ms ({steps} step"
                     f"{'' if steps == 1 else 's'})")
    else:
        parts.append("nothing left to cancel")
    return " | ".join(parts)
