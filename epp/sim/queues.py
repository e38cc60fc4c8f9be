"""The engine's waiting queue under vLLM's two scheduling policies.

fcfs: arrival order, preempted requests go back to the front. priority: lowest `priority`
value first, ties by arrival time (vLLM's (priority, arrival_time) order).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from epp.sim.request import Request


class WaitingQueue(Protocol):
    def add(self, req: Request) -> None: ...
    def prepend(self, req: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, req: Request) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FcfsQueue:
    """Arrival order; requeued (preempted or skipped) requests jump to the front."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def prepend(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> bool:
        try:
            self._q.remove(req)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Min-heap on (priority, arrival_time, seq); requeued requests keep their place by key."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h: list[tuple[int, float, int, Request]] = []

    def add(self, req: Request) -> None:
        heapq.heappush(self._h, (req.priority, req.arrival_time, req.seq, req))

    prepend = add

    def peek(self) -> Request:
        return self._h[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._h)[3]

    def remove(self, req: Request) -> bool:
        for i, item in enumerate(self._h):
            if item[3] is req:
                last = self._h.pop()
                if i < len(self._h):
                    self._h[i] = last
                    heapq.heapify(self._h)
                return True
        return False

    def __len__(self) -> int:
        return len(self._h)

    def __iter__(self) -> Iterator[Request]:
        return (item[3] for item in self._h)


def make_queue(policy: str) -> FcfsQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FcfsQueue()
