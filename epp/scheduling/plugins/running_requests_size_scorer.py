"""`running-requests-size-scorer`: prefer the endpoint with the fewest running requests (scraped).

Same min-max rule as `queue-scorer`, on `running_requests`: a smaller batch decodes faster.
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState, Scorer
from epp.scheduling.plugins._minmax import inverted_min_max


class RunningRequestsSizeScorer(Scorer):
    type = "running-requests-size-scorer"

    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        return inverted_min_max([ep.metrics.running_requests for ep in endpoints])
