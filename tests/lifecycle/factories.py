"""Small builders for facts and stores used across the lifecycle tests."""

from ninfer.lifecycle import events as ev
from ninfer.lifecycle.facts import CheckpointFacts, EndpointFacts, Mode
from ninfer.lifecycle.hashing import block_hashes, prefix_hash
from ninfer.lifecycle.store import ContinuationStore

MODEL, DTYPES = "sim-test", "sim-int64"
NONE, MTP = Mode("none", MODEL, DTYPES), Mode("mtp", MODEL, DTYPES)


def checkpoint(tokens, *, cp_id="cp", mtp_kv=None, hidden_at="auto", fenced=True,
               attn_kv=None, recurrent_at=None, model=MODEL, dtypes=DTYPES, content=True):
    tokens = tuple(tokens)
    p = len(tokens)
    hashes = block_hashes(tokens)
    return CheckpointFacts(
        id=cp_id, position=p, block_hashes=hashes, prefix_hash=prefix_hash(tokens, p, hashes),
        attn_kv=p if attn_kv is None else attn_kv,
        recurrent_at=p if recurrent_at is None else recurrent_at,
        mtp_kv=p - 1 if mtp_kv is None else mtp_kv,
        hidden_at=p - 1 if hidden_at == "auto" else hidden_at, fenced=fenced, model=model,
        dtypes=dtypes, tokens=tokens if content else None)


def endpoint(tokens, *, kind="private", tenant="t", session="s", ep_id=None, **kw):
    cp = checkpoint(tokens, cp_id=f"cp-{ep_id or kind}-{len(tuple(tokens))}", **kw)
    return EndpointFacts(id=ep_id or f"ep:{cp.id}", kind=kind, tenant=tenant,
                         session=None if kind == "shared" else session, checkpoint=cp)


class Feed:
    """A store fed with consecutive seqs."""

    def __init__(self, mode=MTP, max_endpoints=16, endpoints_per_session=4):
        """`endpoints_per_session` 0: a journal from before a key held several."""
        self.store = ContinuationStore()
        self.seq = 0
        self.apply(ev.ServerStarted(mode=mode, max_concurrency=2, max_endpoints=max_endpoints,
                                    endpoints_per_session=endpoints_per_session))

    def apply(self, event):
        self.seq += 1
        event = ev.with_envelope(event, self.seq, float(self.seq))
        self.store.apply(event)
        return event

    def publish(self, facts):
        return self.apply(ev.EndpointPublished(request="r", endpoint=facts))
