"""The virtual-time event loop: asyncio code runs unchanged while the clock jumps."""

from __future__ import annotations

import asyncio
import socket

import pytest

from epp.sim.cluster.vloop import VirtualDeadlock, VirtualTimeLoop, run_virtual


def test_sleep_and_timeouts_advance_the_virtual_clock() -> None:
    async def main() -> tuple[float, float, bool]:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        after_sleep = loop.time()
        timed_out = False
        try:
            async with asyncio.timeout(2.5):
                await asyncio.Event().wait()
        except TimeoutError:
            timed_out = True
        return after_sleep, loop.time(), timed_out

    after_sleep, end, timed_out = run_virtual(main())
    assert after_sleep == pytest.approx(3600)
    assert end == pytest.approx(3602.5)
    assert timed_out


def test_timers_fire_in_time_order() -> None:
    seen: list[tuple[str, float]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for name, t in (("c", 3.0), ("a", 1.0), ("b", 2.0)):
            loop.call_at(t, lambda n=name: seen.append((n, loop.time())))
        await asyncio.sleep(5)

    run_virtual(main())
    assert [n for n, _ in seen] == ["a", "b", "c"]
    assert [t for _, t in seen] == pytest.approx([1.0, 2.0, 3.0])


def test_waiting_forever_is_a_deadlock_not_a_hang() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(VirtualDeadlock):
        run_virtual(main())


def test_real_io_is_refused() -> None:
    async def main() -> None:
        a, b = socket.socketpair()
        try:
            asyncio.get_running_loop().add_reader(a.fileno(), lambda: None)
        finally:
            a.close()
            b.close()

    with pytest.raises(RuntimeError, match="no real I/O"):
        run_virtual(main())


def test_leftover_tasks_are_cancelled_and_the_loop_closed() -> None:
    loop = VirtualTimeLoop()
    cancelled: list[bool] = []

    async def forever() -> None:
        try:
            await asyncio.sleep(1e9)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main() -> int:
        asyncio.get_running_loop().create_task(forever())
        await asyncio.sleep(1)
        return 7

    assert run_virtual(main(), loop) == 7
    assert cancelled == [True]
    assert loop.is_closed()
