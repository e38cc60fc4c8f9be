"""An asyncio event loop on a virtual clock: production coroutines, simulated time.

The EPP's request path (`Director.handle_request`, the flow-control adapter and its dispatch
loop, `asyncio.timeout`, `asyncio.sleep`) is asyncio code. Rather than re-implement it for the
simulator, we run it unchanged on a loop whose `time()` is virtual: where a real loop would block
in `select(timeout)` waiting for I/O or the next timer, this one jumps its clock forward by
`timeout` and returns no events. A run therefore takes as long as its callbacks compute, however
many simulated seconds pass, and the same inputs give the same order of events every time.

No real I/O is allowed: after construction the selector refuses every registration (a socket, a
subprocess pipe or a signal handler would wait for the real world, which never advances here).
A loop with nothing ready and no timer could never wake up again; that raises `VirtualDeadlock`
instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from asyncio import selector_events
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class VirtualDeadlock(RuntimeError):
    """Every task waits and no timer is set: nothing can ever happen again."""


class _VirtualSelector(selectors.BaseSelector):
    """A selector with no file descriptors to watch; `select` advances the virtual clock."""

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock
        self._keys: dict[int, selectors.SelectorKey] = {}
        self.sealed = False

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        # Only the loop's own self-pipe (for call_soon_threadsafe) is accepted, at construction.
        if self.sealed:
            raise RuntimeError("no real I/O on the virtual-time loop (it would never become ready)")
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise VirtualDeadlock("virtual-time loop: every task is waiting and no timer is set")
        if timeout > 0:
            self._clock.now += timeout
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualClock:
    """The simulated time, in seconds from 0."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class VirtualTimeLoop(selector_events.BaseSelectorEventLoop):
    """A selector event loop whose clock is `self.clock` and whose waits take no real time."""

    def __init__(self, start: float = 0.0) -> None:
        self.clock = VirtualClock(start)
        selector = _VirtualSelector(self.clock)
        super().__init__(selector)
        selector.sealed = True

    def time(self) -> float:
        return self.clock.now

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:
        raise RuntimeError("no threads on the virtual-time loop: they would run in real time")


def run_virtual(main: Coroutine[Any, Any, T], loop: VirtualTimeLoop | None = None) -> T:
    """Run `main` to completion on a (new) virtual-time loop, then cancel what is left and close it."""
    loop = loop or VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()
