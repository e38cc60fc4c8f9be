"""What request control reports to the observability layer.

A structural protocol, like flow control's (`epp.flowcontrol.sink`): the director never imports
Prometheus, and the simulator passes its own recorder or nothing.
`epp.observability.metrics.EppMetrics` implements it with the reference's metric names.
"""

from __future__ import annotations

from typing import Protocol

from epp.api.request import InferenceRequest
from epp.api.response import Usage
from epp.datastore import Endpoint


class RequestMetricsSink(Protocol):
    def request_received(self, request: InferenceRequest) -> None:
        """A request with a body was parsed (counted before admission)."""

    def request_error(self, request: InferenceRequest, code: str) -> None:
        """A request ended with an error (`code` is an `epp.errors.Code` value)."""

    def scheduled(self, request: InferenceRequest, endpoint: Endpoint | None, seconds: float) -> None:
        """A scheduling cycle ended with a pick (or none); `seconds` is its wall time."""

    def running_changed(self, model: str, delta: int) -> None:
        """Requests running for `model` changed by `delta`."""

    def request_finished(self, request: InferenceRequest, usage: Usage | None, response_bytes: int,
                         elapsed: float) -> None:
        """A request was served without error; `elapsed` seconds from its arrival to its end."""

    def ttft_predicted(self, request: InferenceRequest, predicted: float, observed: float) -> None:
        """A streamed request's first token came `observed` seconds after its pick; the
        predicted-latency scorer had said `predicted`."""

    def slo_outcome(self, request: InferenceRequest, outcome: str) -> None:
        """A request with a TTFT objective `met` or `missed` it, or was `shed` for it."""

    def prefix_copied(self, request: InferenceRequest, credit_seconds: float, reason: str) -> None:
        """The pick copies a reused prefix to a pod without it, credited `credit_seconds` for
        what the copy saves the prefix's next requests; `reason` is `busy` (its holders' queue),
        `choice` / `young` (a second holder) or `faster` (a pod faster than the holders)."""

    def saturated_pick(self, request: InferenceRequest) -> None:
        """The pick was ranked on a saturated pool (every candidate's KV cache full with a queue):
        for the pool's throughput, on what each pod will compute again, copies of a held prefix
        charged as work the pool cannot absorb."""

    def ttft_bounded_pick(self, request: InferenceRequest) -> None:
        """The cheapest candidate was predicted to answer far later than the fastest (beyond
        `latency-scorer`'s TTFT bound), so the pick was made among those within it."""

    def overload_ranked_pick(self, request: InferenceRequest) -> None:
        """The pick was ranked in a shared decode overload (every candidate at its busy cap, the
        request's decode charge far above its TTFT): the earliest predicted first token, its own
        and those its prefill chunk delays, among the candidates whose costs are within the
        charge's noise of the cheapest."""

    def cold_prompts_reused(self, request: InferenceRequest, share: float) -> None:
        """At this pick, the share of the pool's recent cold prompts asked for again (the TTFT
        bound's gate)."""
