"""Admission: whether a request may be scheduled now.

`Admission.run` wraps scheduling so that flow control can hold a request in its queues and
dispatch it later (late binding), while the legacy controller decides at once. The director
tells the admission when an admitted request ends (`completed`, with the response's usage), and
asks it for body fields to set on the forwarded request (`body_fields`, e.g. vLLM `priority`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from epp.api.request import InferenceRequest
from epp.api.response import Usage
from epp.datastore import Endpoint
from epp.datastore.endpoint import with_valid_metrics
from epp.errors import Code, EppError
from epp.flowcontrol.saturation import SaturationDetector
from epp.scheduling.framework import SchedulingResult

ScheduleFn = Callable[[InferenceRequest, list[Endpoint]], SchedulingResult]


class RejectionSink(Protocol):
    def flow_rejected(self, reason: str, priority: int) -> None: ...


class Admission(ABC):
    @abstractmethod
    async def run(self, request: InferenceRequest, candidates: list[Endpoint], schedule: ScheduleFn) -> SchedulingResult:
        """Schedule `request` when it is admitted; raise `EppError` when it is shed.

        `schedule` is called at most once, with the candidates the request may use now, and
        accounts the pick at once (so a cancelled caller's pick can still be released)."""

    async def start(self) -> None:
        """Start background work (the flow-control dispatch loop)."""

    async def stop(self) -> None:
        """Stop background work; requests still waiting end with an error."""

    def completed(self, request: InferenceRequest, usage: Usage | None) -> None:
        """A request `run` admitted has ended (any way); `usage` when the server reported it."""

    def body_fields(self, request: InferenceRequest) -> dict[str, Any]:
        """Fields to set in the forwarded body of an admitted request; empty: forward as sent."""
        return {}


class LegacyAdmission(Admission):
    """The reference's default: sheddable requests (priority < 0) are rejected with 429 while the
    pool is saturated; everything else is scheduled at once, never queued.

    Endpoints whose last scrape was invalid are left out of the pick (unless every candidate is);
    flow control leaves them out through the detector, which counts them as full."""

    def __init__(self, detector: SaturationDetector, metrics: RejectionSink | None = None) -> None:
        self.detector = detector
        self.metrics = metrics

    async def run(self, request: InferenceRequest, candidates: list[Endpoint], schedule: ScheduleFn) -> SchedulingResult:
        if request.sheddable and self.detector.saturation(candidates) >= 1.0:
            if self.metrics is not None:
                self.metrics.flow_rejected("saturated", request.priority)
            raise EppError(Code.RESOURCE_EXHAUSTED, "system saturated, sheddable request dropped", reason="saturated")
        return schedule(request, with_valid_metrics(candidates))
