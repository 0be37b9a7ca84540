import pytest

from ninfer.lifecycle import events as ev
from ninfer.lifecycle.facts import Mode
from ninfer.lifecycle.store import ContinuationStore, InvariantViolation

from .factories import MODEL, MTP, NONE, Feed, endpoint

A = tuple(range(20))


def test_private_endpoints_of_one_key_are_kept_side_by_side_until_evicted():
    f = Feed()
    f.publish(endpoint(A[:10], ep_id="e1"))
    f.publish(endpoint(A[:15], ep_id="e2"))
    assert [e.id for e in f.store.candidates("t", "s")] == ["e2", "e1"]
    f.apply(ev.EndpointEvicted(endpoint="e1", reason="superseded"))
    assert [s.facts.id for s in f.store.private("t", "s")] == ["e2"]


def test_in_a_journal_from_before_several_per_key_the_new_private_endpoint_replaces():
    f = Feed(endpoints_per_session=0)
    f.publish(endpoint(A[:10], ep_id="e1"))
    f.publish(endpoint(A[:15], ep_id="e2"))
    assert [e.id for e in f.store.candidates("t", "s")] == ["e2"]
    assert set(f.store.endpoints) == {"e2"}


def test_anchors_and_shared_prefixes_are_kept_beside_the_latest_point():
    f = Feed()
    f.publish(endpoint(A[:5], kind="shared", ep_id="sh"))
    f.publish(endpoint(A[:8], kind="anchor", ep_id="an"))
    f.publish(endpoint(A[:12], ep_id="la"))
    assert [e.id for e in f.store.candidates("t", "s")] == ["la", "an", "sh"]
    assert [e.id for e in f.store.candidates("t", "other")] == ["sh"]


def test_tenants_never_see_each_other():
    f = Feed()
    f.publish(endpoint(A[:5], kind="shared", tenant="alice", ep_id="sh"))
    f.publish(endpoint(A[:9], tenant="alice", ep_id="la"))
    assert f.store.candidates("bob", "s") == []
    assert [e.id for e in f.store.candidates("alice", "s")] == ["la", "sh"]


def test_publishing_facts_that_fail_the_predicate_is_a_violation_not_a_drop():
    f = Feed(mode=MTP)
    with pytest.raises(InvariantViolation) as err:
        f.publish(endpoint(A[:10], mtp_kv=3))
    assert err.value.invariant == 1 and "MTP KV" in str(err.value)
    assert err.value.seq == 2


def test_evicting_an_unknown_endpoint_is_a_violation():
    f = Feed()
    with pytest.raises(InvariantViolation):
        f.apply(ev.EndpointEvicted(endpoint="nope", reason="memory"))


def test_seq_must_increase():
    store = ContinuationStore()
    store.apply(ev.ServerStarted(seq=5, mode=NONE, max_concurrency=1, max_endpoints=1))
    with pytest.raises(InvariantViolation):
        store.apply(ev.ServerStarted(seq=5, mode=NONE, max_concurrency=1, max_endpoints=1))


def test_over_capacity_names_least_recently_used_first():
    f = Feed(max_endpoints=2)
    f.publish(endpoint(A[:5], session="s1", ep_id="e1"))
    f.publish(endpoint(A[:6], session="s2", ep_id="e2"))
    f.publish(endpoint(A[:7], session="s3", ep_id="e3"))
    f.apply(ev.RequestStarted(request="r", plan="PrivateEndpoint", endpoint="e1",
                              reuse_base=5, target=9))
    assert f.store.over_capacity() == ["e2"]


def test_a_restart_into_a_mode_an_endpoint_fails_must_drop_it_first():
    f = Feed(mode=NONE)
    f.publish(endpoint(A[:10], hidden_at=None, ep_id="e"))
    with pytest.raises(InvariantViolation):
        f.apply(ev.ServerStarted(mode=Mode("mtp", MODEL, "sim-int64"), max_concurrency=1,
                                 max_endpoints=4))
    g = Feed(mode=NONE)
    g.publish(endpoint(A[:10], hidden_at=None, ep_id="e"))
    g.apply(ev.EndpointLost(endpoint="e", reason="MTP parts missing"))
    g.apply(ev.ServerStarted(mode=MTP, max_concurrency=1, max_endpoints=4))
    assert not g.store.endpoints


def test_replay_equals_the_live_fold():
    f = Feed()
    log = [f.publish(endpoint(A[:5], kind="shared", ep_id="sh")),
           f.publish(endpoint(A[:9], ep_id="la")),
           f.apply(ev.EndpointEvicted(endpoint="sh", reason="capacity"))]
    replayed = ContinuationStore.replay([ev.ServerStarted(seq=1, mode=MTP, max_concurrency=2,
                                                          max_endpoints=16,
                                                          endpoints_per_session=4), *log])
    assert replayed == f.store
    replayed.apply(ev.EndpointEvicted(seq=99, endpoint="la", reason="x"))
    assert replayed != f.store
