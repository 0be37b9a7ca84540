"""The one predicate: may this checkpoint be published, and planned?

`materializable(checkpoint, mode)` is called by the lifecycle's guarded finish / cancel /
preempt transitions before any event is emitted, by the store's fold on every
`EndpointPublished`, by the planner on every candidate, and by recovery. Call it through
this module (`salvage.materializable`) so that one definition governs all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .facts import CheckpointFacts, EndpointFacts, Mode


@dataclass(frozen=True, slots=True)
class Ok:
    ok = True


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str
    ok = False


OK = Ok()
Decision = Ok | Refused


def materializable(cp: CheckpointFacts, mode: Mode) -> Decision:
    """Ok when every state part `mode` needs exists, is complete and exactly at P."""
    p = cp.position
    if p <= 0:
        return Refused("nothing committed")
    if cp.model != mode.model:
        return Refused(f"model identity {cp.model!r} is not the server's {mode.model!r}")
    if cp.dtypes != mode.dtypes:
        return Refused(f"dtypes {cp.dtypes!r} are not the server's {mode.dtypes!r}")
    if not cp.fenced:
        return Refused("device work that wrote the parts has not completed")
    if cp.attn_kv != p:
        return Refused(f"attention KV covers [0,{cp.attn_kv}), needs [0,{p})")
    if cp.recurrent_at != p:
        return Refused(f"recurrent state is at {cp.recurrent_at}, needs exactly {p}")
    if mode.spec == "mtp":
        if cp.mtp_kv < p - 1:
            return Refused(f"MTP KV covers [0,{cp.mtp_kv}), needs [0,{p - 1})")
        if cp.hidden_at != p - 1:
            return Refused(f"last hidden state is at {cp.hidden_at}, needs {p - 1}")
    return OK


# --- salvage: what a finishing, cancelled or preempted request leaves behind ---------------

_KIND_OF_ROLE = {"frontier": "private", "anchor": "anchor", "shared": "shared",
                 "fallback": "private"}


@dataclass(frozen=True, slots=True)
class Candidate:
    """A checkpoint a request offers for publication.

    frontier: the committed state at the request's frontier (the conversation's latest
    point); anchor / shared: captured at a message boundary / the end of the shared prefix;
    fallback: the newest earlier capture, published as the latest point only when the
    frontier is refused.
    """

    role: str
    checkpoint: CheckpointFacts


@dataclass(frozen=True, slots=True)
class Refusal:
    checkpoint: str | None
    position: int
    reason: str


@dataclass(frozen=True, slots=True)
class Salvage:
    frontier_ok: bool
    published: tuple[EndpointFacts, ...]
    refused: tuple[Refusal, ...]


def decide(candidates: list[Candidate], mode: Mode, tenant: str, session: str | None) -> Salvage:
    """Judge every candidate with the predicate. The first candidate must be the frontier
    (or absent when nothing is committed, which refuses)."""
    published: list[EndpointFacts] = []
    refused: list[Refusal] = []
    frontier = candidates[0] if candidates and candidates[0].role == "frontier" else None
    frontier_ok = False
    if frontier is None:
        refused.append(Refusal(None, 0, "nothing committed"))
    for cand in candidates:
        if cand.role == "fallback" and frontier_ok:
            continue
        decision = materializable(cand.checkpoint, mode)
        if cand.role == "frontier":
            frontier_ok = decision.ok
        if not decision.ok:
            refused.append(Refusal(cand.checkpoint.id, cand.checkpoint.position, decision.reason))
            continue
        kind = _KIND_OF_ROLE[cand.role]
        if kind != "shared" and session is None:
            refused.append(Refusal(cand.checkpoint.id, cand.checkpoint.position,
                                   "no session key to publish a private endpoint under"))
            continue
        if cand.role == "fallback":
            if any(p.kind == "private" for p in published):
                continue  # only one latest point per salvage
        published.append(EndpointFacts(
            id=f"ep:{cand.checkpoint.id}",
            kind=kind,
            tenant=tenant,
            session=None if kind == "shared" else session,
            checkpoint=cand.checkpoint,
        ))
    return Salvage(frontier_ok, tuple(published), tuple(refused))
