"""The `flowControl` config section, validated into `FlowControlConfig` (reference §5.3 + ours).

Reference fields: `maxBytes`, `maxRequests` (Kubernetes quantities), `defaultRequestTTL`,
`defaultPriorityBand`, `priorityBands[] {priority, maxBytes, maxRequests, defaultRequestTTL,
fairnessPolicyRef, orderingPolicyRef}`, `usageLimitPolicyPluginRef`.

Ours (a GIE config never has them, so it behaves as in the reference):
- `priorityBands[].dispatchGate` / `defaultPriorityBand.dispatchGate`: per-band endpoint
  thresholds, see `gate.DispatchGate` — `queueDepthThreshold`, `queuedTokensThreshold`,
  `kvCacheUtilThreshold`, `interTokenLatencyThreshold` (a duration), `inflightRequestsThreshold`,
  `inflightGuard`.
- `priorityBands[].shedWhenSaturated`: reject this band's requests with 429 at once while the pool
  is saturated (the legacy behaviour) instead of queueing them. Default false (the reference
  queues sheddable requests under flow control).
- `evictSheddable` (default true): when a *global* limit is full, a new request may push out the
  newest queued request of a lower, sheddable (negative-priority) band, which ends with 429.
  Without it, a full queue of batch work would turn away interactive traffic.
- `vllmPriority: {enabled, bandStride}`: write vLLM's `priority` into dispatched bodies:
  `-band priority × bandStride + n`, where n (from 0, at most bandStride − 1) counts the
  requests of the same flow already in flight on the chosen endpoint (see `slots.py`).
- `maxNumSeqs` (default 256, vLLM's): running slots per endpoint for batch-slot fairness
  (vLLM does not export it; raised per endpoint by the most running requests a scrape shows).
- `priorityBands[].slotFairness` / `defaultPriorityBand.slotFairness` (default false): while
  another flow of the band waits, a flow holding its fair share of an endpoint's slots gets no
  new dispatch there. `newcomerReserve` (default 0): slots per endpoint kept for flows with
  nothing there, which may also pass the band's closed dispatch gate into them (`slots.py`).

Every error names the field path, e.g. `flowControl.priorityBands[1].maxBytes: invalid quantity`.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from epp.params import ConfigError, Params, parse_duration
from epp.flowcontrol.gate import DispatchGate
from epp.flowcontrol.policy import FairnessPolicy, OrderingPolicy, UsageLimitPolicy
from epp.flowcontrol.quantity import parse_quantity
from epp.flowcontrol.slots import DEFAULT_MAX_NUM_SEQS, MAX_SLOTS
from epp.plugin import Plugin

DEFAULT_BAND_MAX_BYTES = 1_000_000_000  # the reference's per-band default (1 GB) when 0 or omitted
DEFAULT_BAND_STRIDE = 1000

P = TypeVar("P", bound=Plugin)
# (plugin name, field path, wanted kind) -> the plugin; raises ConfigError. The loader supplies it.
Resolver = Callable[[str, str, type[P]], P]


@dataclass(slots=True)
class BandConfig:
    priority: int
    fairness: FairnessPolicy
    ordering: OrderingPolicy
    max_bytes: int = DEFAULT_BAND_MAX_BYTES
    max_requests: int = 0  # 0: unlimited
    request_ttl: float | None = None  # None: flowControl.defaultRequestTTL
    gate: DispatchGate = field(default_factory=DispatchGate)
    shed_when_saturated: bool = False
    slot_fairness: bool = False  # hold back a flow over its share of an endpoint's slots while others wait
    newcomer_reserve: int = 0  # slots per endpoint for flows with nothing there

    @property
    def slotted(self) -> bool:
        """Whether this band's dispatches consult the slot ledger."""
        return self.slot_fairness or self.newcomer_reserve > 0


