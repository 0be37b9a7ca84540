"""`ninfer fuzz stateful`: the Hypothesis state machine with fresh random seeds, for as
long as asked. CI runs a fixed, derandomized budget; this is the long hunt.

hypothesis is imported here only when the command runs (through `.stateful`): where it is
missing the command says what to install, in one line, and exits 2."""

from __future__ import annotations

import random
import sys
import time
import traceback

from tqdm import tqdm

MISSING_HYPOTHESIS = ("ninfer fuzz stateful: needs hypothesis, which is not installed: "
                      "pip install 'ninfer[fuzz]'")


def run_stateful(*, minutes: float, max_examples: int, seed: int | None) -> int:
    """Rounds of `max_examples` examples with new seeds until `minutes` pass (one round
    with `seed` when given): 0, 1 on a failure, 2 without hypothesis."""
    try:
        from .stateful import run_round
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "hypothesis":
            raise
        print(MISSING_HYPOTHESIS, file=sys.stderr)
        return 2
    if seed is not None:
        return _one(run_round, seed, max_examples)
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
            status = _one(run_round, round_seed, max_examples, quiet=True)
            rounds += 1
            bar.update(min(int(time.monotonic() - started), bar.total - bar.n))
            if status:
                return status
    print(f"no failure in {rounds} rounds of {max_examples} examples")
    return 0


def _one(run_round, round_seed: int, max_examples: int, quiet: bool = False) -> int:
    """One round (`run_round(seed, max_examples)`): 0, or 1 with how to reproduce it."""
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
