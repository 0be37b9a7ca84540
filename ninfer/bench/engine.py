"""`ninfer bench engine`: the engine on a real model (the default tiny one unless --model).

Figures, each from the same run: prefill tok/s; decode tok/s at batch 1/4/8; tokens per
verify and speedup over plain decode for MTP and n-gram drafting (as the model drafts, and
with drafts forced right or forced wrong, which bound what drafting can gain or cost); bytes
per checkpoint and per KV token; time to first token of turn 2 over turn 1 at 4K and 16K
tokens of context (turn 2 = turn 1 + its reply + a new message of 30 tokens).
"""

from __future__ import annotations

import json
import random
import sys
import time

import torch
from tqdm import tqdm

from ..engine.engine import Engine, EngineConfig, Submit, run_until_idle
from ..engine.runner import Runner
from ..lifecycle.request import SamplingParams
from ..model.pools import BlockPool, SlotPool
from ..model.runtime import open_model

TARGETS = {"turn2_ratio_16k": ("<=", 0.013), "turn2_ratio_4k": ("<=", 0.038),
           "prefill_tok_s": (">=", 1650.0), "decode_tok_s_b1": (">=", 175.0)}


class Bench:
    def __init__(self, path: str | None, device: str, dtype: str, ranks=None) -> None:
        """`ranks` (`ninfer.model.ranks.launch`): the model sharded over them."""
        from ..server.serve import default_prefill_chunk
        # a GPU's chunk is the server's default; the CPU keeps 2048, which every CPU figure
        # of this bench was measured with (the server's CPU default is 512)
        self.chunk = default_prefill_chunk(device) if device != "cpu" else 2048
        self.om = open_model(path, device=device, dtype=dtype, kv_capacity=80_000,
                             num_slots=48, ranks=ranks)
        self.vocab = min(self.om.files.config.vocab_size, self.om.tokenizer.vocab_size)
        self.rng = random.Random(0)
        self.ids = 0
        for spec in ("none", "mtp"):  # warm-up: first calls allocate and initialise
            self.decode(1, tokens=8, spec=spec)

    def engine(self, **kw) -> Engine:
        om = self.om  # fresh bookkeeping over the same storage: every block and slot free
        blocks = BlockPool(om.blocks.num_blocks, om.blocks.block_size)
        slots = SlotPool(om.slots.num_slots)
        config = EngineConfig(**{"max_context": 40_000, "prefill_chunk": self.chunk,
                                 "max_endpoints": 64, **kw})
        engine = Engine(om.model, config, blocks=blocks, slots=slots)
        engine.recover()
        return engine

    def prompt(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(self.vocab) for _ in range(n))

    def submit(self, engine: Engine, prompt, max_tokens: int, session: str = "s",
               boundaries: tuple[int, ...] = ()) -> str:
        self.ids += 1
        rid = f"b{self.ids}"
        engine.submit(Submit(rid, tuple(prompt), session, "bench", SamplingParams(max_tokens),
                             tuple(boundaries)))
        return rid

    def ttft(self, engine: Engine, prompt, max_tokens: int = 16, boundaries=(),
             steps: list[float] | None = None) -> tuple[float, str]:
        """Seconds from submit to the first token (each engine step's ms appended to
        `steps`, when given), then run to the end."""
        rid = self.submit(engine, prompt, max_tokens, boundaries=boundaries)
        t0 = time.perf_counter()
        while not engine.requests.get(rid) or not engine.requests[rid].outputs:
            s0 = time.perf_counter()
            engine.step()
            if steps is not None:
                steps.append((time.perf_counter() - s0) * 1e3)
        first = time.perf_counter() - t0
        run_until_idle(engine)
        return first, rid

    def prefill(self, n: int = 4096) -> dict:
        engine = self.engine()
        self.ttft(engine, self.prompt(64), 2)  # warm-up
        seconds, _ = self.ttft(engine, self.prompt(n), 1)
        return {"prefill_tok_s": n / seconds, "tokens": n}

    def verify_answers(self, prompts, n: int) -> dict:
        """Each prompt's first n greedy tokens as this engine's verify rounds compute them:
        what drafts forced right must be. Under `--spec mtp` with every draft forced
        wrong, each round of 3 drafts commits the token of its first position, which a
        round whose drafts are right computes at the same position in another row of the
        same verify. (A plain step computes with other kernels than a verify: on a GPU the
        two need not agree at the random weights' near-ties, so drafts forced from a plain
        decode were mostly rejected there, 1 of 9 on an H100.)"""
        engine = self.engine(spec="mtp", max_concurrency=len(prompts), draft_tokens=3,
                             adaptive_drafting=False)   # every round drafts 3, never pauses
        ids = [self.submit(engine, p, n, f"a{i}") for i, p in enumerate(prompts)]
        restore = _force_drafts("reject", {})
        try:
            run_until_idle(engine)
        finally:
            restore()
        return {p: tuple(engine.requests[r].outputs) for p, r in zip(prompts, ids, strict=True)}

    def decode(self, batch: int, tokens: int = 64, spec: str = "none", context: int = 64,
               drafts: str | None = None) -> dict:
        engine = self.engine(spec=spec, max_concurrency=batch, draft_tokens=3)
        prompts = [self.prompt(context) for _ in range(batch)]
        answers = self.verify_answers(prompts, tokens + 4) if drafts == "accept" else {}
        ids = [self.submit(engine, p, tokens, f"d{i}") for i, p in enumerate(prompts)]
        while any(not engine.requests.get(r) or not engine.requests[r].outputs for r in ids):
            engine.step()  # prefill everyone first: this figure is decode only
        rounds, times = [], []

        def on_event(e) -> None:
            if e.kind == "TokensCommitted":
                rounds.append((e.drafted, e.accepted))
                times.append(time.perf_counter())
        engine.log.listeners.append(on_event)
        restore = _force_drafts(drafts, answers)
        try:
            t0, steps = time.perf_counter(), engine.steps
            run_until_idle(engine)
            seconds = time.perf_counter() - t0
        finally:
            restore()
        done = sum(len(engine.requests[r].outputs) - 1 for r in ids)
        # one lane: the engine's pace between its commits (a verify round each), without
        # the turn's start and end (the request's finishing is in tok_s)
        gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False)) if batch == 1 \
            else []
        return {"tok_s": done / seconds, "tokens": done, "verifies": len(rounds),
                "seconds": seconds, "steps": engine.steps - steps,
                "round_us_median": gaps[len(gaps) // 2] * 1e6 if gaps else None,
                "tokens_per_verify": done / max(len(rounds), 1),
                "drafted": sum(d for d, _ in rounds), "accepted": sum(a for _, a in rounds)}

    def turn2(self, n: int) -> dict:
        engine = self.engine()
        first = self.prompt(n)
        t1, rid = self.ttft(engine, first, 16)
        second = first + tuple(engine.requests[rid].outputs) + self.prompt(30)
        t2, rid2 = self.ttft(engine, second, 4)
        return {"turn1_s": t1, "turn2_s": t2, "ratio": t2 / t1,
                "reused": engine.requests[rid2].reuse_base, "prompt": len(second)}

    def rollback(self, k: int = 3, reps: int = 100) -> dict:
        """A verify of k+1 positions that keeps the recurrent state after each position
        (rollback is a pick), against one that keeps only the last and, on a partial accept,
        recomputes the accepted prefix from the round's start (here half the round)."""
        from ..model.hybrid import HybridState
        net, c = self.om.model.net, self.om.files.config
        ids = torch.tensor([list(self.prompt(k + 1))])
        pos = torch.arange(100, 101 + k)[None]
        state = HybridState.initial(c, 1, self.om.model.dtype)

        def timed(run) -> float:
            run()
            t0 = time.perf_counter()
            for _ in range(reps):
                run()
            return (time.perf_counter() - t0) / reps * 1e3

        with torch.inference_mode():
            keep = timed(lambda: net.forward(ids, pos, state, all_states=True))
            half = (k + 1) // 2
            recompute = timed(lambda: (net.forward(ids, pos, state),
                                       net.forward(ids[:, :half], pos[:, :half], state)))
        return {"keep_states_ms": keep, "recompute_ms": recompute}

    def sizes(self) -> dict:
        m = self.om.model
        per_kv = sum(t[0, 0].numel() * t.element_size()
                     for store in (m.kv_k, m.kv_v) for t in store.values())
        per_mtp = sum(t[0, 0].numel() * t.element_size()
                      for store in (m.mtp_k, m.mtp_v) for t in store.values())
        slot = sum(t[0].numel() * t.element_size()
                   for store in (m.conv, m.recurrent) for t in store.values())
        slot += m.hidden[0].numel() * m.hidden.element_size()
        return {"bytes_per_kv_token": per_kv + per_mtp, "bytes_per_checkpoint_state": slot}


def _force_drafts(mode: str | None, answers: dict):
    """Replace the drafter by one that is always right ("accept", from each prompt's
    precomputed greedy continuation in `answers`) or always wrong ("reject"); returns the
    function that puts the real one back."""
    if mode is None:
        return lambda: None
    real = Runner.draft

    def forced(self, lane, seq, frontier, k, choice, ngrams=None):
        real(self, lane, seq, frontier, k, choice, ngrams)  # the drafter's own work still runs
        if k <= 0:
            return [], None
        if mode == "reject":
            return [(seq[-1] + 1 + i) % self.model.vocab_size for i in range(k)], None
        for prompt, answer in answers.items():
            if tuple(seq[:len(prompt)]) == prompt:
                done = len(seq) - len(prompt)
                return list(answer[done:done + k]), None
        return [], None

    Runner.draft = forced

    def restore() -> None:
        Runner.draft = real
    return restore


def main(model: str | None = None, device: str = "cpu", dtype: str = "float32",
         json_path: str | None = None, quick: bool = False) -> int:
    from ..model.runtime import benchmark_on_the_random_model
    benchmark_on_the_random_model()
    b = Bench(model, device, dtype)
    results: dict = {"model": b.om.name, "device": device, "dtype": dtype}
    steps = [("prefill", lambda: b.prefill(1024 if quick else 4096))]
    for batch in (1, 4, 8):
        steps.append((f"decode_b{batch}", lambda batch=batch: b.decode(batch)))
    long_context = 1024 if quick else 4096
    steps.append(("decode_b1_long", lambda: {**b.decode(1, context=long_context),
                                             "context": long_context}))
    for spec in ("mtp", "ngram"):
        for drafts in (None, "accept", "reject"):
            name = f"{spec}_{drafts or 'model'}"
            steps.append((name, lambda s=spec, d=drafts: b.decode(1, spec=s, drafts=d)))
    for n in ((1024,) if quick else (4096, 16384)):
        steps.append((f"turn2_{n // 1024}k", lambda n=n: b.turn2(n)))
    steps.append(("rollback", b.rollback))
    steps.append(("sizes", b.sizes))
    for name, run in tqdm(steps, desc="bench engine", file=sys.stderr, leave=False):
        results[name] = run()
    _report(results)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _report(r: dict) -> None:
    plain = r["decode_b1"]["tok_s"]
    rows = [(f"prefill ({r['prefill']['tokens']:,}-token prompt)",
             f"{r['prefill']['prefill_tok_s']:,.0f} tok/s")]
    rows += [(f"decode, batch {b}", f"{r[f'decode_b{b}']['tok_s']:,.0f} tok/s")
             for b in (1, 4, 8)]
    rows.append((f"decode, batch 1, {r['decode_b1_long']['context']:,}-token context",
                 f"{r['decode_b1_long']['tok_s']:,.0f} tok/s"))
    for key in [k for k in r if k.startswith(("mtp_", "ngram_"))]:
        x = r[key]
        rows.append((f"{key.replace('_', ' drafts ', 1)}",
                     f"{x['tok_s']:,.0f} tok/s ({x['tok_s'] / plain:.2f}x plain), "
                     f"{x['tokens_per_verify']:.2f} tokens per verify"))
    for key in [k for k in r if k.startswith("turn2_")]:
        t = r[key]
        rows.append((f"turn 2 / turn 1 TTFT, {key[6:]}",
                     f"{t['ratio']:.4f} ({t['turn2_s'] * 1e3:.1f} ms / {t['turn1_s']:.2f} s, "
                     f"reused {t['reused']:,} of {t['prompt']:,})"))
    rb = r["rollback"]
    rows.append(("verify k=3 keeping per-position states / recomputing",
                 f"{rb['keep_states_ms']:.2f} ms / {rb['recompute_ms']:.2f} ms"))
    rows.append(("bytes per KV token (attention + MTP)", f"{r['sizes']['bytes_per_kv_token']:,}"))
    rows.append(("bytes per checkpoint (recurrent slot)",
                 f"{r['sizes']['bytes_per_checkpoint_state']:,}"))
    width = max(len(a) for a, _ in rows)
    print(f"ninfer bench engine: {r['model']} on {r['device']} ({r['dtype']})")
    for a, b in rows:
        print(f"  {a:<{width}}  {b}")
    print(json.dumps({"bench": "engine", "results": r}))
