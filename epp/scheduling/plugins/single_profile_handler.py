"""`single-profile-handler`: run the one configured profile; it is the primary.

A profile that found no endpoint (a filter left nothing) ends the request with 429, as the
reference does ("failed to find target endpoint: ...").
"""

from __future__ import annotations

from epp.api.request import InferenceRequest
from epp.errors import Code, EppError
from epp.scheduling.framework import (
    CycleState,
    ProfileHandler,
    ProfileResult,
    SchedulerProfile,
    SchedulingResult,
)


class SingleProfileHandler(ProfileHandler):
    type = "single-profile-handler"

    def pick_profiles(
        self,
        cycle: CycleState,
        request: InferenceRequest,
        profiles: dict[str, SchedulerProfile],
        results: dict[str, ProfileResult | None],
    ) -> dict[str, SchedulerProfile]:
        if len(results) >= len(profiles):  # everything ran in an earlier round
            return {}
        return profiles

    def process_results(
        self, cycle: CycleState, request: InferenceRequest, results: dict[str, ProfileResult | None]
    ) -> SchedulingResult:
        if len(results) != 1:
            raise EppError(
                Code.INTERNAL,
                "single profile handler is intended to be used with a single profile, "
                f"got {len(results)} profile results",
                reason="scheduler_misconfigured",
            )
        (name, result), = results.items()
        if result is None:
            raise EppError(
                Code.RESOURCE_EXHAUSTED,
                f"failed to find target endpoint: failed to run scheduler profile '{name}'",
                reason="no_endpoint",
            )
        return SchedulingResult(primary_profile=name, profiles={name: result})
