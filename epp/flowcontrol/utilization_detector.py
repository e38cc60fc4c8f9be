"""`utilization-detector` (the default): saturation from scraped queue depth and KV-cache use.

Per endpoint a roofline, `max(queue / queueDepthThreshold, kv / kvCacheUtilThreshold)`; the pool
value is the mean over the candidates. An endpoint whose metrics are stale (older than
`metricsStalenessThreshold`, 200 ms by default, on the datastore's clock) or were never scraped
counts as full: we cannot vouch for it. As a Filter it keeps fresh endpoints below the thresholds
(scaled by `1 + headroom`) and fails open — if nothing would pass it returns every candidate,
leaving the decision to the scorers rather than rejecting traffic on a metrics hiccup.

An endpoint whose last scrape was *invalid* (`Endpoint.metrics_valid` is False: a value out of
bounds, e.g. a KV fraction of 1e308 or 85) counts exactly like a stale one: full, 1.0, and the
Filter removes it. Why full rather than left out of the mean: we hold no number we trust for it,
so it offers no headroom we could dispatch into, and counting it as full keeps the pool value
honest about the capacity we can use. Why it cannot shed the pool: its term is capped at 1.0
whatever it reported, so with N candidates it adds at most 1/N, and the mean reaches 1.0 only
when every other candidate is full too — never while another endpoint is idle. (Before the data
layer checked values, one pod's 1e308 became the pool's mean and every sheddable request was
rejected.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from epp.api.request import InferenceRequest
from epp.params import Params
from epp.datastore import Endpoint
from epp.flowcontrol.saturation import SATURATED, SaturationDetector
from epp.scheduling.framework import CycleState, Filter

if TYPE_CHECKING:
    from epp.plugin import PluginContext


class UtilizationDetector(Filter, SaturationDetector):
    type = "utilization-detector"

    def __init__(
        self,
        name: str = "",
        *,
        queue_depth_threshold: int = 5,
        kv_cache_util_threshold: float = 0.8,
        metrics_staleness_threshold: float = 0.2,
        headroom: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(name)
        self.queue_depth_threshold = queue_depth_threshold
        self.kv_cache_util_threshold = kv_cache_util_threshold
        self.metrics_staleness_threshold = metrics_staleness_threshold
        self.headroom = headroom
        self.clock = clock

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> UtilizationDetector:
        queue = params.int("queueDepthThreshold", 5, min=1)
        kv = params.float("kvCacheUtilThreshold", 0.8, min=0.0, min_exclusive=True, max=1.0)
        staleness = params.duration("metricsStalenessThreshold", 0.2)
        if staleness <= 0:
            raise params.error("metricsStalenessThreshold", "must be > 0")
        headroom = params.float("headroom", 0.0, min=0.0)
        params.done()
        return cls(
            name,
            queue_depth_threshold=queue,
            kv_cache_util_threshold=kv,
            metrics_staleness_threshold=staleness,
            headroom=headroom,
            clock=ctx.datastore.clock,
        )

    def _fresh(self, endpoint: Endpoint, now: float) -> bool:
        """Metrics we can vouch for: scraped, recently, and valid."""
        updated = endpoint.metrics.update_time
        return endpoint.metrics_valid and updated > 0.0 and now - updated <= self.metrics_staleness_threshold

    def endpoint_saturation(self, endpoint: Endpoint, now: float) -> float:
        if not self._fresh(endpoint, now):
            return SATURATED
        m = endpoint.metrics
        return max(m.waiting_queue_size / self.queue_depth_threshold, m.kv_cache_usage / self.kv_cache_util_threshold)

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return SATURATED
        now = self.clock()
        return sum(self.endpoint_saturation(ep, now) for ep in endpoints) / len(endpoints)

    def filter(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        now = self.clock()
        scale = 1.0 + self.headroom
        queue_limit = self.queue_depth_threshold * scale
        kv_limit = self.kv_cache_util_threshold * scale
        kept = [
            ep
            for ep in endpoints
            if self._fresh(ep, now)
            and ep.metrics.waiting_queue_size < queue_limit
            and ep.metrics.kv_cache_usage < kv_limit
        ]
        return kept or endpoints  # fail open
