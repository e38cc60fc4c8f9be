"""One queued request, and how its time in flow control ended.

`QueueItem` is the handle the controller gives back from `enqueue`: the caller keeps it to
cancel the request (`remove`) or to report its end (`complete`). The controller fills in the
bookkeeping fields; the caller only sets the request, its schedule function and, optionally,
the endpoints it may go to and an opaque `waiter` (the asyncio adapter keeps its future there).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.errors import EppError
from epp.flowcontrol.admission import ScheduleFn
from epp.scheduling.framework import SchedulingResult



class Outcome(str, enum.Enum):
    """How a request left the queue; the reference's `outcome` label values."""

    DISPATCHED = "Dispatched"
    REJECTED_CAPACITY = "RejectedCapacity"
    REJECTED_OTHER = "RejectedOther"
    EVICTED_TTL = "EvictedTTL"
    EVICTED_CONTEXT_CANCELLED = "EvictedContextCancelled"
    EVICTED_OTHER = "EvictedOther"


class ItemState(enum.Enum):
    NEW = 0
    QUEUED = 1
    DISPATCHED = 2  # left the queue with an endpoint; counts in its flow until `complete`
    DONE = 3  # rejected, evicted, or completed: nothing of it is held any more


@dataclass(slots=True, eq=False, repr=False)
class QueueItem:
    """A request waiting for (or holding) a dispatch. Identity-hashed: it is its own handle."""

    request: InferenceRequest
    schedule: ScheduleFn
    allowed: frozenset[str] | None = None  # endpoint addresses it may use (subset hint); None: any
    waiter: Any = None  # opaque to the controller
    # -- filled in by the controller --
    seq: int = 0
    state: ItemState = ItemState.NEW
    priority: int = 0  # its band
    flow_id: str = ""
    size: int = 0  # body bytes held in memory while queued
    enqueue_time: float = 0.0
    deadline: float = math.inf  # TTL expiry
    slo_deadline: float = math.inf  # enqueue time + x-slo-ttft-ms
    charged: float = 0.0  # fairness tokens charged at dispatch (token fairness), corrected at completion
    engine_priority: int | None = None  # vLLM `priority` to put in the body, when enabled
    endpoint: Endpoint | None = None  # where it was dispatched
    reserved: bool = False  # dispatched into the endpoint's newcomer reserve (slots.py)
    dispatch_time: float = 0.0
    left_pod: bool = False  # its response is over, its usage still to come (`FlowController.left_pod`)

    @property
    def queued(self) -> bool:
        return self.state is ItemState.QUEUED

    def __repr__(self) -> str:
        return (f"QueueItem({self.request.request_id}, flow={self.flow_id!r}, priority={self.priority}, "
                f"state={self.state.name})")


@dataclass(slots=True)
class Ending:
    """What happened to an item in one controller call: dispatched with a `result`, or ended with
    an `error` (rejected, expired, evicted). A request that was dispatched but whose scheduling
    failed has outcome DISPATCHED *and* an error: check `error` first."""

    item: QueueItem
    outcome: Outcome
    result: SchedulingResult | None = None
    error: EppError | None = None
