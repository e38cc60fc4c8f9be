"""`prefix-cache-scorer`: fraction of the prompt's blocks an endpoint probably has cached.

Score = matched blocks / total blocks, read from the `PrefixMatch` its producer
(`approx-prefix-cache-producer`) put in the cycle state; 0 when the prompt has no blocks. The
scorer itself is stateless. If no producer is configured one is created with default parameters
(the reference's behaviour). The reference's docs put the producer's parameters (`blockSizeTokens`,
`maxPrefixBlocksToMatch`, `lruCapacityPerServer`, ...) on this scorer; they are accepted here too
and configure a producer of the scorer's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epp.api.request import InferenceRequest
from epp.params import Params
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState, Plugin, Scorer
from epp.scheduling.plugins._requires import unique_name
from epp.scheduling.plugins.approx_prefix_cache_producer import (
    PARAMETER_NAMES,
    ApproxPrefixCacheProducer,
    PrefixCacheConfig,
)
from epp.scheduling.prefix_match import PrefixMatch

if TYPE_CHECKING:
    from epp.plugin import PluginContext


class PrefixCacheScorer(Scorer):
    type = "prefix-cache-scorer"

    def __init__(
        self,
        name: str = "",
        producer: ApproxPrefixCacheProducer | None = None,
        producer_config: PrefixCacheConfig | None = None,
    ) -> None:
        super().__init__(name)
        self.producer = producer
        self.producer_config = producer_config  # parameters given on the scorer (docs style)

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> PrefixCacheScorer:
        config = PrefixCacheConfig.from_params(params)
        params.done()
        given = any(params.has(key) for key in PARAMETER_NAMES)
        return cls(name, producer_config=config if given else None)

    def create_missing_producers(self, ctx: PluginContext) -> list[Plugin]:
        if self.producer is not None:
            return []
        if self.producer_config is None:
            for plugin in ctx.plugins.values():
                if isinstance(plugin, ApproxPrefixCacheProducer):
                    self.producer = plugin
                    return []
        name = unique_name(ApproxPrefixCacheProducer.type, ctx.plugins)
        producer = ApproxPrefixCacheProducer(name, self.producer_config)
        producer.attach(ctx.datastore)
        self.producer = producer
        return [producer]

    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        match = cycle.data.get(self.producer.name) if self.producer is not None else None
        if not isinstance(match, PrefixMatch) or not match.total:
            return [0.0] * len(endpoints)
        return [match.ratio(ep.address) for ep in endpoints]
