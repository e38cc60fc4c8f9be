"""`core-metrics-extractor`: engine metric mappings chosen per endpoint (reference §6.1).

Parameters (names as in the reference):
  defaultEngine    engine for endpoints without an engine (default "vllm")
  engineLabelKey   pod label naming the engine (default "inference.networking.k8s.io/engine-type")
  engineConfigs    list of {name, queuedRequestsSpec, runningRequestsSpec, kvUsageSpec, loraSpec,
                   cacheInfoSpec, cacheBlockSizeLabelName, cacheNumBlocksLabelName,
                   cacheBlockSizeSpec, cacheNumBlocksSpec, interTokenLatencySpec}
                   (`interTokenLatencySpec` is ours: a histogram base name whose `_sum`/`_count`
                   give the mean inter-token latency per scrape window, for flow control's gate)
An `engineConfigs` entry replaces the whole built-in entry of the same name (so a vLLM override
loses the `gpu_cache_usage_perc` fallback); an omitted or empty spec turns that metric off.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from epp.params import Params
from epp.datalayer.engines import (
    BUILTIN_ENGINES,
    DEFAULT_ENGINE,
    ENGINE_LABEL_KEY,
    RESERVED_ENGINE_NAME,
    EngineMapping,
    specs,
)
from epp.datalayer.extract import Extraction, extract_metrics
from epp.datalayer.promparse import PageMemory
from epp.datastore import Endpoint
from epp.plugin import Plugin

if TYPE_CHECKING:
    from epp.plugin import PluginContext

# engineConfigs field → EngineMapping field, for spec-valued fields.
_SPEC_FIELDS = (
    ("queuedRequestsSpec", "queued"),
    ("runningRequestsSpec", "running"),
    ("kvUsageSpec", "kv_usage"),
    ("loraSpec", "lora"),
    ("cacheInfoSpec", "cache_info"),
    ("cacheBlockSizeSpec", "cache_block_size"),
    ("cacheNumBlocksSpec", "cache_num_blocks"),
    ("interTokenLatencySpec", "itl"),
)


class CoreMetricsExtractor(Plugin):
    type = "core-metrics-extractor"

    def __init__(self, name: str = "", *, default_engine: str = DEFAULT_ENGINE,
                 engine_label_key: str = ENGINE_LABEL_KEY,
                 engines: Mapping[str, EngineMapping] | None = None) -> None:
        super().__init__(name)
        table = dict(BUILTIN_ENGINES)
        table.update(engines or {})
        if RESERVED_ENGINE_NAME in table:
            raise ValueError(f"engine name {RESERVED_ENGINE_NAME!r} is reserved")
        if default_engine not in table:
            raise ValueError(f"defaultEngine {default_engine!r} is not a known engine ({', '.join(sorted(table))})")
        self.engines: Mapping[str, EngineMapping] = MappingProxyType(table)
        self.default_engine = default_engine
        self.engine_label_key = engine_label_key
        self._default = table[default_engine]

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> CoreMetricsExtractor:
        default_engine = params.str("defaultEngine", DEFAULT_ENGINE) or DEFAULT_ENGINE
        label_key = params.str("engineLabelKey", ENGINE_LABEL_KEY) or ENGINE_LABEL_KEY
        engines: dict[str, EngineMapping] = {}
        for i, raw in enumerate(params.list("engineConfigs")):
            mapping = _engine_from_config(Params(raw, f"{params.path}.engineConfigs[{i}]"))
            if mapping.name in engines:
                raise params.error(f"engineConfigs[{i}].name", f"duplicate engine {mapping.name!r}")
            engines[mapping.name] = mapping
        params.done()
        known = set(BUILTIN_ENGINES) | set(engines)
        if default_engine not in known:
            known_list = ", ".join(sorted(known))
            raise params.error("defaultEngine", f"unknown engine {default_engine!r} (known: {known_list})")
        return cls(name, default_engine=default_engine, engine_label_key=label_key, engines=engines)

    def engine_of(self, endpoint: Endpoint) -> str:
        """The engine an endpoint asks for: its pod label, else the discovered engine, else the default."""
        return endpoint.labels.get(self.engine_label_key) or endpoint.spec.engine or self.default_engine

    def mapping_for(self, engine: str) -> EngineMapping:
        """The mapping for an engine name; unknown engines use the default engine's (as the reference)."""
        return self.engines.get(engine) or self._default

    def extract(self, endpoint: Endpoint, body: bytes, now: float, memory: PageMemory | None = None) -> Extraction:
        """Metrics for `endpoint` from a scrape body, on top of its current ones.

        `memory` is the caller's per-endpoint `promparse.PageMemory`."""
        return extract_metrics(self.mapping_for(self.engine_of(endpoint)), body, endpoint.metrics, now, memory)


def _engine_from_config(params: Params) -> EngineMapping:
    name = params.str("name", "")
    if not name:
        raise params.error("name", "required")
    if name == RESERVED_ENGINE_NAME:
        raise params.error("name", f"{name!r} is reserved")
    fields: dict[str, Any] = {}
    for key, attr in _SPEC_FIELDS:
        text = params.str(key, "")
        try:
            fields[attr] = specs(text)
        except ValueError as exc:
            raise params.error(key, str(exc)) from None
    fields["cache_block_size_label"] = params.str("cacheBlockSizeLabelName", "") or "block_size"
    fields["cache_num_blocks_label"] = params.str("cacheNumBlocksLabelName", "") or "num_gpu_blocks"
    params.done()
    return EngineMapping(name=name, **fields)

