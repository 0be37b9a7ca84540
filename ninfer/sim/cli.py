"""`ninfer fuzz sim`: one seeded simulation (`--seed`), or random seeds for `--minutes`.

A failure copies the journal into the failures folder, says whether `ninfer journal check`
reproduces it from the file alone (it does for the journal-checkable invariants, J in
specs/invariants.md), and prints the command that replays the run; exit status 1."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

DESCRIPTION = """\
Deterministic simulation of the whole serving loop: scheduler, store, journal (a real
SQLite file), SimModel, a virtual clock and simulated clients (multi-turn conversations,
retries, rewrites of an earlier turn, several tenants and sessions, shared system
prompts, stop tokens, racing session keys). One seed drives everything, and with it the
faults: disconnects at random event boundaries and between draft and verify, a disconnect
followed at once by the same messages, stop strings, deadlines passed during slow steps,
long prompts that exhaust the pools (preemption), operator evictions and a low endpoint
capacity, crashes between two journal commits (recovered from the file as a killed
process leaves it, keeping or losing the tensors; sometimes killed again while
recovering), and restarts with other options (mode, lanes, prefill chunk, draft length,
journal content).

Every invariant is checked after every step; at the end everything submitted must end
and the pools must come back full. The summary ends with the SHA-256 of the journal's
event rows: the same seed and steps give the same hash.

On a failure the journal is copied to FAILURES/sim-SEED.db, and the commands that check
it (`ninfer journal check`) and replay the run are printed; exit status 1."""


def add_sim_parser(fuzz_subparsers) -> argparse.ArgumentParser:
    """Register `sim` under `ninfer fuzz`."""
    sim = fuzz_subparsers.add_parser(
        "sim", help="deterministic simulation of the serving loop under seeded faults",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    sim.add_argument("--seed", type=int, default=None,
                     help="run this one seed (reproduces a reported failure); without it, "
                          "random seeds until --minutes pass")
    sim.add_argument("--steps", type=int, default=1_000,
                     help="engine steps per seed, before the drain (default 1000)")
    sim.add_argument("--minutes", type=float, default=10.0,
                     help="how long to try random seeds (default 10)")
    sim.add_argument("--failures", default="fuzz-failures",
                     help="where a failing run's journal is copied (default fuzz-failures/)")
    sim.set_defaults(func=_main)
    return sim


def _main(args: argparse.Namespace) -> int:
    failures = Path(args.failures)
    if args.seed is not None:
        return run_one(args.seed, args.steps, failures)
    return hunt(args.minutes, args.steps, failures)


def run_one(seed: int, steps: int, failures: Path, *, quiet: bool = False) -> int:
    """One run: print its summary (unless `quiet`), or the failure report; 0 or 1."""
    from .simulation import SimulationFailed, run_simulation
    with tempfile.TemporaryDirectory(prefix="ninfer-sim-") as work:
        try:
            summary = run_simulation(seed, steps, Path(work), failures=failures)
        except SimulationFailed as failed:
            report(failed)
            return 1
    if not quiet:
        print(summary.format())
    return 0


def hunt(minutes: float, steps: int, failures: Path) -> int:
    """Random seeds until `minutes` pass or one fails."""
    from tqdm import tqdm
    total = max(int(minutes * 60), 1)
    started = time.monotonic()
    rng = random.SystemRandom()
    seeds = 0
    with tqdm(total=total, unit="s", desc="fuzz sim",
              bar_format="{desc}: {bar} {n_fmt}/{total_fmt}s{postfix}") as bar:
        while time.monotonic() - started < minutes * 60:
            seed = rng.randrange(2**32)
            bar.set_postfix_str(f"{seeds} seeds x {steps} steps, now seed {seed}")
            status = run_one(seed, steps, failures, quiet=True)
            seeds += 1
            bar.update(min(int(time.monotonic() - started), total) - bar.n)
            if status:
                return status
    print(f"no failure in {seeds} seeds of {steps} steps")
    return 0


def report(failed) -> None:
    """The exception, the journal, and the two commands that reproduce the failure; the
    journal's meta records what `journal check` says of it."""
    from .simulation import annotate
    traceback.print_exception(failed.cause, file=sys.stderr)
    print(f"\nFAILURE in the simulation: {failed}", file=sys.stderr)
    print(f"journal written to {failed.journal}", file=sys.stderr)
    verdict = journal_verdict(failed.journal)
    found = verdict.get("ok") is False
    annotate(failed.journal, journal_check=[verdict["invariant"], verdict["seq"]] if found
             else None)
    if found:
        print(f"  ninfer journal check {failed.journal}   # reproduces it: invariant "
              f"{verdict['invariant']} at seq {verdict['seq']}", file=sys.stderr)
    else:
        print(f"  (ninfer journal check {failed.journal} passes: this violation is not "
              "checkable from a journal alone)", file=sys.stderr)
    print(f"replay with: ninfer fuzz sim --seed {failed.seed} --steps {failed.steps}",
          file=sys.stderr)


def journal_verdict(path: Path) -> dict:
    """`ninfer journal check --json` on `path`, in a fresh process: the real predicate and
    checker, whatever this process has patched."""
    done = subprocess.run([sys.executable, "-m", "ninfer.cli", "journal", "check", "--json",
                           str(path)], capture_output=True, text=True, check=False)
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {"error": done.stderr.strip()}
