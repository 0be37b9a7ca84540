"""Layer 2 of DESIGN.md's verification: the engine with SimModel under Hypothesis."""

from hypothesis import settings

from ninfer.testing.stateful import LifecycleMachine

LifecycleMachine.TestCase.settings = settings(settings.default, stateful_step_count=40)
TestLifecycle = LifecycleMachine.TestCase
