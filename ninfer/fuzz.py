"""`ninfer fuzz stateful`: the Hypothesis state machine with fresh random seeds, for as
long as asked. CI runs a fixed, derandomized budget; this is the long hunt."""

from __future__ import annotations

import random
import sys
import time
import traceback

from hypothesis import HealthCheck, seed, settings
from hypothesis.stateful import run_state_machine_as_test
from tqdm import tqdm

from .testing.stateful import LifecycleMachine


def run_round(round_seed: int, max_examples: int, steps: int = 60) -> None:
    machine = type("FuzzedLifecycle", (LifecycleMachine,), {})
    seed(round_seed)(machine)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None, database=None,
        derandomize=False, suppress_health_check=list(HealthCheck)))


def run_stateful(*, minutes: float, max_examples: int, seed: int | None) -> int:
    """Rounds of `max_examples` examples with new seeds until `minutes` pass; 1 on failure."""
    if seed is not None:
        return _one(seed, max_examples)
    deadline = time.monotonic() + minutes * 60
    rng = random.SystemRandom()
    rounds = 0
    with tqdm(total=int(minutes * 60), unit="s", desc="fuzz stateful",
              bar_format="{desc}: {bar} {n_fmt}/{total_fmt}s{postfix}") as bar:
        while time.monotonic() < deadline:
            round_seed = rng.randrange(2**32)
            bar.set_postfix_str(f"{rounds} rounds x {max_examples} examples, now seed "
                                f"{round_seed}")
            started = time.monotonic()
            status = _one(round_seed, max_examples, quiet=True)
            rounds += 1
            bar.update(min(int(time.monotonic() - started), bar.total - bar.n))
            if status:
                return status
    print(f"no failure in {rounds} rounds of {max_examples} examples")
    return 0


def _one(round_seed: int, max_examples: int, quiet: bool = False) -> int:
    try:
        run_round(round_seed, max_examples)
    except Exception as exc:
        traceback.print_exception(exc, file=sys.stderr)
        print(f"\nFAILURE with seed {round_seed}: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"reproduce with: ninfer fuzz stateful --seed {round_seed} "
              f"--max-examples {max_examples}", file=sys.stderr)
        return 1
    if not quiet:
        print(f"seed {round_seed}: {max_examples} examples, no failure")
    return 0
