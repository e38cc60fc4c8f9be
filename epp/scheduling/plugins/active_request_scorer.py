"""`active-request-scorer` (llm-d's name): prefer the endpoint with the fewest requests *we* sent it.

`endpoint.inflight_requests` is the EPP's own exact accounting: incremented by request control the
moment a request is picked, decremented when its response ends. Scraped metrics are up to one
scrape interval old, so in a burst every endpoint looks alike to the queue scorer; this count
changes after every single pick, which is what spreads the burst (min-max over the candidates:
fewest in-flight scores 1.0, most scores 0.0, all equal scores 1.0).
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState, Scorer
from epp.scheduling.plugins._minmax import inverted_min_max


class ActiveRequestScorer(Scorer):
    type = "active-request-scorer"

    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        return inverted_min_max([ep.inflight_requests for ep in endpoints])
