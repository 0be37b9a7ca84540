"""The stateful machine must notice a weakened predicate, within CI's budget.

Two weakenings of the server's `salvage.materializable` (accept everything; drop the MTP
clause), each run twice: with the spec-predicate oracle on every stored endpoint, and
without it, where only behaviour can give the bug away (a restored part that differs from
a recomputation, a request that fails to materialize its plan)."""

from dataclasses import replace

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from ninfer.engine.runner import ReuseMismatch
from ninfer.fuzz.stateful import LifecycleMachine
from ninfer.lifecycle import adoption, salvage
from ninfer.lifecycle.store import InvariantViolation

REAL = salvage.materializable
REAL_ADOPTION = adoption.refusal


def accept_everything(cp, mode):
    return salvage.OK


def without_mtp_clause(cp, mode):
    return REAL(cp, replace(mode, spec="none") if mode.spec == "mtp" else mode)


class Blind(LifecycleMachine):
    oracle = False


@pytest.mark.parametrize("machine", [LifecycleMachine, Blind], ids=["oracle", "behaviour"])
@pytest.mark.parametrize("weakened", [accept_everything, without_mtp_clause],
                         ids=lambda f: f.__name__)
def test_a_weakened_predicate_is_found(monkeypatch, weakened, machine):
    monkeypatch.setattr(salvage, "materializable", weakened)
    budget = settings(max_examples=300, stateful_step_count=40, deadline=None,
                      derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate])  # finding is enough
    with pytest.raises((AssertionError, InvariantViolation, ReuseMismatch)) as found:
        run_state_machine_as_test(machine, settings=budget)
    if machine is LifecycleMachine:
        assert "in the store" in str(found.value)
    else:
        assert isinstance(found.value, (ReuseMismatch, InvariantViolation))


def across_tenants(detached, adopter):
    reason = REAL_ADOPTION(detached, adopter)
    return None if reason is not None and "tenant" in reason else reason


def without_extension(detached, adopter):
    reason = REAL_ADOPTION(detached, adopter)
    return None if reason is not None and "extend" in reason else reason


@pytest.mark.parametrize("weakened", [across_tenants, without_extension],
                         ids=lambda f: f.__name__)
def test_a_weakened_adoption_rule_is_found(monkeypatch, weakened):
    """Adopting another tenant's detached prefill, or one the prompt does not extend: the
    machine finds it (journal check's invariant 8, outputs or restored parts that differ
    from a recomputation, or work that never ends; the real rule passes test_stateful).
    test_detached.py pins which check finds each on a chosen case."""
    monkeypatch.setattr(adoption, "refusal", weakened)
    budget = settings(max_examples=300, stateful_step_count=40, deadline=None,
                      derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate])
    with pytest.raises((AssertionError, InvariantViolation, ReuseMismatch)):
        run_state_machine_as_test(LifecycleMachine, settings=budget)
