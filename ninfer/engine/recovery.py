"""Start-up: the store folded from the journal, what a crash left open closed, endpoints
whose tensors did not survive (or fail the new mode) lost, then this server announced.
And rotation: the snapshot a new journal file opens with, which recovery starts from."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lifecycle import events as ev
from ..lifecycle import machine, salvage
from ..lifecycle.store import FOLD_KINDS
from ..model.pools import OutOfMemory

if TYPE_CHECKING:
    from .engine import Engine


def recover(engine: Engine) -> None:
    engine.model.synchronize()  # a (re)starting server has no work in flight
    open_requests = _open_requests(engine)
    for rid, conversation in open_requests.items():
        engine.log.emit(ev.RequestFailed, request=rid, conversation=conversation,
                        failure="interrupted", message="server stopped before it ended")
    for endpoint_id, stored in list(engine.store.endpoints.items()):
        cp = stored.facts.checkpoint
        decision = salvage.materializable(cp, engine.mode)
        reason = None if decision.ok else decision.reason
        if reason is None and cp.id not in engine.held:
            reason = _restore_file(engine, cp)
        if reason:
            engine.log.emit(ev.EndpointLost, endpoint=endpoint_id, reason=reason)
    if engine.files is not None:
        engine.model.synchronize()  # restored parts are written before anything reads them
        engine.files.prune(engine.store.checkpoint_ids())
    config = engine.config
    engine.log.emit(ev.ServerStarted, mode=engine.mode,
                    max_concurrency=config.max_concurrency,
                    max_endpoints=config.max_endpoints,
                    endpoints_per_session=config.endpoints_per_session,
                    options={"prefill_chunk": config.prefill_chunk,
                             "draft_tokens": config.draft_tokens,
                             "block_size": engine.blocks.block_size,
                             "auto_anchors": config.auto_anchors,
                             "max_context": config.max_context,
                             "detach_prefills": config.detach_prefills})
    for tenant, session in engine.store.sessions():  # a restart may have lowered the bound
        engine.exits.evict_within_session(tenant, session)


def _open_requests(engine: Engine) -> dict[str, str | None]:
    """Fold the journal into the store; the requests it left without a terminal event
    (id -> conversation). Their ids stay taken: ids are unique across restarts."""
    open_requests: dict[str, str | None] = {}
    journal = engine.journal
    if journal is None:
        return open_requests
    for event in journal.read(kinds=FOLD_KINDS):  # what recovery needs
        engine.store.apply(event)
        if isinstance(event, ev.StoreSnapshotted):  # a rotated journal's opening
            for rid, r in event.requests.items():
                open_requests[rid] = r["session"]
                engine.reserve_id(rid)
    # then who came and went, without their payloads (a snapshot opens the file)
    for _, rid, conversation, kind in journal.envelopes(("RequestQueued", *ev.TERMINAL_KINDS)):
        if kind == "RequestQueued":
            open_requests[rid] = conversation
            engine.reserve_id(rid)
        else:
            open_requests.pop(rid, None)
    engine.log.seq = journal.last_seq
    return open_requests


def _restore_file(engine: Engine, cp) -> str | None:
    """Bring a checkpoint back from its durable file; the reason it is lost, or None."""
    if engine.files is None:
        return "tensors did not survive the restart"
    from .durable import FileRefused
    try:
        engine.held[cp.id] = engine.files.restore(engine.model, engine.runner, cp)
    except FileRefused as exc:
        return str(exc)
    except OutOfMemory as exc:
        return f"no room to restore it: {exc}"
    return None


def rotate(engine: Engine) -> None:
    """The next file opens with a snapshot of the store and of the open requests, at the
    next seq: replay and check start from it, and seqs stay gap-free."""
    engine.journal = engine.log.journal = engine.journal.rotate()
    open_requests = {
        r.id: {"tenant": r.tenant, "session": r.session, "prompt_len": len(r.prompt),
               "state": r.state, "outputs": len(r.outputs), "frontier": r.cursor,
               "reuse_base": r.reuse_base}
        for r in engine.requests.values() if r.state not in machine.TERMINAL}
    engine.log.emit(ev.StoreSnapshotted, previous=engine.journal.meta["previous"],
                    store=engine.store.snapshot(), requests=open_requests,
                    max_concurrency=engine.config.max_concurrency)
    engine.log.flush()
