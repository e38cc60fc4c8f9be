"""`concurrency-detector`: saturation from the EPP's own in-flight accounting, not scraped metrics.

Counts what we dispatched and have not seen finish (requests, or tokens with
`concurrencyMode: tokens`) against a per-endpoint limit. Exact and never stale, so it suits model
servers without useful metrics. Pool saturation = total in-flight / total capacity of the
candidates. As a Filter it drops endpoints at `limit * (1 + headroom)` or above and does not fail
open: a full endpoint really is full.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from epp.api.request import InferenceRequest
from epp.params import Params
from epp.datastore import Endpoint
from epp.flowcontrol.saturation import SATURATED, SaturationDetector
from epp.scheduling.framework import CycleState, Filter

if TYPE_CHECKING:
    from epp.plugin import PluginContext

MODES = ("requests", "tokens")


class ConcurrencyDetector(Filter, SaturationDetector):
    type = "concurrency-detector"

    def __init__(
        self,
        name: str = "",
        *,
        mode: str = "requests",
        max_concurrency: int = 100,
        max_token_concurrency: int = 1_000_000,
        headroom: float = 0.0,
    ) -> None:
        super().__init__(name)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.mode = mode
        self.max_concurrency = max_concurrency
        self.max_token_concurrency = max_token_concurrency
        self.headroom = headroom

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> ConcurrencyDetector:
        mode = params.str("concurrencyMode", "requests", choices=MODES)
        max_requests = params.int("maxConcurrency", 100, min=1)
        max_tokens = params.int("maxTokenConcurrency", 1_000_000, min=1)
        headroom = params.float("headroom", 0.0, min=0.0)
        params.done()
        return cls(name, mode=mode, max_concurrency=max_requests, max_token_concurrency=max_tokens, headroom=headroom)

    @property
    def limit(self) -> int:
        return self.max_token_concurrency if self.mode == "tokens" else self.max_concurrency

    def _inflight(self, endpoint: Endpoint) -> int:
        return endpoint.inflight_tokens if self.mode == "tokens" else endpoint.inflight_requests

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return SATURATED
        return sum(self._inflight(ep) for ep in endpoints) / (self.limit * len(endpoints))

    def filter(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[Endpoint]:
        ceiling = self.limit * (1.0 + self.headroom)
        return [ep for ep in endpoints if self._inflight(ep) < ceiling]
