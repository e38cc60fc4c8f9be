"""Runs one scheduling cycle over a candidate list. Pure computation: no I/O, no awaits."""

from __future__ import annotations

import time
from collections.abc import Callable

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.errors import Code, EppError
from epp.scheduling.framework import (
    CycleState,
    DataProducer,
    Plugin,
    ProfileHandler,
    ProfileResult,
    SchedulerProfile,
    SchedulingResult,
)

# (extension point, plugin, seconds): how long one plugin call took, for the metrics.
PluginTimer = Callable[[str, Plugin, float], None]


def run_profile(
    profile: SchedulerProfile,
    cycle: CycleState,
    request: InferenceRequest,
    candidates: list[Endpoint],
    timer: PluginTimer | None = None,
) -> ProfileResult:
    """Filters in order, then the weighted sum of scores, then the picker."""
    clock = time.perf_counter
    endpoints = candidates
    for flt in profile.filters:
        start = clock()
        endpoints = flt.filter(cycle, request, endpoints)
        if timer:
            timer("Filter", flt, clock() - start)
        if not endpoints:
            return ProfileResult(targets=[], filtered_by=flt.name)
    total = [0.0] * len(endpoints)
    scores: dict[str, list[float]] = {}
    for weighted in profile.scorers:
        start = clock()
        raw = weighted.scorer.score(cycle, request, endpoints)
        if timer:
            timer("Scorer", weighted.scorer, clock() - start)
        scores[weighted.scorer.name] = raw
        weight = weighted.weight
        for i, value in enumerate(raw):  # clamped to [0, 1]; NaN or negative adds nothing
            if value != value or value < 0.0:
                continue
            total[i] += weight * (1.0 if value > 1.0 else value)
    assert profile.picker is not None, f"profile {profile.name} has no picker"
    start = clock()
    targets = profile.picker.pick(cycle, request, list(zip(endpoints, total)))
    if timer:
        timer("Picker", profile.picker, clock() - start)
    return ProfileResult(targets=targets, candidates=endpoints, scores=scores, total=total)


class Scheduler:
    """Holds the configured profiles and runs cycles through the profile handler."""

    def __init__(
        self,
        profiles: dict[str, SchedulerProfile],
        handler: ProfileHandler,
        producers: list[DataProducer] | None = None,
    ) -> None:
        if not profiles:
            raise ValueError("a scheduler needs at least one profile")
        self.profiles = profiles
        self.handler = handler
        self.producers = producers or []
        self.timer: PluginTimer | None = None  # set by the runner to export plugin durations

    def schedule(self, request: InferenceRequest, candidates: list[Endpoint]) -> SchedulingResult:
        """Pick targets among `candidates`. Raises `EppError` when nothing can serve it."""
        if not candidates:
            raise EppError(
                Code.SERVICE_UNAVAILABLE,
                "failed to find endpoint candidates for serving the request",
                reason="no_candidates",
            )
        cycle = CycleState()
        timer = self.timer
        for producer in self.producers:
            if timer is None:
                producer.prepare(cycle, request, candidates)
                continue
            start = time.perf_counter()
            producer.prepare(cycle, request, candidates)
            timer("PrepareData", producer, time.perf_counter() - start)
        results: dict[str, ProfileResult | None] = {}
        while True:
            chosen = self.handler.pick_profiles(cycle, request, self.profiles, results)
            if not chosen:
                break
            for name, profile in chosen.items():
                result = run_profile(profile, cycle, request, candidates, self.timer)
                results[name] = result if result.targets else None
                if not result.targets:
                    cycle.data.setdefault("failed_profiles", {})[name] = result.filtered_by
        result = self.handler.process_results(cycle, request, results)
        result.cycle = cycle
        return result
