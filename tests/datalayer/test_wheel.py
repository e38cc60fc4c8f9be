"""The timer wheel the scraper's polls and timeouts run on: nothing early, everything once."""

from __future__ import annotations

import asyncio
import math

from epp.datalayer.wheel import TimerWheel

from .helpers import wait_until


async def test_entries_run_once_never_early_in_time_order() -> None:
    loop = asyncio.get_running_loop()
    ran: list[tuple[str, float]] = []
    wheel: TimerWheel[str] = TimerWheel(0.01, lambda entry: ran.append((entry, loop.time())))
    start = loop.time()
    step_end = math.ceil((start + 0.02) / 0.01) * 0.01  # b and b2 inside one grid step, wherever start falls
    due = {"c": wheel.add(start + 0.05, "c"), "a": wheel.add(start + 0.001, "a"), "b": wheel.add(step_end - 0.004, "b"),
           "b2": wheel.add(step_end - 0.002, "b2")}
    assert due["b"] == due["b2"]  # one grid step, one bucket
    assert all(at >= start for at in due.values()) and len(wheel) == 4
    await wait_until(lambda: len(ran) == 4, "every entry")
    assert [entry for entry, _ in ran] == ["a", "b", "b2", "c"]
    for entry, when in ran:
        assert when >= due[entry] - 0.001  # the loop's timers are to the millisecond
    await asyncio.sleep(0.03)
    assert len(ran) == 4 and len(wheel) == 0


async def test_an_entry_may_add_entries_and_one_that_fails_does_not_stop_the_others() -> None:
    loop = asyncio.get_running_loop()
    ran: list[str] = []

    def fire(entry: str) -> None:
        ran.append(entry)
        if entry == "boom":
            raise RuntimeError("boom")
        if entry == "again":
            wheel.add(loop.time(), "now")  # due at once: runs in this turn or the next
            wheel.add(loop.time() + 0.02, "later")

    wheel: TimerWheel[str] = TimerWheel(0.0, fire)  # exact times
    wheel.add(loop.time() + 0.005, "boom")
    wheel.add(loop.time() + 0.005, "again")
    await wait_until(lambda: "later" in ran, "the entries added while firing")
    assert ran == ["boom", "again", "now", "later"]


async def test_clear_forgets_everything() -> None:
    ran: list[int] = []
    wheel: TimerWheel[int] = TimerWheel(0.01, ran.append)
    loop = asyncio.get_running_loop()
    for i in range(5):
        wheel.add(loop.time() + 0.01 * i, i)
    wheel.clear()
    assert len(wheel) == 0
    await asyncio.sleep(0.08)
    assert ran == []
    wheel.add(loop.time(), 9)  # still usable
    await wait_until(lambda: ran == [9], "a new entry")


async def test_a_deadline_one_interval_after_a_grid_time_is_the_grid_time_that_interval_later() -> None:
    """The scraper schedules each poll at its last grid time + the interval. In floating point
    that sum lands a hair past the grid about half the time; rounded up from there, polls every
    50 ms ran every 62.5 ms on average (the metrics' age a third more than configured)."""
    wheel: TimerWheel[int] = TimerWheel(0.025, lambda entry: None)
    for start in (0.0, 1234.5678, 98_765.4321, 3_456_789.0123):  # loop clocks of many magnitudes
        at = wheel.add(start, 0)
        for i in range(2000):
            following = wheel.add(at + 0.05, i)
            assert math.isclose(following - at, 0.05, abs_tol=1e-6), (start, i, following - at)
            at = following
        wheel.clear()
