"""`edf-ordering-policy`: earliest deadline first, the deadline being enqueue time + TTL.

Requests without a TTL have no deadline and go after every request that has one; ties are FCFS.
With one TTL for the whole band this equals FCFS; it differs when bands are configured with
their own `defaultRequestTTL` and a global-strict band mixes them, or when TTLs change at runtime.
"""

from __future__ import annotations

from epp.flowcontrol.item import QueueItem
from epp.flowcontrol.item_queue import HeapQueue, ItemQueue
from epp.flowcontrol.policy import OrderingPolicy


def _deadline(item: QueueItem) -> float:
    return item.deadline


class EdfOrderingPolicy(OrderingPolicy):
    type = "edf-ordering-policy"

    def new_queue(self) -> ItemQueue:
        return HeapQueue(_deadline)
