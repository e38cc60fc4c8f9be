"""The scheduling framework: the extension points plugins implement.

One request runs one *cycle*: the profile handler chooses profiles; each profile runs its filters in
order, adds up its weighted scorers (each score clamped to [0, 1], no normalisation by total
weight) and lets its picker choose; the handler then turns the profile results into the final
`SchedulingResult`. This is the reference EPP's shape, so its configs map one to one.

Plugins never do I/O: they read `Endpoint` objects (scraped metrics plus our own in-flight counts)
and per-cycle scratch state. Request-lifecycle hooks (`PreRequest`, `ResponseComplete`) let
stateful plugins such as the prefix index learn from each decision.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from epp.api.request import InferenceRequest
from epp.api.response import Usage
from epp.datastore import Endpoint
from epp.plugin import Plugin, PluginContext
from epp.scheduling.prediction import Prediction

__all__ = ["Plugin", "PluginContext"]  # re-exported: plugins import their bases from here


@dataclass(slots=True)
class CycleState:
    """Scratch space for one scheduling cycle, keyed by plugin name (e.g. prefix match counts).

    `predictions` (endpoint address -> `Prediction`) is filled by the predicted-latency producer
    and read by its scorer and filter, the decision trace and the ledger."""

    data: dict[str, Any] = field(default_factory=dict)
    predictions: dict[str, Prediction] = field(default_factory=dict)


class Filter(Plugin):
    @abstractmethod
    def filter(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        """Return the endpoints that may serve the request (a sub-list, order kept)."""


class Scorer(Plugin):
    @abstractmethod
    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        """One score per endpoint, aligned with `endpoints`; values outside [0, 1] are clamped."""


class Picker(Plugin):
    @abstractmethod
    def pick(self, cycle: CycleState, request: InferenceRequest, scored: list[tuple[Endpoint, float]]) -> list[Endpoint]:
        """Choose the targets, best first (primary, then fallbacks)."""


class DataProducer(Plugin):
    """Runs once per cycle before any profile, to compute what scorers share (e.g. prefix match)."""

    @abstractmethod
    def prepare(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> None: ...

    def depends_on(self) -> list[str]:
        """Names of the producers whose output this one reads: they run first."""
        return []


class PreRequest(Plugin):
    """Called after a successful pick, before the request is forwarded."""

    @abstractmethod
    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None: ...


class ResponseReceived(Plugin):
    """Called when the response headers arrive; returns headers to add to the response.

    `served` is the endpoint the proxy reports as having served the request
    (`envoy.lb / x-gateway-destination-endpoint-served`), or "" when it sent none.
    """

    @abstractmethod
    def response_received(self, request: InferenceRequest, served: str) -> dict[str, str]: ...


class ResponseComplete(Plugin):
    """Called once when a request has ended (success, error or abort), with the usage its
    response reported (None when it reported none)."""

    @abstractmethod
    def response_complete(self, request: InferenceRequest, endpoint: Endpoint | None, usage: Usage | None) -> None: ...


@dataclass(slots=True)
class ProfileResult:
    """What one profile chose, and why (kept for the decision trace)."""

    targets: list[Endpoint]
    candidates: list[Endpoint] = field(default_factory=list)  # after the filters
    scores: dict[str, list[float]] = field(default_factory=dict)  # scorer name -> raw scores
    total: list[float] = field(default_factory=list)  # weighted sum per candidate
    filtered_by: str = ""  # the filter that left nothing, when the profile failed


@dataclass(slots=True)
class SchedulingResult:
    primary_profile: str
    profiles: dict[str, ProfileResult]
    # The cycle that produced it: what the producers computed for this request, which the
    # request-lifecycle hooks (`PreRequest`) read instead of keeping tables of their own.
    cycle: CycleState = field(default_factory=CycleState)

    @property
    def targets(self) -> list[Endpoint]:
        return self.profiles[self.primary_profile].targets

    @property
    def primary(self) -> Endpoint:
        return self.targets[0]


class ProfileHandler(Plugin):
    @abstractmethod
    def pick_profiles(
        self,
        cycle: CycleState,
        request: InferenceRequest,
        profiles: dict[str, SchedulerProfile],
        results: dict[str, ProfileResult | None],
    ) -> dict[str, SchedulerProfile]:
        """Profiles to run next; an empty dict ends the cycle."""

    @abstractmethod
    def process_results(
        self, cycle: CycleState, request: InferenceRequest, results: dict[str, ProfileResult | None]
    ) -> SchedulingResult:
        """Turn the profiles' results into the decision; raise `EppError` when there is none."""


@dataclass(slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float = 1.0


@dataclass(slots=True)
class SchedulerProfile:
    name: str
    filters: list[Filter] = field(default_factory=list)
    scorers: list[WeightedScorer] = field(default_factory=list)
    picker: Picker | None = None
