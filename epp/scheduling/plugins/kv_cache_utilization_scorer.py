"""`kv-cache-utilization-scorer`: `1 - kv_cache_usage`, so emptier KV caches score higher.

Absolute, not min-max: a pool that is uniformly full gives every endpoint a low score, which keeps
this scorer's pull proportional to real headroom.
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState, Scorer


class KvCacheUtilizationScorer(Scorer):
    type = "kv-cache-utilization-scorer"

    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        return [1.0 - ep.metrics.kv_cache_usage for ep in endpoints]