@dataclass(slots=True)
class FlowControlConfig:
    default_band: BandConfig  # template for priorities without their own entry
    usage_limit: UsageLimitPolicy
    max_bytes: int = 0  # 0: unlimited
    max_requests: int = 0  # 0: unlimited
    default_request_ttl: float = 0.0  # 0: no TTL, a request waits until its client gives up
    bands: dict[int, BandConfig] = field(default_factory=dict)
    evict_sheddable: bool = True
    vllm_priority: bool = False
    vllm_priority_stride: int = DEFAULT_BAND_STRIDE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS

    def band(self, priority: int) -> BandConfig:
        """The configuration of a priority's band (from the template when it has none)."""
        found = self.bands.get(priority)
        return found if found is not None else replace(self.default_band, priority=priority)

    def ttl(self, band: BandConfig) -> float:
        return self.default_request_ttl if band.request_ttl is None else band.request_ttl


class _Section(Params):
    """`Params` plus the value kinds flow control needs."""

    def quantity(self, key: builtins.str, default: builtins.int) -> builtins.int:
        value = self._get(key)
        if value is None:
            return default
        try:
            return parse_quantity(value)
        except ValueError as exc:
            raise self.error(key, builtins.str(exc)) from None

    def optional_duration(self, key: builtins.str) -> builtins.float | None:
        value = self._get(key)
        if value is None:
            return None
        try:
            return parse_duration(value)
        except ValueError as exc:
            raise self.error(key, builtins.str(exc)) from None

    def section(self, key: builtins.str) -> _Section | None:
        value = self._get(key)
        if value is None:
            return None
        return _Section(value, f"{self.path}.{key}")

    def required_int(self, key: builtins.str) -> builtins.int:
        if not self.has(key):
            raise self.error(key, "required")
        return self.int(key, 0)


def parse_flow_control(raw: dict[str, Any] | None, resolve: Resolver, *, defaults: dict[str, str]) -> FlowControlConfig:
    """Validate the `flowControl` mapping. `defaults` names the plugins used when a ref is omitted
    (keys "fairness", "ordering", "usageLimit")."""
    top = _Section(raw or {}, "flowControl")
    max_bytes = top.quantity("maxBytes", 0)
    max_requests = top.quantity("maxRequests", 0)
    ttl = top.duration("defaultRequestTTL", 0.0)
    usage_ref = top.str("usageLimitPolicyPluginRef", "") or defaults["usageLimit"]
    usage = resolve(usage_ref, "flowControl.usageLimitPolicyPluginRef", UsageLimitPolicy)
    evict = top.bool("evictSheddable", True)

    base = BandConfig(
        priority=0,
        fairness=resolve(defaults["fairness"], "flowControl.defaultPriorityBand.fairnessPolicyRef", FairnessPolicy),
        ordering=resolve(defaults["ordering"], "flowControl.defaultPriorityBand.orderingPolicyRef", OrderingPolicy),
    )
    template_section = top.section("defaultPriorityBand")
    template = base if template_section is None else _band(template_section, base, resolve, template=True)

    bands: dict[int, BandConfig] = {}
    for i, entry in enumerate(top.list("priorityBands")):
        section = _Section(entry, f"flowControl.priorityBands[{i}]")
        band = _band(section, template, resolve, template=False)
        if band.priority in bands:
            raise section.error("priority", f"duplicate priority band {band.priority}")
        bands[band.priority] = band

    vllm_priority, stride = False, DEFAULT_BAND_STRIDE
    vllm = top.section("vllmPriority")
    if vllm is not None:
        vllm_priority = vllm.bool("enabled", True)
        stride = vllm.int("bandStride", DEFAULT_BAND_STRIDE, min=1)
        vllm.done()
    max_num_seqs = top.int("maxNumSeqs", DEFAULT_MAX_NUM_SEQS, min=1, max=MAX_SLOTS)
    for path, band in [("defaultPriorityBand", template)] + [
            (f"priorityBands[{i}]", b) for i, b in enumerate(bands.values())]:
        if band.newcomer_reserve >= max_num_seqs:
            raise ConfigError(f"flowControl.{path}.newcomerReserve: must be below maxNumSeqs ({max_num_seqs})")
    top.done()
    return FlowControlConfig(
        default_band=template, usage_limit=usage, max_bytes=max_bytes, max_requests=max_requests,
        default_request_ttl=ttl, bands=bands, evict_sheddable=evict, vllm_priority=vllm_priority,
        vllm_priority_stride=stride, max_num_seqs=max_num_seqs,
    )


