"""The second verification layer (specs/invariants.md): the engine with SimModel under
Hypothesis."""

from collections import Counter

from hypothesis import settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from ninfer.fuzz.stateful import LifecycleMachine
from ninfer.model.sim_model import SimModel

LifecycleMachine.TestCase.settings = settings(settings.default, stateful_step_count=40)
TestLifecycle = LifecycleMachine.TestCase


class WrongDraftsAheadSim(SimModel):
    """A model that runs greedy steps ahead (as the decode graphs do) and whose MTP head
    drafts the token after the right one: under --spec mtp drafting pauses, and the
    paused rounds run the next step ahead (their blocks reserved a step early)."""

    def __init__(self, **kw) -> None:
        super().__init__(runs_ahead=True, **kw)

    def mtp(self, lane, position, hidden, next_token):
        out = super().mtp(lane, position, hidden, next_token)
        return out._replace(token=(out.token + 1) % self.vocab_size)


AHEAD_MODELS: list[WrongDraftsAheadSim] = []


def _ahead_model(nb, bs, ns):
    model = WrongDraftsAheadSim(num_blocks=nb, block_size=bs, num_slots=ns, seed=0)
    AHEAD_MODELS.append(model)
    return model


class AheadLifecycle(LifecycleMachine):
    model_factory = staticmethod(_ahead_model)


def test_the_lifecycle_machine_with_paused_drafts_running_ahead():
    AHEAD_MODELS.clear()
    run_state_machine_as_test(AheadLifecycle, settings=settings(
        max_examples=100, stateful_step_count=40, deadline=None, derandomize=True,
        database=None))
    # steps were really run ahead and handed over (each checked against a Root run), and
    # some dropped (a cancel, a preemption, a restart, a probe between two plain rounds)
    assert sum(m.adopted for m in AHEAD_MODELS) > 0
    assert sum(m.dropped for m in AHEAD_MODELS) > 0


FED = Counter()  # lanes fed by verify forwards (per position), and calls with several lanes


class CountingSim(SimModel):
    def forward_batch(self, items, per_position=True, ahead=False, outputs=True):
        if per_position:
            FED["lanes"] += len(items)
            FED["batched"] += len(items) > 1
        return super().forward_batch(items, per_position, ahead, outputs)


class BatchedLifecycle(LifecycleMachine):
    model_factory = staticmethod(lambda nb, bs, ns: CountingSim(
        num_blocks=nb, block_size=bs, num_slots=ns, seed=0))

    def __init__(self) -> None:
        super().__init__()
        self.fed_before = FED["lanes"]

    @invariant()
    def decoded_tokens_came_from_the_batched_forward(self):
        """Every token after a request's first comes from a verify round, which feeds its
        lane through the model's batched forward (a round commits at most its drafts and
        one token more)."""
        if self.h is None:
            return
        decoded = sum(max(len(r.outputs) - 1, 0) for r in self.h.engine.requests.values())
        per_round = self.h.engine.config.draft_tokens + 1
        assert decoded <= per_round * (FED["lanes"] - self.fed_before)


def test_the_lifecycle_machine_decodes_through_the_batched_forward():
    FED.clear()
    run_state_machine_as_test(BatchedLifecycle, settings=settings(
        max_examples=30, stateful_step_count=30, deadline=None, derandomize=True,
        database=None))
    assert FED["lanes"] > 0 and FED["batched"] > 0
