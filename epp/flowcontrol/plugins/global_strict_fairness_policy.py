"""`global-strict-fairness-policy` (the default): no fairness, one order for the whole band.

All flows of a band share one queue in the band's ordering (FCFS: global arrival order). This is
the reference's "best head across all flows" with the same result: when every flow's queue is
ordered by the same total order, the best head across flows is the head of the merged queue.
"""

from __future__ import annotations

from epp.flowcontrol.item import QueueItem
from epp.flowcontrol.policy import FairnessPolicy, FairnessQueue, OrderingPolicy


class _GlobalStrictQueue(FairnessQueue):
    __slots__ = ("_queue",)

    def __init__(self, ordering: OrderingPolicy) -> None:
        self._queue = ordering.new_queue()

    def push(self, item: QueueItem) -> None:
        self._queue.push(item)

    def remove(self, item: QueueItem) -> bool:
        return self._queue.remove(item)

    def peek(self) -> QueueItem | None:
        return self._queue.peek()

    def pop(self) -> QueueItem:
        return self._queue.pop()

    def __len__(self) -> int:
        return len(self._queue)


class GlobalStrictFairnessPolicy(FairnessPolicy):
    type = "global-strict-fairness-policy"
    orders_flows = False  # one order across flows: no flow can be passed over

    def new_band(self, ordering: OrderingPolicy) -> FairnessQueue:
        return _GlobalStrictQueue(ordering)
