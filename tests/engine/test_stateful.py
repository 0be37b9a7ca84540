"""Layer 2 of DESIGN.md's verification: the engine with SimModel under Hypothesis."""

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from ninfer.model.sim_model import SimModel
from ninfer.testing.stateful import LifecycleMachine

LifecycleMachine.TestCase.settings = settings(settings.default, stateful_step_count=40)
TestLifecycle = LifecycleMachine.TestCase


class WrongDraftsAheadSim(SimModel):
    """A model that runs greedy steps ahead (as the decode graphs do) and whose MTP head
    drafts the token after the right one: under --spec mtp drafting pauses, and the
    paused rounds run the next step ahead (their blocks reserved a step early)."""

    runs_ahead = True

    def mtp(self, lane, position, hidden, next_token):
        out = super().mtp(lane, position, hidden, next_token)
        return out._replace(token=(out.token + 1) % self.vocab_size)


class AheadLifecycle(LifecycleMachine):
    model_factory = staticmethod(lambda nb, bs, ns: WrongDraftsAheadSim(
        num_blocks=nb, block_size=bs, num_slots=ns, seed=0))


def test_the_lifecycle_machine_with_paused_drafts_running_ahead():
    run_state_machine_as_test(AheadLifecycle, settings=settings(
        max_examples=100, stateful_step_count=40, deadline=None, derandomize=True,
        database=None))
