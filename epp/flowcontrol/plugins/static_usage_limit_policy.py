"""`static-usage-limit-policy` (the default): one saturation ceiling for every band.

Parameter `threshold` (default 1.0, > 0): an endpoint whose saturation (from the configured
saturation detector) is at or above it takes no more queued requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epp.params import Params
from epp.flowcontrol.policy import UsageLimitPolicy

if TYPE_CHECKING:
    from epp.plugin import PluginContext


class StaticUsageLimitPolicy(UsageLimitPolicy):
    type = "static-usage-limit-policy"

    def __init__(self, name: str = "", *, threshold: float = 1.0) -> None:
        super().__init__(name)
        if threshold <= 0:
            raise ValueError("threshold must be > 0")
        self.threshold = threshold

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> StaticUsageLimitPolicy:
        threshold = params.float("threshold", 1.0, min=0.0, min_exclusive=True)
        params.done()
        return cls(name, threshold=threshold)

    def ceiling(self, priority: int) -> float:
        return self.threshold
