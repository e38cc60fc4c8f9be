"""`slo-deadline-ordering-policy`: earliest TTFT deadline first.

The deadline is the time the request was received plus its `x-slo-ttft-ms` header; requests
without the header (or with an invalid one) go after all that have it, FCFS among themselves.
A request whose first token is due soonest is the one a wait hurts most.
"""

from __future__ import annotations

from epp.flowcontrol.item import QueueItem
from epp.flowcontrol.item_queue import HeapQueue, ItemQueue
from epp.flowcontrol.policy import OrderingPolicy


def _slo_deadline(item: QueueItem) -> float:
    return item.slo_deadline


class SloDeadlineOrderingPolicy(OrderingPolicy):
    type = "slo-deadline-ordering-policy"

    def new_queue(self) -> ItemQueue:
        return HeapQueue(_slo_deadline)
