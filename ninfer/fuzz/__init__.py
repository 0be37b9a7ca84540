"""`ninfer fuzz`: long invariant hunts with fresh random seeds, not CI.

`stateful` runs the Hypothesis state machine over the engine with SimModel (stateful.py;
command.py runs it in rounds until the time is up). It needs hypothesis, which the package
does not depend on: the `fuzz` extra (`pip install 'ninfer[fuzz]'`) brings it, and it is
imported only when the command runs. `sim` is the deterministic simulation (`ninfer/sim`),
which needs nothing more.
"""
