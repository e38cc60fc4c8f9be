"""`round-robin-fairness-policy`: flows of a band take turns, one request each.

The band keeps a ring of its non-empty flows. The flow at the front dispatches its next request
(in the band's ordering) and moves to the back; a flow whose queue empties leaves the ring and
rejoins at the back when it queues again. So a user with one request waits at most one turn of
every other waiting user, however many requests those users have queued (the reference walks a
cursor over sorted flow keys; a ring in arrival order gives the same bound without sorting).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from epp.flowcontrol.item import QueueItem
from epp.flowcontrol.item_queue import ItemQueue
from epp.flowcontrol.policy import FairnessPolicy, FairnessQueue, OrderingPolicy


class _RoundRobinQueue(FairnessQueue):
    __slots__ = ("_ordering", "_ring", "_count")

    def __init__(self, ordering: OrderingPolicy) -> None:
        self._ordering = ordering
        self._ring: OrderedDict[str, ItemQueue] = OrderedDict()  # non-empty flows, front = next
        self._count = 0

    def push(self, item: QueueItem) -> None:
        queue = self._ring.get(item.flow_id)
        if queue is None:
            queue = self._ring[item.flow_id] = self._ordering.new_queue()
        queue.push(item)
        self._count += 1

    def remove(self, item: QueueItem) -> bool:
        queue = self._ring.get(item.flow_id)
        if queue is None or not queue.remove(item):
            return False
        self._count -= 1
        if not queue:
            del self._ring[item.flow_id]
        return True

    def peek(self) -> QueueItem | None:
        if not self._ring:
            return None
        return next(iter(self._ring.values())).peek()

    def pop(self) -> QueueItem:
        return self.pop_flow(next(iter(self._ring)))

    def heads(self, limit: int) -> list[QueueItem]:
        return [queue.peek() for queue in itertools.islice(self._ring.values(), limit)]  # type: ignore[misc]

    def pop_flow(self, flow_id: str) -> QueueItem:
        """The flow takes its turn now; the flows passed over stay at the front."""
        queue = self._ring[flow_id]
        item = queue.pop()
        self._count -= 1
        if queue:
            self._ring.move_to_end(flow_id)
        else:
            del self._ring[flow_id]
        return item

    def __len__(self) -> int:
        return self._count


class RoundRobinFairnessPolicy(FairnessPolicy):
    type = "round-robin-fairness-policy"

    def new_band(self, ordering: OrderingPolicy) -> FairnessQueue:
        return _RoundRobinQueue(ordering)
