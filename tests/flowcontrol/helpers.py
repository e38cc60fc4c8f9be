"""Builders for flow-control tests: a fake clock, a pool, requests, and a scheduler that accounts
its picks the way the director does (so gates that read our in-flight counts see them)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from epp.api.headers import SLO_TTFT
from epp.api.request import Api, InferenceRequest, slo_seconds
from epp.api.response import Usage
from epp.config.loader import load_config
from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.datastore.load import Outstanding
from epp.errors import Code, EppError
from epp.flowcontrol.config import FlowControlConfig
from epp.flowcontrol.controller import FlowController
from epp.flowcontrol.item import Ending, Outcome, QueueItem
from epp.flowcontrol.saturation import SaturationDetector
from epp.flowcontrol.utilization_detector import UtilizationDetector
from epp.scheduling.framework import ProfileResult, SchedulingResult
from epp.scheduling.prefix_match import PrefixMatch, held_tokens

_ids = itertools.count(1)

HEADER = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
"""


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def flow_config(text: str = "flowControl: {}\n") -> FlowControlConfig:
    """A `flowControl` section (plus optional `plugins:`) through the real config loader."""
    loaded = load_config(HEADER + text, Datastore())
    assert loaded.flow_control_config is not None
    return loaded.flow_control_config


class Pool:
    """Endpoints on a datastore with a fake clock; metrics are set fresh (as just scraped)."""

    def __init__(self, n: int = 1, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self.datastore = Datastore(clock=self.clock)
        for i in range(n):
            self.datastore.upsert(EndpointSpec(name=f"pod-{i}", ip=f"10.0.0.{i + 1}", port=8000))
        for ep in self.endpoints:
            self.scrape(ep)

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self.datastore.endpoints()

    def scrape(self, ep: Endpoint, **metrics: Any) -> None:
        """New scraped metrics for `ep`, taken now."""
        ep.update_metrics(replace(ep.metrics, update_time=self.clock(), **metrics))
        self.clock.advance(0.001)  # every scrape is a distinct instant


def detector(clock: Clock) -> SaturationDetector:
    """The default detector, with metrics that never go stale on the fake clock."""
    return UtilizationDetector(metrics_staleness_threshold=1e9, clock=clock)


def controller(pool: Pool, config: FlowControlConfig | str | None = None,
               saturation: SaturationDetector | None = None, sink: Any = None) -> FlowController:
    if not isinstance(config, FlowControlConfig):
        config = flow_config(config) if config else flow_config()
    return FlowController(config, saturation or detector(pool.clock), pool.datastore.endpoints, pool.clock, sink)


def request(flow: str = "default-flow", *, priority: int = 0, prompt: str = "x" * 40, max_tokens: int | None = None,
            size: int = 100, headers: dict[str, str] | None = None, model: str = "m") -> InferenceRequest:
    return InferenceRequest(
        request_id=f"r{next(_ids)}", api=Api.COMPLETIONS, model=model, target_model=model,
        body={"model": model, "prompt": prompt}, prompt=prompt.encode(), max_tokens=max_tokens,
        headers=headers or {}, priority=priority, fairness_id=flow, body_size=size,
        slo_ttft=slo_seconds(headers or {}, SLO_TTFT),
    )


@dataclass
class Scheduler:
    """Picks the candidate with the fewest in-flight requests and counts the pick at once, as the
    director does. Given a clock it also books the pick in the endpoint's ledger (its prefill
    predicted to end `prefill_seconds` after the one ahead), less a `prefix` the cycle's prefix
    producer would claim (tokens held per address)."""

    calls: list[list[str]] = field(default_factory=list)
    fail: EppError | None = None
    clock: Callable[[], float] | None = None
    prefill_seconds: float = 1.0
    prefix: dict[str, int] = field(default_factory=dict)
    booked: list[Outstanding] = field(default_factory=list)  # ledger entries, in pick order

    def __call__(self, req: InferenceRequest, candidates: list[Endpoint]) -> SchedulingResult:
        self.calls.append([ep.address for ep in candidates])
        if self.fail is not None:
            raise self.fail
        ep = min(candidates, key=lambda e: (e.inflight_requests, e.address))
        ep.inflight_requests += 1
        result = SchedulingResult("default", {"default": ProfileResult(targets=[ep], candidates=list(candidates))})
        if self.prefix:
            result.cycle.data["approx-prefix-cache-producer"] = PrefixMatch(
                total=req.prompt_tokens_estimate, block_size_tokens=1, matched=dict(self.prefix))
        if self.clock is not None:
            now = self.clock()
            ahead = ep.load.pending[-1].expected_done - now if ep.load.pending else 0.0
            prompt = req.prompt_tokens_estimate
            entry = Outstanding(prompt, min(prompt - 1, held_tokens(result.cycle.data, ep.address)), 1, now,
                                predicted_ttft=max(0.0, ahead) + self.prefill_seconds)
            ep.load.add(entry, now)
            self.booked.append(entry)
        return result


def item(req: InferenceRequest, schedule: Scheduler, allowed: Sequence[str] | None = None) -> QueueItem:
    return QueueItem(req, schedule, frozenset(allowed) if allowed is not None else None)


def finish(fc: FlowController, it: QueueItem, usage: Usage | None = None) -> None:
    """The request ended at its endpoint: release the pick (the director's job) and tell flow control."""
    assert it.endpoint is not None
    it.endpoint.inflight_requests -= 1
    fc.complete(it, usage)


def dispatched(endings: list[Ending]) -> list[QueueItem]:
    return [e.item for e in endings if e.outcome is Outcome.DISPATCHED and e.error is None]


def flows_of(items: list[QueueItem]) -> list[str]:
    return [i.request.fairness_id for i in items]


def assert_empty(fc: FlowController) -> None:
    """Nothing held: no queued request, byte, flow, TTL entry or in-flight slot anywhere."""
    assert len(fc) == 0 and fc.queued_bytes == 0 and fc.inflight == 0 and len(fc.slots) == 0
    assert fc.next_deadline() is None
    for band in fc.bands():
        assert band.count == 0 and band.bytes == 0 and len(band.queue) == 0 and len(band.arrivals) == 0
        assert band.flows == {}, band.flows


def scheduler_failure() -> EppError:
    return EppError(Code.RESOURCE_EXHAUSTED, "failed to find target endpoint", reason="scheduler")


class RecordingSink:
    """A FlowMetricsSink that keeps the running totals the gauges would show."""

    def __init__(self) -> None:
        self.queued: dict[tuple[str, int], list[int]] = {}
        self.done: list[tuple[str, str]] = []
        self.rejected: list[tuple[str, int]] = []

    def flow_queue_changed(self, fairness_id: str, priority: int, model: str, target_model: str,
                           requests: int, size: int) -> None:
        held = self.queued.setdefault((fairness_id, priority), [0, 0])
        held[0] += requests
        held[1] += size

    def flow_request_done(self, fairness_id: str, priority: int, model: str, target_model: str,
                          outcome: str, seconds: float) -> None:
        self.done.append((fairness_id, outcome))

    def flow_rejected(self, reason: str, priority: int) -> None:
        self.rejected.append((reason, priority))

    def flow_enqueue_duration(self, fairness_id: str, priority: int, outcome: str, seconds: float) -> None:
        pass

    def flow_dispatch_cycle(self, seconds: float) -> None:
        pass
