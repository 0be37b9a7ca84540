"""`ninfer fuzz stateful`: it runs the Hypothesis state machine, and where hypothesis is not
installed (the package does not depend on it) it says in one line what to install and exits
2, without a traceback."""

import sys

from ninfer.cli import main
from ninfer.fuzz.command import MISSING_HYPOTHESIS


def test_without_hypothesis_the_command_says_what_to_install_and_exits_2(monkeypatch, capsys):
    for name in [n for n in sys.modules if n.partition(".")[0] == "hypothesis"]:
        monkeypatch.setitem(sys.modules, name, None)  # None there: the import fails
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    monkeypatch.delitem(sys.modules, "ninfer.fuzz.stateful", raising=False)
    assert main(["fuzz", "stateful", "--seed", "1", "--max-examples", "1"]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [MISSING_HYPOTHESIS]
    assert "pip install 'ninfer[fuzz]'" in MISSING_HYPOTHESIS
    assert out == ""


def test_with_hypothesis_a_seeded_round_runs_and_reports_no_failure(capsys):
    assert main(["fuzz", "stateful", "--seed", "7", "--max-examples", "2"]) == 0
    assert capsys.readouterr().out.strip() == "seed 7: 2 examples, no failure"
