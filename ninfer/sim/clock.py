"""The simulation's virtual clock: simulated seconds that only the simulator moves.

Passed to `Engine(clock=...)`, it stamps every event, so a journal's times (and with them
its bytes) are the same run to run."""

from __future__ import annotations


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def jump_to(self, when: float) -> None:
        """Move on to `when` (an idle server waits for its next client); never back."""
        self.now = max(self.now, when)
