"""The lifecycle machine is the table in specs/lifecycle.toml, and only that."""

import pytest

from ninfer.lifecycle import machine
from ninfer.lifecycle.eventlog import EventLog
from ninfer.lifecycle.events import ServerStarted
from ninfer.lifecycle.machine import MACHINE, SPEC, InvalidTrigger, admit, fire
from ninfer.lifecycle.planner import Plan
from ninfer.lifecycle.request import Request
from ninfer.lifecycle.salvage import Candidate, decide
from ninfer.lifecycle.store import ContinuationStore

from .factories import MTP, checkpoint

PROMPT = tuple(range(12))


def _request(rid="r1", session="s"):
    log = EventLog(ContinuationStore())
    log.emit(ServerStarted, mode=MTP, max_concurrency=2, max_endpoints=8)
    return Request(id=rid, prompt=PROMPT, session=session, tenant="t", log=log, mode=MTP)


def _kinds(request, since):
    return [e.kind for e in request.log.pending[since:]]


def _drive(request, path):
    admit(request)
    for trigger in path:
        if trigger == "start":
            request.plan = Plan("Root", None, 0)
        if trigger == "prefilled":
            request.cursor = request.target
        if trigger == "stop":
            request.stop_reason = "max_tokens"
        assert fire(request, trigger)


def _transitions(trigger, source):
    return [t for t in SPEC["transition"] if t["trigger"] == trigger and source in t["source"]]


def test_the_machine_is_built_from_the_table():
    built = {(t.source, t.dest, name) for name, event in MACHINE.events.items()
             for source_transitions in event.transitions.values() for t in source_transitions}
    table = {(s, t["dest"], t["trigger"]) for t in SPEC["transition"] for s in t["source"]}
    assert built == table
    assert set(MACHINE.states) == set(SPEC["states"])
    assert not MACHINE.models, "requests are driven, not added (one shared machine)"


@pytest.mark.parametrize("frontier_ok", [True, False])
@pytest.mark.parametrize("trigger,path", [
    ("finish", ["start", "prefilled", "stop"]),
    ("cancel", ["start"]),
    ("cancel", ["start", "prefilled"]),
    ("cancel", ["start", "prefilled", "stop"]),
    ("preempt", ["start"]),
    ("preempt", ["start", "prefilled"]),
])
def test_salvaging_triggers_take_the_guarded_pair_and_emit_the_listed_kinds(
        trigger, path, frontier_ok):
    r = _request()
    _drive(r, path)
    source = r.state
    frontier = checkpoint(PROMPT, cp_id="f", mtp_kv=None if frontier_ok else 3)
    anchor = checkpoint(PROMPT[:5], cp_id="a")
    decision = decide([Candidate("frontier", frontier), Candidate("anchor", anchor)],
                      r.mode, r.tenant, r.session)
    before = len(r.log.pending)
    assert fire(r, trigger, salvage=decision)
    publish, refuse = _transitions(trigger, source)
    expected = publish if frontier_ok else refuse
    assert r.state == expected["dest"]
    emitted = _kinds(r, before)
    # each listed kind appears in order; salvage kinds once per decision
    collapsed = [k for i, k in enumerate(emitted) if i == 0 or emitted[i - 1] != k]
    assert [k for k in collapsed] == [k for k in expected["emits"] if k in emitted]
    assert emitted.count("EndpointPublished") == (2 if frontier_ok else 1)
    assert r.log.store.endpoints, "what was published is in the store"


def test_guards_refuse_without_emitting():
    r = _request()
    admit(r)
    before = len(r.log.pending)
    assert not fire(r, "start")            # no plan yet
    assert r.state == "Queued" and len(r.log.pending) == before
    r.plan = Plan("Root", None, 0)
    assert fire(r, "start")
    assert not fire(r, "prefilled")        # cursor short of the prompt
    assert r.state == "Prefilling"


@pytest.mark.parametrize("terminal", sorted(machine.TERMINAL))
def test_terminal_states_accept_no_trigger(terminal):
    r = _request()
    r.state = terminal
    for trigger in MACHINE.events:
        with pytest.raises(InvalidTrigger):
            fire(r, trigger)


def test_one_machine_drives_many_requests_independently():
    a, b = _request("a"), _request("b")
    _drive(a, ["start", "prefilled"])
    admit(b)
    fire(b, "cancel")
    assert (a.state, b.state) == ("Active", "Cancelled")


def test_fail_publishes_nothing():
    r = _request()
    _drive(r, ["start", "prefilled"])
    before = len(r.log.pending)
    fire(r, "fail", failure="capacity", message="pool too small")
    assert _kinds(r, before) == ["RequestFailed"] and not r.log.store.endpoints


@pytest.mark.parametrize("trigger", ["finish", "cancel", "preempt"])
def test_a_salvaging_trigger_needs_its_decision(trigger):
    """The decision is the trigger's argument; without it the guard refuses to guess."""
    r = _request()
    _drive(r, ["start", "prefilled"] + (["stop"] if trigger == "finish" else []))
    state, before = r.state, len(r.log.pending)
    with pytest.raises(TypeError, match="salvage"):
        fire(r, trigger)
    assert r.state == state and len(r.log.pending) == before


def test_guards_are_pure_questions():
    """Evaluating a guard, any number of times, changes nothing: the request's fields, the
    decision passed in, and the log are as they were."""
    import copy
    from types import SimpleNamespace

    r = _request()
    _drive(r, ["start", "prefilled", "stop"])
    decision = decide([Candidate("frontier", checkpoint(PROMPT, cp_id="f"))], r.mode,
                      r.tenant, r.session)
    fields = {k: copy.copy(v) for k, v in vars(r).items() if k != "log"}
    pending = len(r.log.pending)
    event = SimpleNamespace(kwargs={"salvage": decision, "adopter": _request("r2")},
                            event=SimpleNamespace(name="finish"))
    for guard in {t["guard"] for t in SPEC["transition"] if "guard" in t}:
        for _ in range(3):
            getattr(r, guard)(event)
    assert {k: v for k, v in vars(r).items() if k != "log"} == fields
    assert len(r.log.pending) == pending and event.kwargs["salvage"] is decision


def test_only_a_fresh_prefill_detaches():
    """A request resumed after preemption has decoded tokens its client saw: a cut there is
    a plain cancel (the detach guard refuses), and so is one with no prompt left."""
    r = _request()
    _drive(r, ["start"])
    r.outputs.append(7)                    # as a preempted, resumed request has
    before = len(r.log.pending)
    assert not fire(r, "detach")
    assert r.state == "Prefilling" and len(r.log.pending) == before
    r.outputs.clear()
    r.cursor = r.detached_goal             # nothing left to prefill before the goal
    assert not fire(r, "detach")
    r.cursor = 3
    assert fire(r, "detach") and r.state == "Detached"
    assert _kinds(r, before) == ["PrefillDetached"]
