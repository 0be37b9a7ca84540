"""The scheduler alone: plain bookkeeping over pools, store and requests, no model, no
torch, microseconds a test. It decides; these tests check each decision."""

from ninfer.engine.scheduler import Evict, Fail, Preempt, Scheduler
from ninfer.lifecycle import events as ev
from ninfer.lifecycle.eventlog import EventLog
from ninfer.lifecycle.request import Request, SamplingParams
from ninfer.lifecycle.store import ContinuationStore
from ninfer.model.pools import BlockPool, SlotPool

from ..lifecycle.factories import MTP, Feed, endpoint


def _request(rid, state="Queued", prompt_len=8, max_tokens=4):
    log = EventLog(ContinuationStore())
    r = Request(id=rid, prompt=tuple(range(prompt_len)), session="s", tenant="t", log=log,
                mode=MTP, params=SamplingParams(max_tokens=max_tokens))
    r.state = state
    return r


def _scheduler(*, blocks=16, slots=4, lanes=2, feed=None, kv_copies=1, draft=1):
    store = (feed or Feed()).store
    return Scheduler(max_concurrency=lanes, draft_tokens=draft, blocks=BlockPool(blocks, 4),
                     slots=SlotPool(slots), store=store, kv_copies=kv_copies)


def test_the_head_starts_when_a_lane_is_free_and_it_fits_and_keeps_its_place_otherwise():
    s = _scheduler(blocks=8, lanes=2)
    big, small = _request("big", prompt_len=40), _request("small")
    s.admit(big)
    s.admit(small)
    assert s.next_start(live=0) is big            # alone, anything may start
    assert s.next_start(live=1) is None           # beside a lane, 40+4+1 positions don't fit
    assert s.next_start(live=2) is None           # no lane free
    s.started(big)
    assert s.next_start(live=1) is small


def test_fitting_counts_prompt_outputs_drafts_and_the_mtp_copy():
    r = _request("r", prompt_len=9, max_tokens=4)    # 9 + 4 + 3 drafts = 16 positions, 4 blocks
    assert _scheduler(blocks=4, draft=3).fits(r, live=1)
    assert not _scheduler(blocks=3, draft=3).fits(r, live=1)
    assert not _scheduler(blocks=7, draft=3, kv_copies=2).fits(r, live=1)
    assert _scheduler(blocks=8, draft=3, kv_copies=2).fits(r, live=1)


def test_a_preempted_request_waits_first_in_line_and_a_cancelled_one_leaves_it():
    s = _scheduler()
    a, b, c = _request("a"), _request("b"), _request("c")
    s.admit(a)
    s.admit(b)
    s.requeue(c)
    assert list(s.waiting) == [c, a, b]
    s.withdraw(a)
    s.withdraw(a)  # twice: nothing to remove the second time
    assert list(s.waiting) == [c, b]


def _feed_with_endpoints(*names):
    feed = Feed()
    for i, name in enumerate(names):
        feed.publish(endpoint(range(4 + i), ep_id=name, session=name))
    return feed


def test_memory_is_relieved_by_the_least_recently_used_endpoint_first():
    feed = _feed_with_endpoints("old", "mid", "new")
    feed.apply(ev.RequestStarted(request="x", plan="PrivateEndpoint", endpoint="old",
                                 reuse_base=4, target=8))  # "old" was just used
    s = _scheduler(feed=feed)
    asking = _request("a", "Prefilling")
    assert s.relieve(asking, [asking], "short") == Evict("mid")
    assert s.store.by_recency() == ["mid", "new", "old"]
    assert s.evictable() == Evict("mid")


def test_without_endpoints_the_newest_other_computing_lane_gives_way():
    s = _scheduler()
    asking = _request("a", "Active")
    older, newer, finishing = (_request("o", "Prefilling"), _request("n", "Active"),
                               _request("f", "Finishable"))
    assert s.relieve(asking, [older, asking, newer, finishing], "short") == Preempt("n")
    assert s.relieve(asking, [older, asking], "short") == Preempt("o")


def test_with_only_finishing_lanes_beside_it_the_asking_lane_waits_and_alone_it_fails():
    s = _scheduler()
    asking = _request("a", "Prefilling")
    assert s.relieve(asking, [asking, _request("f", "Finishable")], "short") == Preempt("a")
    decision = s.relieve(asking, [asking], "need 9 KV blocks, 2 free")
    assert isinstance(decision, Fail) and "need 9 KV blocks, 2 free" in decision.message


def test_a_slot_is_had_for_free_or_for_the_lru_endpoint_or_not_at_all():
    feed = _feed_with_endpoints("a", "b")
    s = _scheduler(slots=1, feed=feed)
    assert s.for_slot() is None                   # one is free
    s.slots.alloc()
    assert s.for_slot() == Evict("a")
    empty = _scheduler(slots=1)
    empty.slots.alloc()
    assert empty.for_slot() is None and empty.evictable() is None


def test_capacity_and_memory_pressure_evict_in_one_order():
    feed = _feed_with_endpoints("a", "b", "c", "d")
    feed.store.max_endpoints = 2
    feed.apply(ev.RequestStarted(request="x", plan="PrivateEndpoint", endpoint="b",
                                 reuse_base=4, target=9))
    s = _scheduler(feed=feed)
    assert s.over_capacity() == ["a", "c"] == s.store.by_recency()[:2]
    assert s.evictable() == Evict(s.over_capacity()[0])
