"""Admission: whether a request may be scheduled now.

`Admission.run` wraps scheduling so that flow control can hold a request in its queues and
dispatch it later (late binding), while the legacy controller decides at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.errors import Code, EppError
from epp.flowcontrol.saturation import SaturationDetector
from epp.scheduling.framework import SchedulingResult

ScheduleFn = Callable[[InferenceRequest, list[Endpoint]], SchedulingResult]


class Admission(ABC):
    @abstractmethod
    async def run(self, request: InferenceRequest, candidates: list[Endpoint], schedule: ScheduleFn) -> SchedulingResult:
        """Schedule `request` when it is admitted; raise `EppError` when it is shed."""


class LegacyAdmission(Admission):
    """The reference's default: sheddable requests (priority < 0) are rejected with 429 while the
    pool is saturated; everything else is scheduled at once, never queued."""

    def __init__(self, detector: SaturationDetector) -> None:
        self.detector = detector

    async def run(self, request: InferenceRequest, candidates: list[Endpoint], schedule: ScheduleFn) -> SchedulingResult:
        if request.sheddable and self.detector.saturation(candidates) >= 1.0:
            raise EppError(Code.RESOURCE_EXHAUSTED, "system saturated, sheddable request dropped", reason="saturated")
        return schedule(request, candidates)
