"""The flow-control policy plugin kinds (reference §5.3), one file per type under `plugins/`.

- An **ordering policy** orders the requests of one flow (FCFS, EDF, SLO deadline): it makes
  the queue a flow's requests wait in.
- A **fairness policy** chooses which flow of a band goes next (global strict order, round
  robin, token-weighted). It builds one `FairnessQueue` per band, which owns that band's
  per-flow queues.
- A **usage-limit policy** gives each band a saturation ceiling: an endpoint whose saturation is
  at or above it takes no more requests of that band.

Policies are pure data structures: no clock, no I/O. The controller calls them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from epp.api.response import Usage
from epp.flowcontrol.item import QueueItem
from epp.flowcontrol.item_queue import ItemQueue
from epp.plugin import Plugin


class OrderingPolicy(Plugin):
    @abstractmethod
    def new_queue(self) -> ItemQueue:
        """An empty queue in this policy's order."""


class FairnessQueue(ABC):
    """One band's queued requests across its flows. `peek` shows the next request the band
    would dispatch; `pop` dispatches exactly that request and charges its flow."""

    @abstractmethod
    def push(self, item: QueueItem) -> None: ...

    @abstractmethod
    def remove(self, item: QueueItem) -> bool:
        """A queued request leaves without being dispatched (cancel, TTL, eviction)."""

    @abstractmethod
    def peek(self) -> QueueItem | None: ...

    @abstractmethod
    def pop(self) -> QueueItem:
        """Dispatch the request `peek` returned."""

    @abstractmethod
    def __len__(self) -> int: ...

    def heads(self, limit: int) -> list[QueueItem]:
        """The next request of each of up to `limit` waiting flows, in the order the band would
        dispatch them (the first is `peek()`), for when a flow must be passed over on some
        endpoints (batch-slot fairness). A policy that orders requests across flows rather than
        flows (global strict) offers only its head: passing over it would change its order."""
        head = self.peek()
        return [head] if head is not None else []

    def pop_flow(self, flow_id: str) -> QueueItem:
        """Dispatch the next request of `flow_id`, one of `heads()`, ahead of the flows before it
        (they keep their place). Policies without `heads()` beyond the first need not override."""
        item = self.peek()
        if item is None or item.flow_id != flow_id:
            raise ValueError(f"this fairness policy cannot dispatch flow {flow_id!r} out of turn")
        return self.pop()

    def completed(self, item: QueueItem, usage: Usage | None) -> None:
        """A dispatched request ended; `usage` is what the model server reported, if anything."""

    def refund(self, item: QueueItem) -> None:
        """A popped request never ran (its scheduling failed): undo what `pop` charged."""

    def flow_idle(self, flow_id: str) -> None:
        """The flow has nothing queued or in flight; per-flow state may be dropped."""


class FairnessPolicy(Plugin):
    # Whether its queues order flows (and so can pass one over, `FairnessQueue.heads`) rather
    # than requests across flows; batch-slot fairness needs it.
    orders_flows: bool = True

    @abstractmethod
    def new_band(self, ordering: OrderingPolicy) -> FairnessQueue:
        """A fresh queue for one band whose flows are ordered by `ordering`."""


class UsageLimitPolicy(Plugin):
    @abstractmethod
    def ceiling(self, priority: int) -> float:
        """Saturation at or above which an endpoint takes no more requests of this band."""
