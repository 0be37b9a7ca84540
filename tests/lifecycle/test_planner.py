from ninfer.lifecycle.hashing import block_hashes
from ninfer.lifecycle.planner import plan

from .factories import MTP, NONE, Feed, endpoint

A = tuple(range(1, 41))


def _plan(store, tokens, mode=MTP, tenant="t", session="s", usable=None):
    return plan(tokens, block_hashes(tokens), tenant, session, store, mode, usable)


def test_root_always_exists():
    p = _plan(Feed().store, A)
    assert (p.kind, p.reuse_base, p.endpoint) == ("Root", 0, None)


def test_longest_matching_candidate_wins():
    f = Feed()
    f.publish(endpoint(A[:8], kind="shared", ep_id="sh"))
    f.publish(endpoint(A[:20], kind="anchor", ep_id="an"))
    f.publish(endpoint(A[:30], ep_id="la"))
    assert (_plan(f.store, A).kind, _plan(f.store, A).reuse_base) == ("PrivateEndpoint", 30)
    rewritten = A[:25] + (99, 98)
    assert (_plan(f.store, rewritten).kind, _plan(f.store, rewritten).reuse_base) == (
        "PrivateAnchor", 20)
    other = A[:10] + (7,)
    assert (_plan(f.store, other).kind, _plan(f.store, other).reuse_base) == ("SharedPrefix", 8)


def test_matching_works_on_hashes_when_token_ids_are_not_journaled():
    f = Feed()
    f.publish(endpoint(A[:21], ep_id="la", content=False))
    assert _plan(f.store, A).reuse_base == 21
    assert _plan(f.store, A[:20] + (0,) + A[21:]).kind == "Root"


def test_another_tenant_gets_root():
    f = Feed()
    f.publish(endpoint(A[:30], tenant="alice", ep_id="la"))
    assert _plan(f.store, A, tenant="bob").kind == "Root"


def test_a_candidate_covering_the_whole_prompt_falls_back():
    f = Feed()
    f.publish(endpoint(A[:10], kind="anchor", ep_id="an"))
    f.publish(endpoint(A, ep_id="la"))
    p = _plan(f.store, A)
    assert (p.kind, p.reuse_base) == ("PrivateAnchor", 10)
    assert [fb.candidate for fb in p.fallbacks] == ["la"]
    assert p.reuse_base < len(A)


def test_a_candidate_the_predicate_refuses_is_a_fallback():
    f = Feed(mode=NONE)
    f.publish(endpoint(A[:30], ep_id="la", mtp_kv=0, hidden_at=None))
    p = _plan(f.store, A, mode=MTP)
    assert p.kind == "Root" and "MTP KV" in p.fallbacks[0].reason


def test_the_planner_never_raises():
    f = Feed()
    f.publish(endpoint(A[:30], ep_id="la"))

    def broken(_endpoint):
        raise RuntimeError("tensor registry exploded")

    p = _plan(f.store, A, usable=broken)
    assert p.kind == "Root" and "exploded" in p.fallbacks[0].reason
    p = _plan(f.store, A, usable=lambda e: "tensors not held")
    assert p.kind == "Root" and p.fallbacks[0].reason == "tensors not held"
