"""A request's inbox on the event loop: FIFO, one waiter, a wait's timeout ends it with None
at its own deadline, never at the deadline of an earlier wait whose timer is still armed.
Ordered by the loop's timers (which fires first), never by measured durations. Each runs
on asyncio's loop and on uvloop's (uvicorn's wherever it is installed; its timer handles
have no `when()`, which the inbox once read: every stream on a GPU machine with uvloop
broke at its first timer)."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from ninfer.server.inbox import Inbox

LOOPS = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    return LOOPS[request.param]


def test_fifo_and_immediate_items(run):
    async def main() -> list:
        inbox = Inbox()
        for x in ("a", "b"):
            inbox.put_nowait(x)
        assert not inbox.empty() and inbox.qsize() == 2
        got = [await inbox.get(0.01), inbox.get_nowait()]
        assert inbox.empty()
        return got

    assert run(main()) == ["a", "b"]


def test_a_wait_ends_with_the_item_put_while_waiting(run):
    async def main():
        inbox = Inbox()
        asyncio.get_running_loop().call_soon(inbox.put_nowait, "x")
        return await inbox.get()   # no timeout

    assert run(main()) == "x"


def test_a_wait_times_out_with_none_and_the_late_item_waits_for_the_next_get(run):
    async def main() -> tuple:
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        loop.call_later(0.5, inbox.put_nowait, "late")
        first = await inbox.get(0.01)
        return first, await inbox.get(5)

    assert run(main()) == (None, "late")


def test_an_earlier_waits_timer_does_not_end_a_longer_wait(run):
    """The first wait arms a timer for 0.05 s and ends at once with an item; the second wait
    (10 s) is still waiting when that timer fires, and must go on to the item put at 0.3 s."""
    async def main():
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        loop.call_soon(inbox.put_nowait, "now")
        assert await inbox.get(0.05) == "now"
        loop.call_later(0.3, inbox.put_nowait, "later")
        return await inbox.get(10)

    assert run(main()) == "later"


def test_a_shorter_wait_after_a_longer_one_ends_at_its_own_deadline(run):
    """A timer armed for a long wait must not hold a later, shorter wait past its deadline:
    the short wait times out before the item put at 0.5 s."""
    async def main() -> tuple:
        loop = asyncio.get_running_loop()
        inbox = Inbox()
        loop.call_soon(inbox.put_nowait, "now")
        assert await inbox.get(60) == "now"
        loop.call_later(0.5, inbox.put_nowait, "later")
        return await inbox.get(0.02), await inbox.get(5)

    assert run(main()) == (None, "later")


def test_one_reader_and_a_cancelled_wait_leaves_it_usable(run):
    async def main():
        inbox = Inbox()
        waiting = asyncio.create_task(inbox.get(5))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError):
            await inbox.get(5)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        inbox.put_nowait("after")
        return await inbox.get(5)

    assert run(main()) == "after"


def test_a_wait_whose_deadline_has_passed_ends_with_none(run):
    """A deadline already due when armed: uvloop then schedules the callback as a plain
    handle, with no `when()` (what broke the served streams on the GPU machine)."""
    async def waits() -> tuple:
        inbox = Inbox()
        got = await inbox.get(0), await inbox.get(-1)
        inbox.put_nowait("x")
        return (*got, await inbox.get(0))

    async def main() -> tuple:   # a wait the timer never ends fails here, not hangs
        return await asyncio.wait_for(waits(), 5)

    assert run(main()) == (None, None, "x")