def _band(s: _Section, base: BandConfig, resolve: Resolver, *, template: bool) -> BandConfig:
    priority = s.int("priority", base.priority) if template else s.required_int("priority")
    max_bytes = s.quantity("maxBytes", 0) or base.max_bytes
    max_requests = s.quantity("maxRequests", base.max_requests)
    request_ttl = s.optional_duration("defaultRequestTTL")
    fairness_ref = s.str("fairnessPolicyRef", "")
    ordering_ref = s.str("orderingPolicyRef", "")
    fairness = resolve(fairness_ref, f"{s.path}.fairnessPolicyRef", FairnessPolicy) if fairness_ref else base.fairness
    ordering = resolve(ordering_ref, f"{s.path}.orderingPolicyRef", OrderingPolicy) if ordering_ref else base.ordering
    gate_section = s.section("dispatchGate")
    gate = base.gate if gate_section is None else _gate(gate_section)
    shed = s.bool("shedWhenSaturated", base.shed_when_saturated)
    slot_fairness = s.bool("slotFairness", base.slot_fairness)
    reserve = s.int("newcomerReserve", base.newcomer_reserve, min=0, max=MAX_SLOTS)
    if (slot_fairness or reserve) and not fairness.orders_flows:
        key = "slotFairness" if slot_fairness else "newcomerReserve"
        raise s.error(key, f"needs a fairness policy that takes turns between flows (round-robin-fairness-policy, "
                           f"token-fairness-policy); {fairness.name!r} (type {fairness.type}) serves one order across "
                           "flows, so a flow held back would hold back the ones queued behind it")
    s.done()
    return BandConfig(
        priority=priority, fairness=fairness, ordering=ordering, max_bytes=max_bytes, max_requests=max_requests,
        request_ttl=base.request_ttl if request_ttl is None else request_ttl, gate=gate, shed_when_saturated=shed,
        slot_fairness=slot_fairness, newcomer_reserve=reserve,
    )


def _gate(s: _Section) -> DispatchGate:
    queue = s.int("queueDepthThreshold", 0, min=1) or None
    kv = s.float("kvCacheUtilThreshold", 0.0, min=0.0, min_exclusive=True) or None
    itl = s.optional_duration("interTokenLatencyThreshold")
    if itl is not None and itl <= 0:
        raise s.error("interTokenLatencyThreshold", "must be > 0")
    inflight = s.int("inflightRequestsThreshold", 0, min=1) or None
    guard = s.bool("inflightGuard", True)
    tokens = s.int("queuedTokensThreshold", 0, min=1) or None
    s.done()
    return DispatchGate(queue_depth_threshold=queue, kv_cache_util_threshold=kv,
                        inter_token_latency_threshold=itl, inflight_requests_threshold=inflight,
                        inflight_guard=guard, queued_tokens_threshold=tokens)


def check_plugin(plugin: Plugin, path: str, kind: type[P]) -> P:
    """For resolvers: the plugin if it is of the wanted kind, else a ConfigError naming both."""
    if not isinstance(plugin, kind):
        wanted = {FairnessPolicy: "a fairness policy", OrderingPolicy: "an ordering policy",
                  UsageLimitPolicy: "a usage-limit policy"}.get(kind, kind.__name__)
        raise ConfigError(f"{path}: {plugin.name!r} (type {plugin.type}) is not {wanted}")
    return plugin
