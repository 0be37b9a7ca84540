"""An A/B of `ninfer bench` commands between two checkouts, alternating, on one machine.

    python bench/ab.py --before /path/to/old/checkout --after . --rounds 3 \\
        --json bench/results/ab-cpu.json lifecycle engine journal

Each round runs every named bench once from each checkout (before, after, then after, before
in the next round, so neither side always runs first), with that checkout first on
PYTHONPATH and the same interpreter. The figures are each numeric leaf of a bench's JSON;
the table gives each side's best run (the highest rate, the lowest time: load on a shared
machine only ever slows a run down, so the best is the figure least disturbed by it), its
median, and best after / best before, and marks a figure whose ratio is worse than
--tolerance. This machine's speed moves between runs, so only these same-run ratios mean
anything. A script of the repository's, not of the package: it compares two
versions of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# the arguments each bench runs with (smaller journals than the defaults: a round is minutes)
ARGS = {
    "lifecycle": ["--events", "300000", "--requests", "10000"],
    "journal": ["--events", "300000"],
    "engine": [],
}
# leaves that are sizes or settings, not measurements
NOT_FIGURES = {"tokens", "verifies", "drafted", "accepted", "context", "events", "repeat",
               "requests", "tokens_per_verify", "prompt", "reused", "bytes_per_kv_token",
               "bytes_per_checkpoint_state"}


def leaves(doc, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a JSON document, by its dotted path."""
    out: dict[str, float] = {}
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.update(leaves(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(doc, int | float) and not isinstance(doc, bool):
        out[prefix] = float(doc)
    return out


def is_figure(path: str) -> bool:
    name = path.rsplit(".", 1)[-1]
    return not path.startswith("targets.") and name not in NOT_FIGURES


def higher_is_better(path: str) -> bool:
    """Rates are better higher; times (s, ms, us) and time ratios (turn 2 over turn 1) lower."""
    name = path.rsplit(".", 1)[-1]
    if name.endswith(("per_s", "tok_s", "raw_ratio")):
        return True
    times = name.endswith("_s") or "_ms" in name or "_us" in name
    return not (times or path.startswith("turn2"))


def run(checkout: Path, bench: str, python: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        subprocess.run([python, "-m", "ninfer.cli", "bench", bench, *ARGS[bench],
                        "--json", str(out)], cwd=checkout, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return {k: v for k, v in leaves(json.loads(out.read_text())).items() if is_figure(k)}


def summarize(runs: dict, tolerance: float) -> tuple[list[dict], list[str]]:
    """Per bench and figure: each side's best and median, their ratios, and whether the
    best ratio is worse than `tolerance`; then the names of those that are."""
    table, outside = [], []
    for bench, by_side in runs.items():
        keys = sorted(set.intersection(*(set(x) for x in by_side["before"] + by_side["after"])))
        for key in keys:
            up = higher_is_better(key)
            pick = max if up else min
            a, b = (pick(x[key] for x in by_side[side]) for side in ("before", "after"))
            ma, mb = (statistics.median(x[key] for x in by_side[side])
                      for side in ("before", "after"))
            ratio = b / a if a else float("nan")
            worse = ratio < 1 - tolerance if up else ratio > 1 + tolerance
            table.append({"bench": bench, "figure": key, "before": a, "after": b,
                          "after_over_before": ratio,
                          "median_after_over_before": mb / ma if ma else float("nan"),
                          "higher_is_better": up, "worse_than_tolerance": worse})
            if worse:
                outside.append(f"{bench}.{key}")
    return table, outside


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("benches", nargs="+", choices=sorted(ARGS))
    p.add_argument("--before", type=Path, required=True, help="the old checkout")
    p.add_argument("--after", type=Path, default=Path("."), help="the new checkout")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--json", help="write every run's figures and the summary here")
    p.add_argument("--summarize", metavar="JSON", help="only summarize the runs of an earlier "
                   "--json file (no bench is run)")
    args = p.parse_args(argv)
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        b: {"before": [], "after": []} for b in args.benches}
    if args.summarize:
        runs = json.loads(Path(args.summarize).read_text())["runs"]
        args.rounds = 0
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for bench in args.benches:
            for side in order:
                print(f"round {r + 1}/{args.rounds}: {bench} ({side})", file=sys.stderr)
                runs[bench][side].append(run(sides[side], bench, sys.executable))
    table, outside = summarize(runs, args.tolerance)
    print(f"{'bench':<10} {'figure':<40} {'best before':>12} {'best after':>12} "
          f"{'after/before':>12} {'(medians)':>10}")
    for row in table:
        mark = "  WORSE" if row["worse_than_tolerance"] else ""
        print(f"{row['bench']:<10} {row['figure']:<40} {row['before']:>12.4g} "
              f"{row['after']:>12.4g} {row['after_over_before']:>12.3f} "
              f"{row['median_after_over_before']:>10.3f}{mark}")
    print(f"{len(outside)} of {len(table)} figures worse by more than "
          f"{args.tolerance:.0%}: {', '.join(outside) or 'none'}")
    if args.json:
        rounds = len(next(iter(runs.values()))["before"])
        Path(args.json).write_text(json.dumps({"rounds": rounds, "runs": runs,
                                               "table": table, "worse": outside}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
