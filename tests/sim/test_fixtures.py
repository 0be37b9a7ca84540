"""Journals of failures the simulation found and that were fixed, kept under tests/fixtures/
as `sim-<bug>.db`: the file `ninfer fuzz sim` wrote, as it stands. Its meta names the run
(`simulation`: seed, steps, the failure) and what `ninfer journal check` reported on it
(`journal_check`: [invariant, seq], or null for a violation no journal shows). The check
must go on reporting it, and the seed, replayed on today's code, must pass."""

import json
import sqlite3
from pathlib import Path

import pytest

from ninfer.lifecycle.reader import JournalReader
from ninfer.sim import run_simulation
from ninfer.tools.scan import check

FIXTURES = Path(__file__).parents[1] / "fixtures"


def _run_of(path: Path) -> dict:
    with sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True) as conn:
        return json.loads(conn.execute(
            "SELECT value FROM meta WHERE key = 'simulation'").fetchone()[0])


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("sim-*.db")), ids=lambda p: p.stem)
def test_a_fixed_failure_stays_found_and_fixed(path, tmp_path):
    run = _run_of(path)
    with JournalReader.open(path) as source:
        _, violation = check(source)
    expected = run["journal_check"]
    found = None if violation is None else [violation.invariant, violation.seq]
    assert found == expected, "journal check no longer reports what it did"
    run_simulation(run["seed"], run["steps"], tmp_path)  # raises if it is back
