"""Deterministic simulation of the whole serving loop (`ninfer fuzz sim`): scenario.py draws
a seed's world, clients.py plays the HTTP clients, faults.py injects faults, simulation.py
runs the loop and checks every invariant after every step, cli.py wires the command.
harness.py is the engine under watch that the simulation, the Hypothesis state machine
(`ninfer.fuzz`) and the tests drive."""

from .simulation import Simulation, SimulationFailed, Summary, run_simulation

__all__ = ["Simulation", "SimulationFailed", "Summary", "run_simulation"]
