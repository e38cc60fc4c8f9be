"""`token-load-scorer`: `1 - min(1, inflight_tokens / queueThresholdTokens)`.

Uses the EPP's own in-flight token count (added at pick time, removed at response end), so it is
exact and fresh, unlike scraped metrics; long prompts weigh more than short ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epp.api.request import InferenceRequest
from epp.params import Params
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState, Scorer

if TYPE_CHECKING:
    from epp.plugin import PluginContext

DEFAULT_QUEUE_THRESHOLD_TOKENS = 4 * 1024 * 1024


class TokenLoadScorer(Scorer):
    type = "token-load-scorer"

    def __init__(self, name: str = "", queue_threshold_tokens: int = DEFAULT_QUEUE_THRESHOLD_TOKENS) -> None:
        super().__init__(name)
        self.queue_threshold_tokens = queue_threshold_tokens

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> TokenLoadScorer:
        threshold = params.int("queueThresholdTokens", DEFAULT_QUEUE_THRESHOLD_TOKENS, min=1)
        params.done()
        return cls(name, threshold)

    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        limit = float(self.queue_threshold_tokens)
        return [1.0 - min(1.0, ep.inflight_tokens / limit) for ep in endpoints]
