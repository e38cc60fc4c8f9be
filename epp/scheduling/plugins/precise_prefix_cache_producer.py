"""`precise-prefix-cache-producer`: which endpoint holds a prompt's prefix, from the engines' KV events.

The engines tell us what they cache (vLLM `--kv-events-config`); the data layer's subscriber writes
those events into a `KVBlockIndex` this plugin owns, and before scheduling (`prepare`) the plugin
looks the request's router keys up in it and leaves a `PrefixMatch` in the cycle state, which
`prefix-cache-scorer` reads when its `prefixMatchInfoProducerName` names this plugin (and the
predicted-latency scorer reads for its cache credit). Router keys come from the request's token
ids, which a `token-producer` computed before admission (`request.state`): this plugin does no
I/O and no tokenizing.

Endpoints that have sent no event yet, and requests without token ids (no token-producer, a
tokenizer timeout, an API it does not tokenize), fall back to an approximate index of the
plugin's own (`approx-prefix-cache-producer`'s, fed at every pick), and the `PrefixMatch` says
so per endpoint (`sources`) for the decision trace. With `speculativeIndexing` the picked
endpoint is credited with the request's blocks for `speculativeTTL`, so a burst with one prefix
follows the first request before its events arrive; events confirm the entries, or they expire.

Eviction foresight (`evictionForesight`): an engine publishes a step's events when the step ends,
so an index of events alone still credits a pod with a prefix its current step has just evicted
(in the simulator, at KV demand 1.5 on the B2B shape, about 2% of picks, many of them whole
documents). The plugin therefore keeps each pod's blocks in the order the engine will evict them
(stored, then used by a request the EPP sent there and freed when it ended) and the blocks the
requests already sent there will store; a pod whose cache is full (`cache_config_info` capacity
less the blocks cached and the running requests) is credited only with what survives those
allocations. The decision trace says when a pod lost credit this way;
`kvcache_index_foreseen_evictions_total` counts the blocks.

Parameters (llm-d's names; `kvEventsConfig` is described in `epp.datastore.kv_events_config`):

| parameter | default | meaning |
|---|---|---|
| `kvEventsConfig` | discovery mode, port 5557, topic filter `kv@` | where the events come from |
| `tokenProcessorConfig.blockSize` | 64 | tokens per router block (need not match the engine's) |
| `indexerConfig.kvBlockIndexConfig.inMemoryConfig.size` | 4,000,000 | router keys held, summed over endpoints |
| `indexerConfig.kvCacheBackendConfigs` | GPU 1.0, CPU 0.8, STORAGE 0.5 | credit per tier |
| `speculativeIndexing` / `speculativeTTL` | false / 2s | credit the picked endpoint before its events |
| `approximateFallback` | true | approximate index for endpoints without events |
| `evictionForesight` | true | credit only what a full cache keeps until the request is admitted |

```yaml
- type: token-producer
  parameters: {modelName: tiny, local: {path: /models/tiny}}
- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig: {zmqEndpoint: "tcp://*:5557", topicFilter: "kv@"}
    tokenProcessorConfig: {blockSize: 64}
    speculativeIndexing: true
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}
```
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from epp.api.preparer import TOKENIZED_PROMPT, TokenizedPrompt
from epp.api.request import InferenceRequest
from epp.api.response import Usage
from epp.datastore import Datastore, Endpoint
from epp.datastore.kv_block_index import TIERS, KVBlockIndex, chain_keys, chain_seed, router_keys, token_bytes
from epp.datastore.kv_events_config import KVEventsConfig
from epp.params import ConfigError, Params
from epp.scheduling.framework import CycleState, DataProducer, PreRequest, ResponseComplete, SchedulingResult
from epp.scheduling.plugins.approx_prefix_cache_producer import ApproxPrefixCacheProducer
from epp.scheduling.prefix_match import SOURCE_APPROXIMATE, SOURCE_PRECISE, PrefixMatch

if TYPE_CHECKING:
    from epp.plugin import PluginContext

log = logging.getLogger("epp.scheduling.precise")

DEFAULT_TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
_KEYS_STATE = "precise-prefix-keys"  # request.state: router keys computed once per request
RECENT_KEYS = 256  # prompts whose router keys are kept for the prompts that extend them


@dataclass(slots=True, frozen=True)
class PrecisePrefixConfig:
    events: KVEventsConfig
    block_size: int = 64
    max_keys: int = 4_000_000
    tier_weights: tuple[tuple[str, float], ...] = tuple(DEFAULT_TIER_WEIGHTS.items())
    speculative: bool = False
    speculative_ttl: float = 2.0
    approximate_fallback: bool = True
    eviction_foresight: bool = True

    @classmethod
    def from_params(cls, params: Params) -> PrecisePrefixConfig:
        events = KVEventsConfig.from_mapping(params.mapping("kvEventsConfig"), f"{params.path}.kvEventsConfig")
        tp = Params(params.mapping("tokenProcessorConfig"), f"{params.path}.tokenProcessorConfig")
        block_size = tp.int("blockSize", 64, min=1, max=4096)
        if tp.has("hashSeed"):  # llm-d aligned it with the engines' PYTHONHASHSEED; router keys need none
            tp.str("hashSeed", "")
            log.info("tokenProcessorConfig.hashSeed is ignored: router keys do not depend on the engine's hash")
        tp.done()
        max_keys, weights = _indexer_config(params.mapping("indexerConfig"), f"{params.path}.indexerConfig")
        config = cls(
            events=events,
            block_size=block_size,
            max_keys=max_keys,
            tier_weights=tuple(weights.items()),
            speculative=params.bool("speculativeIndexing", False),
            speculative_ttl=params.duration("speculativeTTL", 2.0),
            approximate_fallback=params.bool("approximateFallback", True),
            eviction_foresight=params.bool("evictionForesight", True),
        )
        params.done()
        return config


def _indexer_config(raw: dict[str, Any], path: str) -> tuple[int, dict[str, float]]:
    params = Params(raw, path)
    if params.has("tokenizersPoolConfig") or params.has("prefixStoreConfig"):
        key = "tokenizersPoolConfig" if params.has("tokenizersPoolConfig") else "prefixStoreConfig"
        raise params.error(key, "tokenization is configured on a token-producer plugin here")
    block_index = Params(params.mapping("kvBlockIndexConfig"), f"{path}.kvBlockIndexConfig")
    memory = Params(block_index.mapping("inMemoryConfig"), f"{path}.kvBlockIndexConfig.inMemoryConfig")
    size = memory.int("size", 4_000_000, min=1)
    memory.int("podCacheSize", 0, min=0)  # llm-d's per-key pod cap; every holder is kept here
    memory.done()
    block_index.bool("enableMetrics", True)  # always exported
    block_index.duration("metricsLoggingInterval", 0.0)
    block_index.done()
    weights = dict(DEFAULT_TIER_WEIGHTS)
    for i, entry in enumerate(params.list("kvCacheBackendConfigs")):
        item = Params(entry, f"{path}.kvCacheBackendConfigs[{i}]")
        name = item.str("name", "").upper()
        if name not in TIERS:
            raise ConfigError(f"{path}.kvCacheBackendConfigs[{i}].name: must be one of gpu, cpu, storage")
        weights[name] = item.float("weight", 1.0, min=0.0, max=1.0)
        item.done()
    params.done()
    return size, weights


class PrecisePrefixCacheProducer(DataProducer, PreRequest, ResponseComplete):
    type = "precise-prefix-cache-producer"

    def __init__(self, name: str = "", config: PrecisePrefixConfig | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        super().__init__(name)
        self.config = config or PrecisePrefixConfig(events=KVEventsConfig())
        c = self.config
        self.index = KVBlockIndex(c.block_size, max_keys=c.max_keys, speculative_ttl=c.speculative_ttl)
        self.weights = dict(c.tier_weights)
        self.clock = clock or (lambda: 0.0)
        self.approximate = ApproxPrefixCacheProducer(f"{self.name}/approximate") if c.approximate_fallback else None
        self._recent_keys: dict[tuple[int, int], list[int]] = {}  # (tokenization serial, seed) -> keys
        # Set by the runner: each lookup's (best, mean, std-dev) hit ratio, for llm-d's histograms.
        self.observer: Callable[[PrefixMatch], None] | None = None

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> PrecisePrefixCacheProducer:
        config = PrecisePrefixConfig.from_params(params)
        producer = cls(name, config, clock=ctx.datastore.clock)
        producer.attach(ctx.datastore)
        return producer

    def attach(self, datastore: Datastore) -> None:
        """Endpoints that leave the pool leave the index (and the fallback index)."""
        self.clock = datastore.clock
        datastore.subscribe(on_remove=lambda ep: self.index.remove_endpoint(ep.address))
        if self.approximate is not None:
            self.approximate.attach(datastore)

    # -- extension points --

    def keys(self, request: InferenceRequest) -> list[int] | None:
        """The request's router keys (computed once, kept in its state), or None without tokens."""
        keys = request.state.get(_KEYS_STATE)
        if keys is not None:
            return keys
        tokens = request.state.get(TOKENIZED_PROMPT)
        if not isinstance(tokens, TokenizedPrompt):
            return None
        keys = self._keys_of(tokens)
        request.state[_KEYS_STATE] = keys
        return keys

    def _keys_of(self, tokens: TokenizedPrompt) -> list[int]:
        """Router keys, reusing those of the cached prompt this one extends (a growing chat, a
        customer's shared context): only the blocks after the shared ids are hashed."""
        seed = chain_seed(tokens.lora_name, tokens.cache_salt)
        block = self.index.block_size
        cache = self._recent_keys
        prior = cache.get((tokens.prefix_serial, seed)) if tokens.prefix_serial else None
        if prior is not None:
            k = min(len(prior), tokens.shared_tokens // block)
            keys = prior[:k]
            keys += chain_keys(keys[-1] if k else seed, token_bytes(tokens.ids[k * block:]), block)[0]
        else:
            keys = router_keys(tokens.ids, block, seed)
        if tokens.serial:
            cache[(tokens.serial, seed)] = keys
            while len(cache) > RECENT_KEYS:
                cache.pop(next(iter(cache)))
        return keys

    def prepare(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> None:
        keys = self.keys(request)
        approx = None
        if self.approximate is not None and (keys is None or not all(self.index.has_events(ep.address)
                                                                      for ep in endpoints)):
            approx = self.approximate.lookup(request, endpoints)  # only when something falls back
            cycle.data[self.approximate.name] = approx
        if keys is None:
            match = self._approximate_only(approx, "no token ids for this request (no token-producer result)")
        else:
            match = self._precise(keys, endpoints, approx)
        cycle.data[self.name] = match
        if self.observer is not None:
            self.observer(match)

    def _precise(self, keys: list[int], endpoints: list[Endpoint], approx: PrefixMatch | None) -> PrefixMatch:
        found = self.index.match(keys, self.clock())
        block = self.index.block_size
        match = PrefixMatch(total=len(keys), block_size_tokens=block, matched={}, hashes=keys)
        fallback: list[str] = []
        foresight = self.config.eviction_foresight
        foreseen = 0
        for ep in endpoints:
            address = ep.address
            if self.index.has_events(address):
                n = found.matched.get(address, 0)
                match.sources[address] = SOURCE_PRECISE
                if n and foresight:
                    m = ep.metrics
                    kept = self.index.foresee(address, keys, n, m.cache_num_blocks * m.cache_block_size,
                                              m.running_requests)
                    if kept < n:
                        foreseen += 1
                        n = kept
                if n:
                    match.matched[address] = n
                    off = found.off_gpu.get(address)
                    if off:
                        match.tiers[address] = off
                        held_off = sum(off.values())
                        match.weighted[address] = (n - held_off) * self.weights.get("GPU", 1.0) + sum(
                            blocks * self.weights.get(tier, 0.0) for tier, blocks in off.items())
            else:
                match.sources[address] = SOURCE_APPROXIMATE
                fallback.append(address)
                if approx is not None and approx.total:
                    tokens = approx.matched.get(address, 0) * approx.block_size_tokens
                    n = min(len(keys), tokens // block)
                    if n:
                        match.matched[address] = n
        notes = []
        if fallback:
            notes.append(f"{len(fallback)} endpoint(s) without KV events use the approximate index")
        if foreseen:
            notes.append(f"{foreseen} endpoint(s) expected to evict part of the prefix before admitting it")
        match.note = "; ".join(notes)
        return match

    def _approximate_only(self, approx: PrefixMatch | None, why: str) -> PrefixMatch:
        if approx is None:
            return PrefixMatch(total=0, block_size_tokens=self.index.block_size, matched={}, note=why)
        return PrefixMatch(total=approx.total, block_size_tokens=approx.block_size_tokens,
                           matched=dict(approx.matched), hashes=approx.hashes,
                           sources={a: SOURCE_APPROXIMATE for a in approx.matched}, note=why)

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        primary = result.profiles.get(result.primary_profile)
        if primary is None or not primary.targets:
            return
        target = primary.targets[0].address
        keys = self.keys(request)
        if self.approximate is not None and (keys is None or not self.index.has_events(target)):
            self.approximate.pre_request(request, result)  # the fallback learns where prompts went
        if keys:
            now = self.clock()
            if self.config.eviction_foresight:
                self.index.dispatched(target, keys, now)
            if self.config.speculative:
                self.index.speculate(target, keys, now)

    def response_complete(self, request: InferenceRequest, endpoint: Endpoint | None, usage: Usage | None) -> None:
        if endpoint is not None and self.config.eviction_foresight:
            keys = request.state.get(_KEYS_STATE)
            if keys:
                self.index.released(endpoint.address, keys)
