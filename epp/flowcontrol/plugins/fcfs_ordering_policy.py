"""`fcfs-ordering-policy` (the default): a flow's requests in arrival order."""

from __future__ import annotations

from epp.flowcontrol.item_queue import FifoQueue, ItemQueue
from epp.flowcontrol.policy import OrderingPolicy


class FcfsOrderingPolicy(OrderingPolicy):
    type = "fcfs-ordering-policy"

    def new_queue(self) -> ItemQueue:
        return FifoQueue()
