"""A seed's world: the engine's options, the pools, how often each fault strikes, how busy
the clients are. Drawn first from the run's one `random.Random`, so a seed names it all."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from ..engine.engine import EngineConfig

SPECS = ("none", "mtp", "ngram")
STEP_SECONDS = 0.02   # virtual duration of an ordinary engine step
MAX_LANES = 3


@dataclass(frozen=True)
class FaultRates:
    """Probability, per engine step, of each fault the simulator injects itself."""

    evict: float      # an operator evicts a random endpoint before the step
    slow: float       # the step takes seconds of virtual time, not STEP_SECONDS
    crash: float      # the step's journal commit never happens; restart on the same file
    restart: float    # a restart between two steps, with other options


@dataclass(frozen=True)
class Scenario:
    config: EngineConfig
    num_blocks: int
    block_size: int
    num_slots: int
    rates: FaultRates
    arrival_rate: float   # new clients per virtual second
    max_clients: int      # clients connected at once
    cut: float            # probability that a request's client disconnects on purpose
    burst: float          # probability that an arrival is a burst of long prompts

    @classmethod
    def draw(cls, rng: random.Random) -> Scenario:
        block_size = rng.choice((2, 4, 8))
        positions = rng.choice((160, 192, 256, 384, 640))  # small pools: preemption
        config = EngineConfig(max_concurrency=rng.choice((1, 2, 2, 3, 3)),
                              spec=rng.choice(SPECS), **other_options(rng),
                              max_endpoints=rng.choice((2, 4, 8, 16)),
                              auto_anchors=rng.choice((0, 1, 2, 2, 3)),
                              max_context=rng.choice((4096, 4096, 4096, 160, 256)),
                              journal_tokens=rng.random() < 0.75, check_reuse=True)
        rates = FaultRates(evict=rng.uniform(0.0, 0.05), slow=rng.uniform(0.005, 0.03),
                           crash=rng.uniform(0.001, 0.008), restart=rng.uniform(0.001, 0.006))
        rest = {"num_slots": rng.choice((12, 3 * MAX_LANES + 10, 32)), "rates": rates,
                "arrival_rate": rng.uniform(1.0, 6.0), "max_clients": rng.randint(2, 8),
                "cut": rng.uniform(0.1, 0.45), "burst": rng.uniform(0.05, 0.3)}
        # long prompts paced beside decoding lanes, their forwards in parts (cut, preempted,
        # adopted between parts), in half the scenarios: drawn from a generator of its own,
        # seeded from the scenario's (without drawing from it), so that every draw of the
        # simulation stays each seed's
        own = random.Random(hash(rng.getstate()[1]))
        config = dataclasses.replace(config, decode_gap=own.choice((0.0, 3.0)))
        return cls(config, positions // block_size, block_size, **rest)

    def describe(self) -> str:
        c = self.config
        return (f"spec={c.spec} max_concurrency={c.max_concurrency} "
                f"prefill_chunk={c.prefill_chunk} draft_tokens={c.draft_tokens} "
                f"max_endpoints={c.max_endpoints} auto_anchors={c.auto_anchors} "
                f"max_context={c.max_context} journal_tokens={c.journal_tokens} "
                f"decode_gap={c.decode_gap}; pools "
                f"{self.num_blocks} blocks of {self.block_size}, {self.num_slots} slots")


def other_options(rng: random.Random) -> dict:
    """The options a restart may change besides the mode (`restart_options` adds it)."""
    return {"prefill_chunk": rng.randint(2, 16), "draft_tokens": rng.randint(1, 4)}


def restart_options(rng: random.Random, config: EngineConfig) -> dict:
    """Options for a restart: another mode, lane count, chunk, draft length or journal
    content (at least one of them differs from `config`'s)."""
    while True:
        options = {"spec": rng.choice(SPECS), "max_concurrency": rng.randint(1, MAX_LANES),
                   **other_options(rng), "journal_tokens": rng.random() < 0.75}
        if any(getattr(config, k) != v for k, v in options.items()):
            return options
