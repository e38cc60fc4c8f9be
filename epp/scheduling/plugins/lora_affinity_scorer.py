"""`lora-affinity-scorer`: prefer endpoints where the requested LoRA adapter is (or can be) loaded.

Cases in the reference's order: adapter running 1.0; a free adapter slot 0.8; adapter waiting 0.6;
otherwise 0. Loading an adapter costs time, and a full slot set means queueing behind others.
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState, Scorer

ACTIVE = 1.0
FREE_SLOT = 0.8
WAITING = 0.6


class LoraAffinityScorer(Scorer):
    type = "lora-affinity-scorer"

    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        model = request.target_model
        scores: list[float] = []
        for ep in endpoints:
            m = ep.metrics
            if model in m.active_models:
                scores.append(ACTIVE)
            elif len(m.active_models) + len(m.waiting_models) < m.max_active_models:
                scores.append(FREE_SLOT)
            elif model in m.waiting_models:
                scores.append(WAITING)
            else:
                scores.append(0.0)
        return scores
