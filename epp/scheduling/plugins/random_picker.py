"""`random-picker`: ignore the scores and take `maxNumOfEndpoints` endpoints uniformly at random."""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState
from epp.scheduling.plugins._picker import CountedPicker


class RandomPicker(CountedPicker):
    type = "random-picker"

    def pick(self, cycle: CycleState, request: InferenceRequest, scored: list[tuple[Endpoint, float]]) -> list[Endpoint]:
        count = min(self.max_endpoints, len(scored))
        return [ep for ep, _ in self.rng.sample(scored, count)]
