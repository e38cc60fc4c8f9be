"""`prefix-cache-scorer`: fraction of the prompt's blocks an endpoint probably has cached.

Score = matched blocks / total blocks (tier-weighted when the producer says some are held off the
GPU), read from the `PrefixMatch` its producer put in the cycle state; 0 when the prompt has no
blocks. The scorer itself is stateless.

`prefixMatchInfoProducerName` (llm-d's name) names the producer to read, e.g.
`precise-prefix-cache-producer` (KV events); it must be a configured plugin that writes a
`PrefixMatch`. Without it the scorer reads the configured `approx-prefix-cache-producer`, or one
created with default parameters (the reference's behaviour). The reference's docs put the
approximate producer's parameters (`blockSizeTokens`, `maxPrefixBlocksToMatch`,
`lruCapacityPerServer`, ...) on this scorer; they are accepted here too and configure a producer
of the scorer's own (not together with `prefixMatchInfoProducerName`).

```yaml
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epp.api.request import InferenceRequest
from epp.params import ConfigError, Params
from epp.datastore import Endpoint
from epp.scheduling.framework import CycleState, DataProducer, Plugin, Scorer
from epp.scheduling.plugins._requires import unique_name
from epp.scheduling.plugins.approx_prefix_cache_producer import (
    PARAMETER_NAMES,
    ApproxPrefixCacheProducer,
    PrefixCacheConfig,
)
from epp.scheduling.prefix_match import PrefixMatch

if TYPE_CHECKING:
    from epp.plugin import PluginContext

# Producer types that write a `PrefixMatch` under their name.
PREFIX_MATCH_PRODUCERS = ("approx-prefix-cache-producer", "precise-prefix-cache-producer")


class PrefixCacheScorer(Scorer):
    type = "prefix-cache-scorer"

    def __init__(
        self,
        name: str = "",
        producer: DataProducer | None = None,
        producer_config: PrefixCacheConfig | None = None,
        producer_name: str = "",
    ) -> None:
        super().__init__(name)
        self.producer = producer
        self.producer_config = producer_config  # parameters given on the scorer (docs style)
        self.producer_name = producer_name  # prefixMatchInfoProducerName

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> PrefixCacheScorer:
        config = PrefixCacheConfig.from_params(params)
        producer_name = params.str("prefixMatchInfoProducerName", "")
        params.done()
        given = any(params.has(key) for key in PARAMETER_NAMES)
        if producer_name and given:
            raise params.error("prefixMatchInfoProducerName", "names a producer; its parameters go on that "
                               "producer, not on the scorer")
        return cls(name, producer_config=config if given else None, producer_name=producer_name)

    def create_missing_producers(self, ctx: PluginContext) -> list[Plugin]:
        if self.producer is not None:
            return []
        if self.producer_name:
            plugin = ctx.plugins.get(self.producer_name)
            if plugin is None:
                raise ConfigError(f"plugins: {self.name!r}.prefixMatchInfoProducerName: no plugin named "
                                  f"{self.producer_name!r} (defined: {', '.join(ctx.plugins)})")
            if not isinstance(plugin, DataProducer) or plugin.type not in PREFIX_MATCH_PRODUCERS:
                raise ConfigError(f"plugins: {self.name!r}.prefixMatchInfoProducerName: {self.producer_name!r} "
                                  f"(type {plugin.type}) does not produce prefix-match info; use one of "
                                  f"{', '.join(PREFIX_MATCH_PRODUCERS)}")
            self.producer = plugin
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
