"""Admission: whether a request may be scheduled now.

`Admission.run` wraps scheduling so that flow control can hold a request in its queues and
dispatch it later (late binding), while the legacy controller decides at once. The director
tells the admission when an admitted request ends (`completed`, with the response's usage), and
asks it for body fields to set on the request forwarded to the chosen endpoint (`body_fields`,
e.g. vLLM `priority`, written only for an engine that has the field).

In a pool of several engines a native API (TGI's or SGLang's `/generate`) can only be served by
its engine, so both admissions first narrow the candidates to the endpoints whose engine serves
the request's API (`eligible`); the OpenAI APIs are served by every engine. `engine_of` says
which engine an endpoint runs; the composition root sets the data layer's resolver (the
`core-metrics-extractor`'s label key and default engine) so that metrics, APIs and body fields
agree on it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from epp.api.engines import DEFAULT_ENGINE, ENGINE_LABEL_KEY
from epp.api.request import InferenceRequest
from epp.api.response import Usage
from epp.datastore import Endpoint
from epp.datastore.endpoint import with_valid_metrics
from epp.errors import Code, EppError
from epp.flowcontrol.saturation import SaturationDetector
from epp.scheduling.framework import SchedulingResult

ScheduleFn = Callable[[InferenceRequest, list[Endpoint]], SchedulingResult]
EngineOf = Callable[[Endpoint], str]


def default_engine_of(endpoint: Endpoint) -> str:
    """The engine an endpoint runs: its engine-type label, else what discovery said, else vLLM
    (the same order as the `core-metrics-extractor` with its default parameters)."""
    return endpoint.labels.get(ENGINE_LABEL_KEY) or endpoint.spec.engine or DEFAULT_ENGINE


class RejectionSink(Protocol):
    def flow_rejected(self, reason: str, priority: int) -> None: ...


class Admission(ABC):
    engine_of: EngineOf = staticmethod(default_engine_of)

    @abstractmethod
    async def run(self, request: InferenceRequest, candidates: list[Endpoint], schedule: ScheduleFn) -> SchedulingResult:
        """Schedule `request` when it is admitted; raise `EppError` when it is shed.

        `schedule` is called at most once, with the candidates the request may use now, and
        accounts the pick at once (so a cancelled caller's pick can still be released)."""

    async def start(self) -> None:
        """Start background work (the flow-control dispatch loop)."""

    async def stop(self) -> None:
        """Stop background work; requests still waiting end with an error."""

    def progressed(self) -> None:
        """An admitted request streamed its first byte: its pod's prefill queue moved."""

    def left_pod(self, request: InferenceRequest) -> None:
        """A request `run` admitted has left its pod (its response is over); `completed`, with
        its usage, follows."""

    def completed(self, request: InferenceRequest, usage: Usage | None) -> None:
        """A request `run` admitted has ended (any way); `usage` when the server reported it."""

    def body_fields(self, request: InferenceRequest, endpoint: Endpoint) -> dict[str, Any]:
        """Fields to set in the body of an admitted request forwarded to `endpoint` (its pick);
        empty: forward as sent."""
        return {}

    def eligible(self, request: InferenceRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        """The candidates whose engine serves the request's API; 503 when none does."""
        engines = request.api.engines
        if engines is None:
            return candidates
        kept = [ep for ep in candidates if self.engine_of(ep) in engines]
        if not kept:
            raise EppError(
                Code.SERVICE_UNAVAILABLE,
                f"no endpoint serves the {request.api.value} API (needs engine {' or '.join(sorted(engines))})",
                reason="no_compatible_endpoints",
            )
        return kept


class LegacyAdmission(Admission):
    """The reference's default: sheddable requests (priority < 0) are rejected with 429 while the
    pool is saturated; everything else is scheduled at once, never queued.

    Endpoints whose last scrape was invalid are left out of the pick (unless every candidate is);
    flow control leaves them out through the detector, which counts them as full."""

    def __init__(self, detector: SaturationDetector, metrics: RejectionSink | None = None) -> None:
        self.detector = detector
        self.metrics = metrics

    async def run(self, request: InferenceRequest, candidates: list[Endpoint], schedule: ScheduleFn) -> SchedulingResult:
        candidates = self.eligible(request, candidates)
        if request.sheddable and self.detector.saturation(candidates) >= 1.0:
            if self.metrics is not None:
                self.metrics.flow_rejected("saturated", request.priority)
            raise EppError(Code.RESOURCE_EXHAUSTED, "system saturated, sheddable request dropped", reason="saturated")
        return schedule(request, with_valid_metrics(candidates))
