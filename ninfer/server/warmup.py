"""Warm-up before ready: everything a request can hit for the first time is made before
`/health` says 200, so the first request of each shape costs what a repeat costs.

Three parts, all on the engine thread, timed and logged:

- the chunk attention's cuDNN plans (`TorchModel.prepare_prefill`): a whole prefill chunk
  over each whole number of chunks before it, the only shapes that then take the split;
- requests (`planned`), each through the whole engine: a prompt of one whole prefill
  chunk and an unaligned rest, its next turn (a restore, then a delta prefill at an
  unaligned position), a one-token next turn, a half chunk and next turns of a few tokens
  (each with the message boundaries a served chat request has, where its prefill stops:
  a first turn's message end; a next turn's two, in one forward keeping its states),
  a first piece of 128 tokens, a system message's first pieces of 2, 4 and 8 tokens and a
  generation prompt of 5, short prompts alone and prefilled together, a sampled
  request. Triton specialises a
  kernel on its constexprs (tile sizes that follow a length's power of two) and its integer
  arguments (one, a multiple of 16, anything else): these lengths and offsets compile the
  variants a prompt meets, and the cuBLAS and attention paths of a prefill, a restore and
  a decode run once. Whatever a request still meets for the first time after ready is
  logged (`kernels.compiles`);
- CUDA graphs (`TorchModel.capture_graphs`): every decode graph (batch sizes up to
  --max-concurrency, block-table widths up to --max-context's), a next turn's delta's at
  each width, and with `--spec mtp` every verify and MTP graph, captured now instead of on
  a request's first step of that shape.

  Capturing empties the allocator's cache, so the largest prefill runs once more after
  the captures: the first request's forward then finds its memory cached.

What the warm-up publishes is evicted. Triton keeps its compiled kernels on disk
(`TRITON_CACHE_DIR`, default ~/.triton/cache), so a second start compiles nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass, field

from ..engine.engine import Submit
from ..lifecycle import events as ev
from ..lifecycle.request import SamplingParams

log = logging.getLogger("ninfer.server")

TENANT = "ninfer-warmup"
UNALIGNED = 37        # a rest past a whole chunk, and offsets, that no power of two divides
NEW_TURN = 29         # a next turn's new tokens (unaligned too)
GENERATION = 3        # a generation prompt's tokens after a message's end, by default
LARGEST = "chunk-and-rest"   # the request whose forward is the largest: a whole chunk


@dataclass(frozen=True)
class Planned:
    """One warm-up request: `prompt` tokens (or, with `after`, that request's prompt and
    output followed by `prompt` new tokens: its next turn), `tokens` to generate."""

    name: str
    prompt: int
    tokens: int
    after: str | None = None
    sampled: bool = False
    anchored: bool = True   # with the boundaries a served chat request has (`bounds`)
    first: int = 0          # a first turn's first message's end too (a system message's)
    tail: int = GENERATION  # the tokens after its last message's end

    def bounds(self, head: int) -> tuple[int, ...]:
        """The message boundaries a served chat request has after `head` tokens of earlier
        turns: a first turn's message ends (the generation prompt, `tail` tokens, after the
        last); a next turn's reply end and new message end, so its delta is one forward
        that keeps its positions' states (another specialisation than a plain prefill's).
        A prefill stops at each, so a served 1,024-token prompt runs 1,015 tokens then 9
        (anchor-1b's template with thinking off: the H100 run of stop 46), and one with a
        system message first runs that message alone."""
        if not self.anchored:
            return ()
        last = (self.prompt - self.tail,) if self.prompt > self.tail + 1 else ()
        if not self.after:
            return ((self.first,) if self.first else ()) + last
        return (head,) + tuple(head + b for b in last)


def planned(chunk: int, max_context: int) -> list[list[Planned]]:
    """The warm-up's requests for prefill chunks of `chunk` tokens, in batches: a batch's
    requests are submitted together (prefilled in the same step, each in forwards of its
    own, and decoded together), each batch after the one before it has finished.
    Each prompt must fit `max_context` with its output (one that does not is left out)."""
    first = min(chunk + UNALIGNED, max(1, max_context // 2 - 16))
    second = min(chunk // 2, max(1, max_context // 4))
    quarter = min(max(chunk // 4, 1), max(1, max_context // 8))
    # a few new tokens, each in a tile size class of its own (the conv's power of two up
    # to 64; the attention's row block of 16 below 5)
    turns = [(2, "its-next-turn"), (3, "turn-of-2"), (12, "turn-of-3"), (16, "turn-of-12")]
    return [[Planned(LARGEST, first, 8)],
            [Planned("next-turn", NEW_TURN, 4, after=LARGEST, anchored=False)],
            [Planned("one-token-turn", 1, 2, after="next-turn")],
            [Planned("half-chunk", second, 4)],
            [Planned("its-next-turn", NEW_TURN, 4, after="half-chunk")],
            *([Planned(f"turn-of-{n}", n, 2, after=after)] for n, after in turns),
            # a completion's (no messages), and a paced piece's size on a GPU beside
            # decoding lanes (whole chunks of a power-of-two length, no boundary)
            [Planned("one-tile", 64, 4, anchored=False)],
            [Planned("quarter-chunk", quarter, 2, anchored=False)],
            # a first piece whose length 16 divides and whose 64-token chunks do not
            # number 1 or a multiple of 16 (128 then 3): Triton specialises the GDN
            # kernels' T and NT on those classes, and the pieces above cover the others
            [Planned("two-tiles", 128 + 3, 2)],
            # eager pieces in the conv's tile classes below a tile (2, 4 and 8: a piece of
            # 9 .. 32 tokens replays a turn graph): a chat prompt's system message alone,
            # and a generation prompt of 5 tokens (thinking on) after its message's end
            [Planned("first-of-2", 80, 2, first=2), Planned("first-of-4", 80, 2, first=4)],
            [Planned("first-of-8", 80, 2, first=8), Planned("tail-of-5", 80, 2, tail=5)],
            [Planned("aligned", 48, 6), Planned("short", 5, 6), Planned("odd", 100, 6)],
            [Planned("sampled", 21, 4, sampled=True)]]


@dataclass
class WarmUp:
    requests: int = 0
    reused: int = 0                # of them, started from a stored state (the next turns)
    requests_s: float = 0.0
    graphs: dict | None = None     # TorchModel.capture_graphs's report (None: no graphs)
    prefill: dict | None = None    # TorchModel.prepare_prefill's report (None: not run)
    total_s: float = 0.0
    batches: list[tuple[str, float]] = field(default_factory=list)  # (names, seconds)

    def slowest(self, n: int = 4) -> list[tuple[str, float]]:
        """The `n` slowest of the requests sent together, slowest first."""
        return sorted(self.batches, key=lambda b: -b[1])[:n]


def warm_up(server, *, verify_tokens: int = 0, full: bool | None = None) -> WarmUp:
    """Run the warm-up on `server`'s engine (the model loaded, not yet ready) and drop what
    it published. `verify_tokens`: the longest verify a round may run (drafts + 1), 0
    without speculation. `full` (default: on a GPU) runs every planned request; otherwise
    only the short one (the CPU compiles nothing per shape). Raises if a warm-up request
    does not finish: a server that cannot answer these must not say it is ready."""
    began = time.monotonic()
    thread = server.thread
    config = thread.engine.config
    if full is None:
        full = getattr(getattr(thread.engine.model, "device", None), "type", "cpu") != "cpu"
    report = WarmUp()
    rng = random.Random(0)
    vocab = thread.engine.model.vocab_size   # (the ids reach the engine, not a detokeniser)
    outputs: dict[str, tuple[int, ...]] = {}
    sessions: dict[str, str] = {}   # a next turn continues its first turn's session
    plan = planned(config.prefill_chunk, config.max_context) if full \
        else [[Planned("short", 5, 2)]]

    def prepare(engine):
        model = engine.model
        if not full or not hasattr(model, "prepare_prefill"):
            return None
        return model.prepare_prefill(chunk=config.prefill_chunk, max_context=config.max_context)

    report.prefill = thread.call(prepare).result(600)
    if report.prefill and report.prefill["shapes"]:
        log.info("warm-up: the chunk attention's cuDNN plans for %d shapes (a chunk of %d "
                 "over whole chunks) built in %.1f s", len(report.prefill["shapes"]),
                 config.prefill_chunk, report.prefill["seconds"])

    def run_batch(batch: list[Planned]) -> None:
        batch_began = time.monotonic()
        handles = []
        for p in batch:
            if p.after and p.after not in outputs:
                continue   # (its first turn was left out)
            head = outputs[p.after] if p.after else ()
            sessions[p.name] = sessions[p.after] if p.after else f"warmup-{p.name}"
            session = sessions[p.name] if full else None
            prompt = head + tuple(rng.randrange(vocab) for _ in range(p.prompt))
            if len(prompt) + p.tokens > config.max_context:
                continue   # (a --max-context too small for it: a later turn is left out)
            params = SamplingParams(max_tokens=p.tokens, temperature=0.8, top_p=0.9,
                                    top_k=20, seed=1) if p.sampled \
                else SamplingParams(max_tokens=p.tokens)
            tokens: list[int] = []

            def seen(e: ev.Event, into: list[int] = tokens) -> None:
                if isinstance(e, ev.TokensCommitted):
                    into.extend(e.tokens or ())
                elif isinstance(e, ev.RequestStarted) and e.reuse_base > 0:
                    report.reused += 1

            handle = thread.submit(Submit(f"warmup-{server.boot}-{p.name}", prompt,
                                          session, TENANT, params, p.bounds(len(head))),
                                   on_event=seen)
            handles.append((p, prompt, tokens, handle))
        for p, prompt, tokens, handle in handles:
            outcome = handle.wait(600)
            if not isinstance(outcome, ev.RequestFinished):
                raise RuntimeError(f"warm-up request {p.name!r} ended with {outcome!r}")
            outputs[p.name] = prompt + tuple(tokens)
            report.requests += 1
        if handles:
            report.batches.append((" + ".join(p.name for p, *_ in handles),
                                   time.monotonic() - batch_began))

    for batch in plan:
        run_batch(batch)
    report.requests_s = time.monotonic() - began

    def capture(engine):
        model = engine.model
        if not hasattr(model, "capture_graphs"):
            return None
        return model.capture_graphs(max_context=engine.config.max_context,
                                    lanes=engine.config.max_concurrency,
                                    verify_tokens=verify_tokens)

    report.graphs = thread.call(capture).result(1800)
    if report.graphs and report.graphs["count"]:
        # each capture empties the allocator's cache (torch.cuda.graph does), so the first
        # requests after ready would allocate their forwards' memory from the driver again:
        # 4 to 10 new segments, +35 to +55 ms, on the H100 run of stop 46. The largest
        # prefill again fills it (its memory is cached, not freed, when it ends).
        largest = next(p for batch in plan for p in batch if p.name == LARGEST)
        run_batch([dataclasses.replace(largest, name="refill")])

    def drop(engine) -> None:
        for endpoint_id, stored in list(engine.store.endpoints.items()):
            if stored.facts.tenant == TENANT:
                engine.evict(endpoint_id, "warmup")

    thread.call(drop).result(60)
    report.total_s = time.monotonic() - began
    g = report.graphs
    log.info("warm-up: %d requests (%d from a stored state) in %.1f s%s; %.1f s in all",
             report.requests, report.reused, report.requests_s,
             "" if not g else f"; {g['count']} CUDA graphs ({g['decode']} decode, "
             f"{g['verify']} verify, {g['mtp']} MTP, {g['turn']} next-turn) held, those "
             f"not yet captured taking {g['seconds']:.1f} s, "
             f"graph memory {g['memory_bytes'] / 2**20:,.0f} MiB", report.total_s)
    if len(report.batches) > 1:   # (the full warm-up: a GPU's)
        log.info("warm-up: the slowest requests (what they compiled, on a first start): %s",
                 ", ".join(f"{names} {seconds:.1f} s" for names, seconds in report.slowest()))
    return report
