"""`weighted-random-picker`: choose in proportion to score (A-Res weighted sampling).

Each endpoint draws key `U ** (1 / score)` with U uniform in (0, 1]; the top keys win. This samples
without replacement with probability proportional to score, so load spreads while better endpoints
are still favoured. A zero score gets key 0 (never chosen before a positive one); if every score is
zero the choice is plain random.
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState
from epp.scheduling.plugins._picker import CountedPicker


def _key(item: tuple[Endpoint, float]) -> float:
    return item[1]


class WeightedRandomPicker(CountedPicker):
    type = "weighted-random-picker"

    def pick(self, cycle: CycleState, request: InferenceRequest, scored: list[tuple[Endpoint, float]]) -> list[Endpoint]:
        count = min(self.max_endpoints, len(scored))
        if all(score <= 0.0 for _, score in scored):
            return [ep for ep, _ in self.rng.sample(scored, count)]
        rand = self.rng.random
        keyed = [(ep, (1.0 - rand()) ** (1.0 / score) if score > 0.0 else 0.0) for ep, score in scored]
        self.rng.shuffle(keyed)  # zero keys tie: keep that tie random too
        keyed.sort(key=_key, reverse=True)
        return [ep for ep, _ in keyed[:count]]
