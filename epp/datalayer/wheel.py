"""One loop timer for many deadlines: the scraper's polls and their timeouts.

At 2,000 polls a second, a loop timer per poll and another for its timeout (created, armed,
cancelled or fired, freed) cost more CPU than the bookkeeping they do. Here deadlines are kept
in buckets on a grid of `quantum` seconds (exact times when it is 0), and one loop timer is
armed for the earliest bucket: the deadlines of one grid step cost one timer between them, and
the things due in a step run in one turn of the loop (their answers then come back together:
fewer wake-ups too). A deadline is rounded up to the grid, never down (nothing runs early,
up to one `quantum` late; a deadline a floating-point hair past a grid time is that time).
There is no cancelling: the caller's `fire` ignores an entry that no longer applies (an
endpoint that went, a poll that already answered).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections.abc import Callable
from typing import Generic, TypeVar

Entry = TypeVar("Entry")

log = logging.getLogger("epp.datalayer")

_EARLY = 0.001  # the loop's timers fire to the millisecond: a bucket this close to now is due
# A deadline within this share of a grid step past a grid time is that grid time: a poll's next
# deadline is its grid time plus the interval, which in floating point lands a hair past the grid
# about half the time, and rounded up from there each such poll waited a whole step more (every
# 50 ms poll every 62.5 ms on average, its metrics a third older, from one machine to the next as
# the clock's magnitude changed).
_GRID_SLACK = 1e-6


class TimerWheel(Generic[Entry]):
    """Deadlines on one loop timer. `fire(entry)` runs for each entry once its time has come."""

    def __init__(self, quantum: float, fire: Callable[[Entry], None]) -> None:
        self.quantum = quantum
        self.fire = fire
        self._buckets: dict[float, list[Entry]] = {}
        self._times: list[float] = []  # a heap of the buckets' times
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def add(self, at: float, entry: Entry) -> float:
        """`entry` is due at loop time `at` (rounded up to the grid); returns the time it will run."""
        quantum = self.quantum
        if quantum > 0:
            at = math.ceil(at / quantum - _GRID_SLACK) * quantum
        bucket = self._buckets.get(at)
        if bucket is None:
            bucket = self._buckets[at] = []
            heapq.heappush(self._times, at)
            if at < self._timer_at:
                self._arm(at)
        bucket.append(entry)
        return at

    def clear(self) -> None:
        """Forget every deadline (stop)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, math.inf
        self._buckets.clear()
        self._times.clear()

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_at(at, self._run)

    def _run(self) -> None:
        self._timer, self._timer_at = None, math.inf
        loop = asyncio.get_running_loop()
        times, buckets, fire = self._times, self._buckets, self.fire
        while times and times[0] <= loop.time() + _EARLY:
            for entry in buckets.pop(heapq.heappop(times)):
                try:
                    fire(entry)  # may add entries, even to a bucket due now (it runs in this turn)
                except Exception:  # one entry's failure must not stop the others' timers
                    log.exception("a timer wheel entry failed")
        if times and times[0] < self._timer_at:
            self._arm(times[0])
