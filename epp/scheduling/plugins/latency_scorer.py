"""`latency-scorer` (llm-d's name): prefer the candidate predicted to answer first.

Score = best predicted TTFT among the candidates / this candidate's, so the fastest scores 1 and
a pod predicted twice as slow scores 0.5; with `max-score-picker` the lowest prediction wins and
candidates within `tieTolerance` of it tie (the picker breaks ties at random, so equally idle
pods share a burst). `tpotWeight` > 0 blends in the predicted inter-token latency the same way:
`score = (1 - w)·ttft part + w·itl part`. Predictions come from `predicted-latency-producer`
(created with default parameters when none is configured).

Parameters: `tpotWeight` (0.0), `tieTolerance` (0.02, relative).

```yaml
plugins:
- type: latency-scorer
  parameters: {tpotWeight: 0.0}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: latency-scorer}]
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.params import Params
from epp.scheduling.framework import CycleState, Plugin, Scorer
from epp.scheduling.plugins._requires import unique_name
from epp.scheduling.plugins.predicted_latency_producer import PredictedLatencyProducer

if TYPE_CHECKING:
    from epp.plugin import PluginContext

_FLOOR = 1e-4  # seconds: predictions below this are equal
_WORK_TIE = 1e-3  # how far apart tied candidates' scores are set by their work


class LatencyScorer(Scorer):
    type = "latency-scorer"

    def __init__(self, name: str = "", *, tpot_weight: float = 0.0, tie_tolerance: float = 0.02) -> None:
        super().__init__(name)
        self.tpot_weight = tpot_weight
        self.tie_tolerance = tie_tolerance
        self.producer: PredictedLatencyProducer | None = None

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> LatencyScorer:
        tpot = params.float("tpotWeight", 0.0, min=0.0, max=1.0)
        tolerance = params.float("tieTolerance", 0.02, min=0.0, max=1.0)
        params.done()
        return cls(name, tpot_weight=tpot, tie_tolerance=tolerance)

    def create_missing_producers(self, ctx: PluginContext) -> list[Plugin]:
        for plugin in ctx.plugins.values():
            if isinstance(plugin, PredictedLatencyProducer):
                self.producer = plugin
                return []
        producer = PredictedLatencyProducer(unique_name(PredictedLatencyProducer.type, ctx.plugins),
                                            datastore=ctx.datastore)
        self.producer = producer
        return [producer, *producer.create_missing_producers(ctx)]

    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        predictions = cycle.predictions
        found = [predictions.get(ep.address) for ep in endpoints]
        if None in found:
            return [0.0] * len(endpoints)
        costs = [c if c > _FLOOR else _FLOOR for c in [p.cost for p in found]]  # type: ignore[union-attr]
        scores = _relative(costs, self.tie_tolerance)
        # Among the candidates that tie, the one the pick costs least work (a cached prefix
        # rather than a second copy of it) wins; exact ties stay ties, for the picker's coin.
        tied = [i for i, v in enumerate(scores) if v == 1.0]
        if len(tied) > 1:
            most = max(found[i].work_seconds for i in tied) or 1.0  # type: ignore[union-attr]
            for i in tied:
                scores[i] = 1.0 - _WORK_TIE * found[i].work_seconds / most  # type: ignore[union-attr]
        w = self.tpot_weight
        if w > 0.0:
            itls = [max(_FLOOR, p.itl) for p in found]  # type: ignore[union-attr]
            scores = [(1.0 - w) * a + w * b for a, b in zip(scores, _relative(itls, self.tie_tolerance))]
        return scores


def _relative(values: list[float], tolerance: float) -> list[float]:
    """best / value, with everything within `tolerance` of the best scoring exactly 1."""
    best = min(values)
    limit = best * (1.0 + tolerance)
    return [1.0 if v <= limit else best / v for v in values]
