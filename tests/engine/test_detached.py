"""A cut prefill keeps its work: the client is told at once (PrefillDetached), the prefill
goes on while no request waits, a retry that extends it adopts it in place, anyone else
who needs the lane ends it (publishing its frontier). Every run is checked by the
Harness: journal invariants, store replay, outputs equal to a Root run."""

import pytest

from ninfer.engine.engine import EngineConfig
from ninfer.lifecycle import adoption
from ninfer.lifecycle.store import InvariantViolation
from ninfer.sim.harness import Harness

PROMPT = tuple((i * 31 + 7) % 97 for i in range(1, 60))
OTHER = tuple((i * 17 + 3) % 97 for i in range(1, 40))


def _harness(spec="none", lanes=2, **kw):
    return Harness(EngineConfig(spec=spec, prefill_chunk=8, draft_tokens=3, check_reuse=True,
                                max_concurrency=lanes, detach_prefills=True, **kw))


def _events(h, kind, request=None):
    return [e for e in h.journal.read() if e.kind == kind and request in (None, e.request)]


def _cut_mid_prefill(h, prompt=PROMPT, tenant="t", session="s", at=16):
    rid = h.submit(prompt, session, tenant, max_tokens=6)
    h.step()
    while not (h.request(rid).state == "Prefilling" and h.request(rid).cursor >= at):
        h.step()
    h.engine.cancel(rid)
    h.step()
    h.check()
    return rid


def _prefilled_positions(h, rid):
    """Prompt positions this request computed itself, from its journal events."""
    started = _events(h, "RequestStarted", rid)[0]
    cursors = [e.cursor for e in _events(h, "PrefillAdvanced", rid)]
    return (cursors[-1] if cursors else started.reuse_base) - started.reuse_base


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_a_cut_prefill_is_told_at_once_goes_on_and_publishes_at_its_goal(spec):
    h = _harness(spec)
    cut = _cut_mid_prefill(h)
    detached = _events(h, "PrefillDetached", cut)
    assert len(detached) == 1 and detached[0].goal == len(PROMPT) - 1
    assert h.request(cut).state == "Detached" and not _events(h, "RequestCancelled", cut)
    h.run()
    h.check()
    cancelled = _events(h, "RequestCancelled", cut)
    assert [c.at_state for c in cancelled] == ["Detached"]
    assert h.request(cut).cursor == len(PROMPT) - 1
    assert not _events(h, "TokensCommitted", cut)      # a cut request decodes nothing
    published = _events(h, "EndpointPublished", cut)
    assert published[0].endpoint.checkpoint.position == len(PROMPT) - 1
    retry = h.submit(PROMPT, "s", max_tokens=6)        # the same prompt again: one token left
    h.run()
    h.check()
    started = _events(h, "RequestStarted", retry)[0]
    assert (started.plan, started.reuse_base) == ("PrivateEndpoint", len(PROMPT) - 1)
    assert list(h.outputs(retry)) == h.engine.model.reference_generate(PROMPT, 6)


@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_a_retry_adopts_the_detached_prefill_in_place(spec, lanes):
    h = _harness(spec, lanes=lanes)
    cut = _cut_mid_prefill(h)
    at = h.request(cut).cursor
    retry = h.submit(PROMPT + (5, 6), "s", max_tokens=6)   # it extends the cut prompt
    h.step()
    adopted = _events(h, "PrefillAdopted", cut)
    assert [(a.by, a.cursor) for a in adopted] == [(retry, at)]
    assert [c.at_state for c in _events(h, "RequestCancelled", cut)] == ["Detached"]
    started = _events(h, "RequestStarted", retry)[0]
    assert (started.plan, started.adopted, started.reuse_base) == ("Adopted", cut, at)
    h.run()
    h.check()
    assert list(h.outputs(retry)) == h.engine.model.reference_generate(PROMPT + (5, 6), 6)
    # no prompt position computed twice: the cut request's and the retry's add up to one
    computed = _prefilled_positions(h, cut) + _prefilled_positions(h, retry)
    assert computed == len(PROMPT) + 2
    finished = _events(h, "RequestFinished", retry)[0]
    assert finished.cached_tokens == at


def test_another_tenant_never_adopts_and_a_waiting_request_ends_the_detached_prefill():
    h = _harness(lanes=1)
    cut = _cut_mid_prefill(h, tenant="a")
    other = h.submit(PROMPT, "s", "b", max_tokens=4)   # the same prompt, another tenant
    h.step()
    assert not _events(h, "PrefillAdopted")
    cancelled = _events(h, "RequestCancelled", cut)
    assert [c.at_state for c in cancelled] == ["Detached"]   # ended: the lane was needed
    assert _events(h, "EndpointPublished", cut)             # its frontier, salvaged
    h.run()
    h.check()
    started = _events(h, "RequestStarted", other)[0]
    assert started.plan == "Root"
    assert list(h.outputs(other)) == h.engine.model.reference_generate(PROMPT, 4)


def test_a_prompt_that_does_not_extend_is_not_adopted():
    h = _harness(lanes=2)
    _cut_mid_prefill(h)
    diverging = PROMPT[:30] + (1, 2, 3)
    rid = h.submit(diverging, "s", max_tokens=4)
    h.run()
    h.check()
    assert not _events(h, "PrefillAdopted")
    assert _events(h, "RequestStarted", rid)[0].plan != "Adopted"
    assert list(h.outputs(rid)) == h.engine.model.reference_generate(diverging, 4)


def test_a_cut_after_the_prefill_or_with_detaching_off_is_a_plain_cancel():
    h = Harness(EngineConfig(prefill_chunk=8, check_reuse=True))   # detach_prefills off
    cut = _cut_mid_prefill(h)
    assert not _events(h, "PrefillDetached")
    assert [c.at_state for c in _events(h, "RequestCancelled", cut)] == ["Prefilling"]
    h = _harness()
    rid = h.submit(PROMPT, "s", max_tokens=30)
    h.step()
    while h.request(rid).state != "Active":
        h.step()
    h.engine.cancel(rid)
    h.step()
    assert [c.at_state for c in _events(h, "RequestCancelled", rid)] == ["Active"]
    assert not _events(h, "PrefillDetached")


@pytest.mark.parametrize("weakened", ["tenant", "extension"])
def test_a_weakened_adoption_rule_is_caught(monkeypatch, weakened):
    """Adopting across tenants is caught by journal check (invariant 8); adopting a prompt
    that does not extend gives outputs that differ from a Root run."""
    real = adoption.refusal

    def lax(detached, adopter):
        reason = real(detached, adopter)
        if reason is not None and weakened == "tenant" and "tenant" in reason:
            return None
        if reason is not None and weakened == "extension" and "extend" in reason:
            return None
        return reason

    monkeypatch.setattr(adoption, "refusal", lax)
    h = _harness(lanes=1)
    _cut_mid_prefill(h, tenant="a")
    if weakened == "tenant":
        h.submit(PROMPT, "s", "b", max_tokens=4)
    else:
        h.submit(OTHER + PROMPT, "s", "a", max_tokens=4)
    with pytest.raises((AssertionError, InvariantViolation)) as found:
        h.run()
        h.check()
    assert ("invariant 8" in str(found.value)) == (weakened == "tenant")
