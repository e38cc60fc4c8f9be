"""`max-score-picker`: the highest total score wins; ties are broken uniformly at random.

Shuffle first, then a stable sort by score: equal scores keep their shuffled order. Without the
shuffle a burst of requests seeing equal (stale) scores would all land on the first endpoint.
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState
from epp.scheduling.plugins._picker import CountedPicker


def _score(item: tuple[Endpoint, float]) -> float:
    return item[1]


class MaxScorePicker(CountedPicker):
    type = "max-score-picker"

    def pick(self, cycle: CycleState, request: InferenceRequest, scored: list[tuple[Endpoint, float]]) -> list[Endpoint]:
        if self.max_endpoints == 1 and scored:
            best = max(score for _, score in scored)
            tied = [ep for ep, score in scored if score == best]
            return [tied[0] if len(tied) == 1 else self.rng.choice(tied)]
        items = list(scored)
        self.rng.shuffle(items)
        items.sort(key=_score, reverse=True)  # stable, also with reverse=True
        return [ep for ep, _ in items[: self.max_endpoints]]
