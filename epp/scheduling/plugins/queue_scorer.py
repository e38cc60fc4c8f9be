"""`queue-scorer`: prefer the endpoint with the shortest *scraped* waiting queue.

Exactly the reference formula (min-max of `waiting_queue_size`, all equal -> 1.0) so GIE configs
score the same. The scraped queue lags by up to one scrape interval, so within a burst every
candidate looks equal; the EPP's own exact in-flight count (`active-request-scorer`, counted at
pick time) is what spreads such a burst. The default profile therefore weighs both — see
`epp.config.loader`.
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState, Scorer
from epp.scheduling.plugins._minmax import inverted_min_max


class QueueScorer(Scorer):
    type = "queue-scorer"

    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        return inverted_min_max([ep.metrics.waiting_queue_size for ep in endpoints])
