"""Events from the engine thread reach the event loop in batches: the events put before a
release wake the loop once, those put while the loop has not yet taken the last batch join
it, each queue gets its own in order, and a loop that is gone leaves nothing behind in the
registry."""

from __future__ import annotations

import asyncio
import gc
import threading

from ninfer.server import handoff


def test_events_put_together_wake_the_loop_once_and_keep_their_order():
    async def main() -> tuple[list, list, int]:
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), original(*a))[1]
        h = handoff.handoff_for(loop)
        assert handoff.handoff_for(loop) is h
        a, b = asyncio.Queue(), asyncio.Queue()
        # the loop is busy here (this coroutine), as it is when a step's events arrive
        def put(items: range) -> None:
            for i in items:
                h.put(a if i % 2 else b, i)
            h.release()
        for items in (range(4), range(4, 6)):  # the second before the loop took the first
            putter = threading.Thread(target=put, args=(items,))
            putter.start()
            putter.join()
        assert not a.qsize() and not b.qsize()  # nothing delivered before the loop runs
        got_a = [await a.get() for _ in range(3)]
        got_b = [await b.get() for _ in range(3)]
        return got_a, got_b, len(wakeups)

    got_a, got_b, wakeups = asyncio.run(main())
    assert got_a == [1, 3, 5] and got_b == [0, 2, 4]
    assert wakeups == 1


def test_a_loop_that_is_gone_leaves_the_registry():
    async def main() -> None:
        handoff.handoff_for(asyncio.get_running_loop())

    asyncio.run(main())
    gc.collect()
    assert not [loop for loop in list(handoff._HANDOFFS) if loop.is_closed()]


def test_nothing_wakes_the_loop_before_the_release():
    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), original(*a))[1]
        h = handoff.handoff_for(loop)
        q = asyncio.Queue()
        h.put(q, "token")
        await asyncio.sleep(0)
        before = len(wakeups)
        h.release()
        got = await q.get()
        assert got == "token"
        h.release()  # nothing pending: no wake-up
        return before, len(wakeups)

    assert asyncio.run(main()) == (0, 1)
