"""ONE shared `transitions` machine, built from specs/lifecycle.toml, drives every request.

Requests are not added to the machine (that costs O(live models)); triggers are fired
on them directly: `fire(request, "cancel", salvage=decision)`. Each transition's `emits`
list is turned into events by the emitters below, after the state has changed, from the
request and the trigger's arguments only; guards run before and change nothing.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path

from transitions import Machine, MachineError

from . import events as ev
from .request import Request, salvage_of

SPEC_PATH = Path(__file__).resolve().parents[2] / "specs" / "lifecycle.toml"


class InvalidTrigger(Exception):
    """A trigger fired on a request in a state that does not accept it."""


def load_spec(path: Path = SPEC_PATH) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


# --- emitters: event kind -> the events a transition emits of that kind -------------------

def _queued(r: Request, _e) -> Iterable[tuple[type, dict]]:
    yield ev.RequestQueued, dict(
        tenant=r.tenant, prompt_len=len(r.prompt), block_hashes=r.hashes,
        tokens=r.prompt if r.journal_tokens else None,
        params=r.params.to_dict(content=r.journal_tokens),
        boundaries=r.boundaries, shared_prefix=r.shared_prefix)


def _started(r: Request, _e):
    for fb in r.plan.fallbacks:
        yield ev.PlanFallback, dict(candidate=fb.candidate, position=fb.position, reason=fb.reason)
    yield ev.RequestStarted, dict(
        plan=r.plan.kind, endpoint=r.plan.endpoint.id if r.plan.endpoint else None,
        reuse_base=r.plan.reuse_base, target=r.target, adopted=r.plan.adopted)


def _prefill_completed(r: Request, e):
    yield ev.PrefillCompleted, dict(cursor=r.cursor, first_token=e.kwargs.get("first_token"))


def _detached(r: Request, _e):
    yield ev.PrefillDetached, dict(cursor=r.cursor, goal=r.detached_goal)


def _adopted(r: Request, e):
    yield ev.PrefillAdopted, dict(by=e.kwargs["adopter"].id, cursor=r.cursor)


def _stop_reached(r: Request, _e):
    yield ev.StopReached, dict(reason=r.stop_reason)


def _published(_r: Request, e):
    for endpoint in salvage_of(e).published:
        yield ev.EndpointPublished, dict(endpoint=endpoint)


def _refused(_r: Request, e):
    for refusal in salvage_of(e).refused:
        yield ev.PublicationRefused, dict(checkpoint=refusal.checkpoint,
                                          position=refusal.position, reason=refusal.reason)


def _finished(r: Request, _e):
    yield ev.RequestFinished, dict(prompt_tokens=len(r.prompt), completion_tokens=len(r.outputs),
                                   cached_tokens=r.reuse_base)


def _cancelled(r: Request, e):
    yield ev.RequestCancelled, dict(at_state=e.transition.source,
                                    completion_tokens=len(r.outputs))


def _preempted(r: Request, e):
    yield ev.RequestPreempted, dict(at_state=e.transition.source, frontier=r.cursor)


def _failed(r: Request, e):
    yield ev.RequestFailed, dict(failure=e.kwargs.get("failure", "internal"),
                                 message=e.kwargs.get("message", ""))


EMITTERS: dict[str, Callable] = {
    "RequestQueued": _queued,
    "RequestStarted": _started,
    "PrefillCompleted": _prefill_completed,
    "StopReached": _stop_reached,
    "PrefillDetached": _detached,
    "PrefillAdopted": _adopted,
    "EndpointPublished": _published,
    "PublicationRefused": _refused,
    "RequestFinished": _finished,
    "RequestCancelled": _cancelled,
    "RequestPreempted": _preempted,
    "RequestFailed": _failed,
}


def _emit_all(kinds: list[str]) -> Callable:
    emitters = [EMITTERS[k] for k in kinds]

    def after(event_data) -> None:
        request = event_data.model
        for emitter in emitters:
            for cls, fields in emitter(request, event_data):
                request.emit(cls, **fields)

    return after


def build(spec: dict) -> Machine:
    transitions = []
    for t in spec["transition"]:
        transitions.append({
            "trigger": t["trigger"],
            "source": t["source"],
            "dest": t["dest"],
            "conditions": [t["guard"]] if "guard" in t else [],
            "after": [_emit_all(t["emits"])],
        })
    return Machine(model=None, states=spec["states"], transitions=transitions, initial=None,
                   auto_transitions=False, send_event=True)


SPEC = load_spec()
MACHINE = build(SPEC)
TERMINAL = frozenset(SPEC["terminal"])
LIVE = frozenset(SPEC["live"])
_ADMIT = _emit_all(SPEC["admission"]["emits"])


class _Admission:
    """The event data an admission hands its emitters (it is not a transition)."""

    def __init__(self, request: Request) -> None:
        self.model = request
        self.kwargs: dict = {}


def admit(request: Request) -> None:
    """A valid request enters the lifecycle: Queued, with its RequestQueued event."""
    request.state = SPEC["admission"]["state"]
    _ADMIT(_Admission(request))


def fire(request: Request, trigger: str, **kwargs) -> bool:
    """Fire `trigger` on `request`; True if a transition was taken (a guard may refuse)."""
    try:
        return MACHINE.events[trigger].trigger(request, **kwargs)
    except MachineError as exc:
        raise InvalidTrigger(f"{trigger!r} is not valid for request {request.id} in "
                             f"state {request.state}") from exc
