"""`slo-headroom-tier-filter` (llm-d's name): keep the candidates predicted to meet the request's
latency objectives, with headroom.

A request that carries `x-slo-ttft-ms` (and optionally `x-slo-tpot-ms`) keeps only the candidates
whose predicted TTFT ≤ (1 − headroom) × objective (and predicted inter-token latency likewise).
When none qualifies, a sheddable request (priority < 0) is left with no candidate — the profile
fails and the request is shed with 429 before it costs a pod anything — and any other request
keeps every candidate, so the scorer sends it to the best one. Requests without objectives pass
untouched. Needs `predicted-latency-producer` (created if missing).

Parameters: `headroom` (0.1: a prediction must beat the objective by 10%),
`epsilonExploreNeg` (0.0: the share of requests that ignore the filter, so pods predicted to miss
still get traffic that corrects their model).

```yaml
plugins:
- type: slo-headroom-tier-filter
  parameters: {headroom: 0.1}
- type: latency-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: slo-headroom-tier-filter}, {pluginRef: latency-scorer}]
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.params import Params
from epp.scheduling.framework import CycleState, Filter, Plugin
from epp.scheduling.plugins._requires import unique_name
from epp.scheduling.plugins.predicted_latency_producer import PredictedLatencyProducer

if TYPE_CHECKING:
    import random

    from epp.plugin import PluginContext

# Cycle-state key of the filter's verdict, for the trace and the metrics: "met", "none" (nobody
# was predicted to meet it; a sheddable request is shed), or absent (no objective).
SLO_VERDICT = "slo-verdict"


class SloHeadroomTierFilter(Filter):
    type = "slo-headroom-tier-filter"

    def __init__(self, name: str = "", *, headroom: float = 0.1, explore: float = 0.0,
                 rng: random.Random | None = None) -> None:
        super().__init__(name)
        self.headroom = headroom
        self.explore = explore
        self.rng = rng
        self.producer: PredictedLatencyProducer | None = None

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> SloHeadroomTierFilter:
        headroom = params.float("headroom", 0.1, min=0.0, max=0.9)
        explore = params.float("epsilonExploreNeg", 0.0, min=0.0, max=1.0)
        params.done()
        return cls(name, headroom=headroom, explore=explore, rng=ctx.rng(name))

    def create_missing_producers(self, ctx: PluginContext) -> list[Plugin]:
        for plugin in ctx.plugins.values():
            if isinstance(plugin, PredictedLatencyProducer):
                self.producer = plugin
                return []
        producer = PredictedLatencyProducer(unique_name(PredictedLatencyProducer.type, ctx.plugins),
                                            datastore=ctx.datastore)
        self.producer = producer
        return [producer, *producer.create_missing_producers(ctx)]

    def filter(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        ttft_slo, tpot_slo = request.slo_ttft, request.slo_tpot
        if ttft_slo is None and tpot_slo is None:
            return endpoints
        if self.explore and self.rng is not None and self.rng.random() < self.explore:
            return endpoints
        keep = 1.0 - self.headroom
        predictions = cycle.predictions
        kept: list[Endpoint] = []
        for ep in endpoints:
            p = predictions.get(ep.address)
            if p is None:
                continue
            if ttft_slo is not None and p.ttft > keep * ttft_slo:
                continue
            if tpot_slo is not None and p.itl > keep * tpot_slo:
                continue
            kept.append(ep)
        if kept:
            cycle.data[SLO_VERDICT] = "met"
            return kept
        cycle.data[SLO_VERDICT] = "none"
        return [] if request.sheddable else endpoints
