"""A priority band and the flows in it: the counters every limit and metric reads.

A flow is one (fairness id, band). It exists while it has requests queued or in flight, so the
number of flows held is bounded by the requests held; its `inflight` count gives a user's n-th
concurrent request its place in vLLM's priority order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.flowcontrol.config import BandConfig
from epp.flowcontrol.item import QueueItem
from epp.flowcontrol.item_queue import FifoQueue
from epp.flowcontrol.policy import FairnessQueue


@dataclass(slots=True)
class Flow:
    id: str
    queued: int = 0
    bytes: int = 0
    inflight: int = 0  # dispatched and not yet completed


@dataclass(slots=True, eq=False)
class Band:
    config: BandConfig
    queue: FairnessQueue  # the fairness policy's view: which request goes next
    arrivals: FifoQueue = field(default_factory=FifoQueue)  # arrival order, for eviction (newest first)
    flows: dict[str, Flow] = field(default_factory=dict)
    count: int = 0
    bytes: int = 0

    @property
    def priority(self) -> int:
        return self.config.priority

    def flow(self, flow_id: str) -> Flow:
        flow = self.flows.get(flow_id)
        if flow is None:
            flow = self.flows[flow_id] = Flow(flow_id)
        return flow

    def add(self, item: QueueItem) -> None:
        flow = self.flow(item.flow_id)
        flow.queued += 1
        flow.bytes += item.size
        self.count += 1
        self.bytes += item.size
        self.queue.push(item)
        self.arrivals.push(item)

    def unlink(self, item: QueueItem, *, popped: bool) -> Flow:
        """Take a queued item out of every structure; `popped`: the fairness queue already did."""
        if not popped:
            self.queue.remove(item)
        self.arrivals.remove(item)
        flow = self.flows[item.flow_id]
        flow.queued -= 1
        flow.bytes -= item.size
        self.count -= 1
        self.bytes -= item.size
        return flow

    def release_flow_if_idle(self, flow: Flow) -> None:
        if flow.queued == 0 and flow.inflight == 0 and self.flows.get(flow.id) is flow:
            del self.flows[flow.id]
            self.queue.flow_idle(flow.id)
