"""Several private endpoints per session key (lifecycle/conversation.py): branches kept side
by side and planned from, longest first; a branch moving forward supersedes only its own
predecessor; past the key's bound the least recently used goes; the fold stays a pure
function of the events; journal check verifies every such eviction."""

import pytest

from ninfer.lifecycle import events as ev
from ninfer.lifecycle.checks import JournalChecker
from ninfer.lifecycle.conversation import (
    SESSION_BOUND,
    SUPERSEDED,
    Eviction,
    evictions,
    may_extend,
)
from ninfer.lifecycle.hashing import block_hashes
from ninfer.lifecycle.planner import plan
from ninfer.lifecycle.store import ContinuationStore, InvariantViolation

from .factories import MTP, Feed, endpoint

A = tuple(range(1, 41))
X = A[:20] + (90, 91, 92, 93)          # two branches of one conversation: they share the
Y = A[:20] + (80, 81, 82, 83, 84)      # first 20 tokens (instructions, first message)


def exact(newer, older) -> bool:
    return newer.checkpoint.tokens[:older.position] == older.checkpoint.tokens


def _plan(store, tokens, session="s"):
    return plan(tokens, block_hashes(tokens), "t", session, store, MTP)


def _ids(store, session="s"):
    return [p.facts.id for p in store.private("t", session)]


def test_two_branches_under_one_key_are_both_kept_and_both_planned_from():
    f = Feed()
    f.publish(endpoint(X, ep_id="x"))
    f.publish(endpoint(Y, ep_id="y"))
    assert evictions(f.store.private("t", "s"), 4, exact) == []
    assert _ids(f.store) == ["x", "y"]
    px, py = _plan(f.store, X + (5, 6)), _plan(f.store, Y + (7,))
    assert (px.kind, px.endpoint.id, px.reuse_base) == ("PrivateEndpoint", "x", len(X))
    assert (py.kind, py.endpoint.id, py.reuse_base) == ("PrivateEndpoint", "y", len(Y))
    assert _plan(f.store, A[:20] + (1, 2, 3)).kind == "Root"  # neither is its prefix
    assert _plan(f.store, X + (5,), session="other").kind == "Root"


def test_the_longest_matching_branch_is_planned_first():
    """A shorter point of the same branch published later (a cut retry) is kept beside the
    longer one: each request gets the longest one its tokens start with."""
    f = Feed()
    f.publish(endpoint(A[:30], ep_id="long"))
    f.publish(endpoint(A[:12], ep_id="short"))
    assert evictions(f.store.private("t", "s"), 4, exact) == []
    assert _plan(f.store, A).endpoint.id == "long"
    diverging = _plan(f.store, A[:12] + (99, 98))
    assert (diverging.endpoint.id, diverging.reuse_base) == ("short", 12)


def test_a_branch_moving_forward_supersedes_only_its_own_predecessor():
    f = Feed()
    f.publish(endpoint(X, ep_id="x"))
    f.publish(endpoint(Y, ep_id="y"))
    f.publish(endpoint(X + (94, 95, 96), ep_id="x2"))
    assert evictions(f.store.private("t", "s"), 4, exact) == [Eviction("x", SUPERSEDED)]
    f.publish(endpoint(X + (94, 95, 96), ep_id="x3"))  # the same tokens again: it moved on
    assert evictions(f.store.private("t", "s"), 4, exact) == [
        Eviction("x", SUPERSEDED), Eviction("x2", SUPERSEDED)]


def test_past_the_bound_the_least_recently_used_goes():
    f = Feed(endpoints_per_session=2)
    f.publish(endpoint(X, ep_id="b1"))
    f.publish(endpoint(Y, ep_id="b2"))
    f.apply(ev.RequestStarted(request="r", plan="PrivateEndpoint", endpoint="b1",
                              reuse_base=len(X), target=len(X) + 3))
    f.publish(endpoint(A[:20] + (70, 71), ep_id="b3"))
    assert evictions(f.store.private("t", "s"), 2, exact) == [Eviction("b2", SESSION_BOUND)]
    # superseded ones leave first and are not counted against the bound
    f.publish(endpoint(X + (94,), ep_id="b1+"))
    assert evictions(f.store.private("t", "s"), 2, exact) == [
        Eviction("b1", SUPERSEDED), Eviction("b2", SESSION_BOUND)]


