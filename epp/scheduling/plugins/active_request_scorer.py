"""`active-request-scorer` (llm-d's name): prefer the endpoint with the fewest requests *we* sent it.

`endpoint.inflight_requests` is the EPP's own exact accounting: incremented by request control the
moment a request is picked, decremented when its response ends. Scraped metrics are up to one
scrape interval old, so in a burst every endpoint looks alike to the queue scorer; this count
changes after every single pick, which is what spreads the burst.

Score = 1 - n / max_n over the candidates (all idle: 1.0). Unlike min-max, a difference of one
request between two busy pods is a small difference in score: 5 vs 6 in flight is 0.17 apart, not
a full point. In a burst from idle the swing is still total (0 vs 1 in flight), so requests
spread; under steady load a good prefix match can win over a small imbalance, which is what keeps
multi-turn chats on the pod that holds their cache.
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState, Scorer


class ActiveRequestScorer(Scorer):
    type = "active-request-scorer"

    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        counts = [ep.inflight_requests for ep in endpoints]
        most = max(counts, default=0)
        if most <= 0:
            return [1.0] * len(counts)
        return [1.0 - n / most for n in counts]
