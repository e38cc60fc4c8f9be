"""The effective configuration: what a loaded config runs with, every default spelled out.

Users of the reference complain that its defaults are silent (a profile handler, a picker, a
saturation detector, producers, a parser, a data layer and three flow-control policies appear out
of nowhere). `describe` lists them all: every plugin with the settings it holds and, for the ones
a default created, why; each profile's filters, weighted scorers and picker; the detector, the
data layer, the parser, flow control, the defaults applied and the warnings. `epp check-config
--effective` prints it as YAML and `epp serve` logs it at start (`-v=2`, the default level).

Plugin `settings` are the plugin's own attribute names and values (not the config's parameter
names): they show what the plugin holds after defaults and validation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import yaml

from epp.flowcontrol.config import BandConfig, FlowControlConfig
from epp.flowcontrol.gate import DispatchGate
from epp.plugin import Plugin

if TYPE_CHECKING:
    from epp.config.loader import LoadedConfig

_SCALARS = (bool, int, float, str)


def _plain(value: Any) -> Any:
    """A YAML-able view of a setting, or None to leave it out (callables, indexes, clocks)."""
    if value is None or isinstance(value, _SCALARS):
        return value
    if isinstance(value, Plugin):
        return value.name
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, _SCALARS) for v in value):
        items = list(value)
        return sorted(items) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return sorted(value)  # e.g. the extractor's engines: their names
    return None


def settings(plugin: Plugin) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in getattr(plugin, "__dict__", {}).items():
        if key.startswith("_") or key == "name" or callable(value):
            continue
        shown = _plain(value)
        if shown is not None:
            out[key] = shown
    return out


def _gate(gate: DispatchGate) -> dict[str, Any]:
    return {"queueDepthThreshold": gate.queue_depth_threshold, "kvCacheUtilThreshold": gate.kv_cache_util_threshold,
            "interTokenLatencyThreshold": gate.inter_token_latency_threshold,
            "inflightRequestsThreshold": gate.inflight_requests_threshold, "inflightGuard": gate.inflight_guard,
            "queuedTokensThreshold": gate.queued_tokens_threshold}


def _band(band: BandConfig, config: FlowControlConfig) -> dict[str, Any]:
    return {"priority": band.priority, "fairnessPolicy": band.fairness.name, "orderingPolicy": band.ordering.name,
            "maxBytes": band.max_bytes, "maxRequests": band.max_requests or "unlimited",
            "requestTTL": config.ttl(band) or "none", "shedWhenSaturated": band.shed_when_saturated,
            "dispatchGate": _gate(band.gate) if band.gate.active else "off",
            "slotFairness": band.slot_fairness, "newcomerReserve": band.newcomer_reserve}


def _flow_control(config: FlowControlConfig | None) -> Any:
    if config is None:
        return "off (the flowControl feature gate is off): sheddable requests are rejected with 429 " \
               "while the pool is saturated, everything else is scheduled at once"
    return {
        "maxBytes": config.max_bytes or "unlimited",
        "maxRequests": config.max_requests or "unlimited",
        "defaultRequestTTL": config.default_request_ttl or "none",
        "usageLimitPolicy": config.usage_limit.name,
        "evictSheddable": config.evict_sheddable,
        "vllmPriority": {"enabled": config.vllm_priority, "bandStride": config.vllm_priority_stride},
        "maxNumSeqs": config.max_num_seqs,
        "defaultPriorityBand": _band(config.default_band, config),
        "priorityBands": [_band(b, config) for _, b in sorted(config.bands.items(), reverse=True)],
    }


def describe(config: LoadedConfig) -> dict[str, Any]:
    plugins = []
    for name, plugin in config.plugins.items():
        entry: dict[str, Any] = {"name": name, "type": plugin.type}
        if name in config.injected:
            entry["injected"] = config.injected[name]
        values = settings(plugin)
        if values:
            entry["settings"] = values
        plugins.append(entry)
    profiles = []
    for profile in config.scheduler.profiles.values():
        profiles.append({
            "name": profile.name,
            "filters": [f.name for f in profile.filters],
            "scorers": [{"pluginRef": ws.scorer.name, "weight": ws.weight} for ws in profile.scorers],
            "picker": profile.picker.name if profile.picker is not None else None,
        })
    if config.data_layer is None:
        data_layer: Any = "off (dataLayer.sources is empty): no metrics are scraped"
    else:
        data_layer = {"sources": [{"pluginRef": b.source.name, "extractors": [e.name for e in b.extractors]}
                                  for b in config.data_layer]}
    return {
        "featureGates": sorted(config.feature_gates),
        "plugins": plugins,
        "schedulingProfiles": profiles,
        "profileHandler": config.scheduler.handler.name,
        "saturationDetector": getattr(config.saturation_detector, "name", type(config.saturation_detector).__name__),
        "dataLayer": data_layer,
        "parser": config.parser,
        "flowControl": _flow_control(config.flow_control_config),
        "defaultsApplied": list(config.defaults),
        "warnings": list(config.warnings),
    }


def to_yaml(description: dict[str, Any]) -> str:
    return yaml.safe_dump(description, sort_keys=False, default_flow_style=False, width=110)