def test_may_extend_reads_only_what_the_facts_hold():
    older = endpoint(A[:21], ep_id="o", content=False)      # one token past a hash block
    same_blocks = endpoint(A[:16] + (77,) * 10, ep_id="n", content=False)
    other_blocks = endpoint((0,) + A[1:30], ep_id="m", content=False)
    assert may_extend(endpoint(A[:30], ep_id="a", content=False), older)
    assert may_extend(same_blocks, older)   # the partial block cannot be compared on hashes
    assert not may_extend(other_blocks, older)
    assert not may_extend(older, endpoint(A[:30], ep_id="a", content=False))  # shorter
    with_ids = endpoint(A[:16] + (77,) * 10, ep_id="n2")
    assert not may_extend(with_ids, endpoint(A[:21], ep_id="o2"))  # ids: exact


def test_replay_and_a_snapshot_equal_the_live_fold():
    f = Feed(endpoints_per_session=2)
    log = [f.publish(endpoint(X, ep_id="x")), f.publish(endpoint(Y, ep_id="y")),
           f.apply(ev.RequestStarted(request="r", plan="PrivateEndpoint", endpoint="x",
                                     reuse_base=len(X), target=len(X) + 2)),
           f.publish(endpoint(X + (94,), ep_id="x2")),
           f.apply(ev.EndpointEvicted(endpoint="x", reason=SUPERSEDED)),
           f.publish(endpoint(A[:20] + (70,), ep_id="z")),
           f.apply(ev.EndpointEvicted(endpoint="y", reason=SESSION_BOUND))]
    started = ev.ServerStarted(seq=1, mode=MTP, max_concurrency=2, max_endpoints=16,
                               endpoints_per_session=2)
    replayed = ContinuationStore.replay([started, *log])
    assert replayed == f.store and _ids(replayed) == ["x2", "z"]
    resumed = ContinuationStore()
    resumed.apply(ev.StoreSnapshotted(seq=50, previous=None, store=f.store.snapshot(),
                                      requests={}))
    assert resumed == f.store and resumed.endpoints_per_session == 2


def _checked(bound: int, *events) -> JournalChecker:
    checker = JournalChecker()
    checker.feed(ev.ServerStarted(seq=1, mode=MTP, max_concurrency=2, max_endpoints=16,
                                  endpoints_per_session=bound))
    for seq, e in enumerate(events, start=2):
        checker.feed(ev.with_envelope(e, seq, float(seq)))
    return checker


def _pub(tokens, ep_id, **kw):
    return ev.EndpointPublished(endpoint=endpoint(tokens, ep_id=ep_id, **kw))


def _evict(ep_id, reason):
    return ev.EndpointEvicted(endpoint=ep_id, reason=reason)


@pytest.mark.parametrize("content", [True, False])
def test_journal_check_accepts_the_rules_evictions(content):
    checker = _checked(1, _pub(X, "x", content=content), _pub(Y, "y", content=content),
                       _pub(X + (94,), "x2", content=content), _evict("x", SUPERSEDED),
                       _evict("y", SESSION_BOUND))
    assert _ids(checker.store) == ["x2"]


@pytest.mark.parametrize("events, words", [
    ((_pub(X, "x"), _pub(Y, "y"), _evict("x", SUPERSEDED)), "no later endpoint"),
    ((_pub(X + (94,), "x2"), _pub(X, "x"), _evict("x2", SUPERSEDED)), "no later endpoint"),
    ((_pub(X, "x"), _pub(Y, "y"), _evict("x", SESSION_BOUND)), "holds 2 of 2"),
    ((_pub(X, "x"), _pub(Y, "y"), _pub(A[:20] + (70,), "z"),
      ev.RequestQueued(request="r", conversation="s", tenant="t", prompt_len=len(X) + 1,
                       block_hashes=()),
      ev.RequestStarted(request="r", plan="PrivateEndpoint", endpoint="x", reuse_base=len(X),
                        target=len(X) + 1),
      _evict("x", SESSION_BOUND)), "least recently used"),
    ((_pub(A[:8], "sh", kind="shared"), _evict("sh", SESSION_BOUND)), "shared endpoint"),
])
def test_journal_check_refuses_an_eviction_the_rule_does_not_make(events, words):
    with pytest.raises(InvariantViolation) as err:
        _checked(2, *events)
    assert err.value.invariant == 11 and words in str(err.value)
