"""What `ninfer bench serve --outside` measures on a running server, each probe a function of
its URL that returns flat figures (times in ms, rates in tokens/s) beside their baselines
from the same run. Every request is greedy with thinking off, in a conversation of its own
(`X-Session-Id`) with text no other request shares, so a "cold" prompt reuses nothing; the
prompt counts recorded are the server's (`usage`)."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Sequence

from .sized_prompts import PromptMaker
from .timed_stream import Timed, stream_chat

FIRST_TOKENS = 4        # max_tokens of a request timed for its first token
PROMPT_TOKENS = 64      # each decode stream's prompt


class Probes:
    """The probes of one server at `url`, their prompts from `prompts`; `keys` numbers the
    prompts and sessions (shared by the servers of a run, so no two requests share text)."""

    def __init__(self, url: str, prompts: PromptMaker, keys: itertools.count) -> None:
        self.url, self.prompts, self.keys = url, prompts, keys

    def _cold(self, n: int, max_tokens: int = FIRST_TOKENS) -> tuple[list[dict], Timed]:
        key = next(self.keys)
        messages = self.prompts.messages(n, key)
        return messages, stream_chat(self.url, messages, session=f"bench-{key}",
                                     max_tokens=max_tokens)

    def first_requests(self, sizes: Sequence[int]) -> dict:
        """The first requests after ready, one per size in order, then each size again with
        other text: time to first token of each and first / repeat."""
        first = {n: self._cold(n)[1] for n in sizes}
        repeat = {n: self._cold(n)[1] for n in sizes}
        out: dict = {}
        for n in sizes:
            out[f"first_ttft_ms_{n}"] = 1000 * first[n].ttft
            out[f"repeat_ttft_ms_{n}"] = 1000 * repeat[n].ttft
            out[f"first_over_repeat_{n}"] = first[n].ttft / repeat[n].ttft
            out[f"first_prompt_tokens_{n}"] = first[n].prompt_tokens
            out[f"repeat_prompt_tokens_{n}"] = repeat[n].prompt_tokens
        return out

    def cold_prefill(self, sizes: Sequence[int]) -> dict:
        """Time to first token of a long prompt that reuses nothing, and the prefill rate
        it implies (prompt tokens over it)."""
        out: dict = {}
        for n in sizes:
            run = self._cold(n)[1]
            out[f"cold_ttft_ms_{n}"] = 1000 * run.ttft
            out[f"cold_prefill_tok_s_{n}"] = run.prompt_tokens / run.ttft
            out[f"cold_prompt_tokens_{n}"] = run.prompt_tokens
            out[f"cold_cached_tokens_{n}"] = run.cached_tokens
        return out

    def next_turn(self, sizes: Sequence[int], new_tokens: int, reply_tokens: int) -> dict:
        """A conversation of n tokens (turn 1, its reply `reply_tokens` long), then the reply
        sent back with a new user message `new_tokens` long (turn 2), then turn 2 sent again
        with another message (a retry: the last message edited, or regenerated): the time to
        first token of each, the prompts and the part of them the server reused (cached)."""
        out: dict = {}
        for n in sizes:
            key = next(self.keys)
            history = self.prompts.messages(n, key)
            turn1 = stream_chat(self.url, history, session=f"bench-{key}",
                                max_tokens=reply_tokens)
            history = [*history, {"role": "assistant", "content": turn1.text}]
            turn2 = stream_chat(self.url, self.prompts.follow_up(history, new_tokens, key),
                                session=f"bench-{key}", max_tokens=FIRST_TOKENS)
            out[f"turn1_ttft_ms_{n}"] = 1000 * turn1.ttft
            out[f"turn2_ttft_ms_{n}"] = 1000 * turn2.ttft
            out[f"turn2_over_turn1_{n}"] = turn2.ttft / turn1.ttft
            out[f"turn1_prompt_tokens_{n}"] = turn1.prompt_tokens
            out[f"turn2_prompt_tokens_{n}"] = turn2.prompt_tokens
            out[f"turn2_cached_tokens_{n}"] = turn2.cached_tokens
            out[f"turn2_new_tokens_{n}"] = turn2.prompt_tokens - turn2.cached_tokens
            retry = stream_chat(self.url, self.prompts.follow_up(history, new_tokens,
                                                                 next(self.keys)),
                                session=f"bench-{key}", max_tokens=FIRST_TOKENS)
            out[f"retry_ttft_ms_{n}"] = 1000 * retry.ttft
            out[f"retry_cached_tokens_{n}"] = retry.cached_tokens
            out[f"retry_new_tokens_{n}"] = retry.prompt_tokens - retry.cached_tokens
        return out

    def _streams(self, n: int, tokens: int) -> list[Timed]:
        """`n` streams at once, each `tokens` long (end of text ignored)."""
        runs: list[Timed] = []
        lock = threading.Lock()

        def client(messages: list[dict], session: str) -> None:
            run = stream_chat(self.url, messages, session=session, max_tokens=tokens,
                              ignore_eos=True)
            with lock:
                runs.append(run)
        keys = [next(self.keys) for _ in range(n)]
        threads = [threading.Thread(target=client, args=(self.prompts.messages(
            PROMPT_TOKENS, key), f"bench-{key}")) for key in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(runs) != n:
            raise RuntimeError(f"{n - len(runs)} of {n} streams failed")
        return runs

    def decode(self, streams: Sequence[int], tokens: int, prefix: str = "") -> dict:
        """At each number of concurrent streams, twice (the first run may meet shapes not
        yet compiled; the second is the figure): total tokens/s (every stream's tokens over
        the time from the first request sent to the last stream's end), each stream's
        decode rate (median) and the gaps between deltas (median, p99, over all streams)."""
        out: dict = {}
        for n in streams:
            first, runs = self._streams(n, tokens), self._streams(n, tokens)
            out[f"{prefix}decode_tok_s_{n}"] = _total_rate(runs)
            out[f"{prefix}decode_first_run_tok_s_{n}"] = _total_rate(first)
            out[f"{prefix}decode_per_stream_tok_s_{n}"] = statistics.median(
                r.decode_tok_s for r in runs)
            gaps = sorted(g for r in runs for g in r.gaps) or [float("nan")]  # no text
            out[f"{prefix}decode_gap_ms_median_{n}"] = 1000 * statistics.median(gaps)
            out[f"{prefix}decode_gap_ms_p99_{n}"] = 1000 * gaps[min(len(gaps) - 1,
                                                                   int(0.99 * len(gaps)))]
            out[f"{prefix}decode_deltas_per_token_{n}"] = (
                sum(len(r.arrivals) for r in runs) / sum(r.completion_tokens for r in runs))
            together = together_rate(runs)
            if together is not None:
                out[f"{prefix}decode_together_tok_s_{n}"] = together
        return out

    def gap_under_prefill(self, long_prompt: int, stream_tokens: int,
                          warm_deltas: int = 16) -> dict:
        """A streaming client's gaps between deltas while another request prefills a
        `long_prompt`-token prompt: its usual gap (median before the long request), the
        largest gap while the prefill ran, and their ratio. The client asks for
        `stream_tokens` and leaves once the prefill is over."""
        arrivals: list[float] = []
        stop = threading.Event()
        key = next(self.keys)
        streaming = threading.Thread(target=stream_chat, args=(
            self.url, self.prompts.messages(PROMPT_TOKENS, key)), kwargs=dict(
            session=f"bench-{key}", max_tokens=stream_tokens, ignore_eos=True, stop=stop,
            arrivals=arrivals))
        long_messages = self.prompts.messages(long_prompt, next(self.keys))
        streaming.start()
        while len(arrivals) < warm_deltas and streaming.is_alive():
            time.sleep(0.001)
        sent = time.perf_counter()
        long = stream_chat(self.url, long_messages, session=f"bench-long-{key}",
                           max_tokens=1)
        prefilled = long.arrivals[0]
        while (streaming.is_alive() and arrivals[-1] <= prefilled + 0.05
               and time.perf_counter() < prefilled + 60):
            time.sleep(0.001)
        stop.set()
        streaming.join()
        times = list(arrivals)
        before = [b - a for a, b in zip(times[2:], times[3:], strict=False) if b <= sent]
        during = [b - a for a, b in zip(times, times[1:], strict=False)
                  if b > sent and a < prefilled]
        usual = statistics.median(before)
        worst = max(during) if during else float("nan")
        return {"prefill_gap_usual_ms": 1000 * usual, "prefill_gap_max_ms": 1000 * worst,
                "prefill_gap_ratio": worst / usual, "prefill_long_ttft_ms": 1000 * long.ttft,
                "prefill_long_prompt_tokens": long.prompt_tokens,
                "prefill_deltas_during": len(during),
                "prefill_covered": bool(times) and times[-1] >= prefilled}


def _total_rate(runs: list[Timed]) -> float:
    span = max(r.end for r in runs) - min(r.sent for r in runs)
    return sum(r.completion_tokens for r in runs) / span


def together_rate(runs: Sequence[Timed]) -> float | None:
    """Tokens/s in total while every stream was decoding: the deltas that arrived between
    the last stream's first delta and the first stream's last one, each counted as its
    stream's tokens per delta, over that window (None where the streams never all ran
    at once). What the engine's decode at that batch size does, seen through HTTP."""
    start = max(r.arrivals[0] for r in runs)
    end = min(r.arrivals[-1] for r in runs)
    if end <= start:
        return None
    tokens = sum(sum(start < t <= end for t in r.arrivals) * r.completion_tokens
                 / len(r.arrivals) for r in runs)
    return tokens / (end - start)
