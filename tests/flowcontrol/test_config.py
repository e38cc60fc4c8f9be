"""The `flowControl` section, the policy plugin types, quantities and the objectives file."""

from __future__ import annotations

import pytest

from epp.config.loader import load_config
from epp.params import ConfigError
from epp.datastore import Datastore
from epp.flowcontrol.config import DEFAULT_BAND_MAX_BYTES
from epp.flowcontrol.gate import DispatchGate
from epp.flowcontrol.objectives import load_objectives_file, parse_objectives
from epp.flowcontrol.plugins import (
    FcfsOrderingPolicy,
    GlobalStrictFairnessPolicy,
    RoundRobinFairnessPolicy,
    SloDeadlineOrderingPolicy,
    StaticUsageLimitPolicy,
    TokenFairnessPolicy,
)
from epp.flowcontrol.quantity import parse_quantity

from .helpers import HEADER, flow_config

FULL = """\
plugins:
- {type: token-fairness-policy, name: tokens, parameters: {outputTokenWeight: 3, defaultOutputTokens: 128}}
- type: slo-deadline-ordering-policy
- {type: static-usage-limit-policy, name: limit, parameters: {threshold: 0.9}}
flowControl:
  maxBytes: 2Gi
  maxRequests: 10k
  defaultRequestTTL: 30s
  usageLimitPolicyPluginRef: limit
  evictSheddable: false
  vllmPriority: {enabled: true, bandStride: 50}
  defaultPriorityBand:
    maxRequests: 100
    fairnessPolicyRef: round-robin-fairness-policy
  priorityBands:
  - priority: 100
    maxBytes: 500M
    fairnessPolicyRef: tokens
    orderingPolicyRef: slo-deadline-ordering-policy
    dispatchGate: {queueDepthThreshold: 3, interTokenLatencyThreshold: 150ms, inflightRequestsThreshold: 16}
  - priority: -10
    defaultRequestTTL: 2m
    shedWhenSaturated: true
    dispatchGate: {queueDepthThreshold: 1, kvCacheUtilThreshold: 0.5, inflightGuard: false}
"""


def test_a_full_section() -> None:
    fc = flow_config(FULL)
    assert (fc.max_bytes, fc.max_requests, fc.default_request_ttl) == (2 * 2**30, 10_000, 30.0)
    assert isinstance(fc.usage_limit, StaticUsageLimitPolicy) and fc.usage_limit.ceiling(0) == 0.9
    assert not fc.evict_sheddable and fc.vllm_priority and fc.vllm_priority_stride == 50
    chat, batch = fc.bands[100], fc.bands[-10]
    assert isinstance(chat.fairness, TokenFairnessPolicy) and chat.fairness.output_token_weight == 3
    assert isinstance(chat.ordering, SloDeadlineOrderingPolicy)
    assert (chat.max_bytes, chat.max_requests, fc.ttl(chat)) == (500_000_000, 100, 30.0)
    assert chat.gate == DispatchGate(queue_depth_threshold=3, inter_token_latency_threshold=0.15,
                                     inflight_requests_threshold=16)
    assert isinstance(batch.fairness, RoundRobinFairnessPolicy) and isinstance(batch.ordering, FcfsOrderingPolicy)
    assert batch.max_bytes == DEFAULT_BAND_MAX_BYTES and fc.ttl(batch) == 120.0 and batch.shed_when_saturated
    assert batch.gate == DispatchGate(queue_depth_threshold=1, kv_cache_util_threshold=0.5, inflight_guard=False)
    other = fc.band(7)  # a priority without its own entry: the template
    assert other.priority == 7 and other.max_requests == 100 and isinstance(other.fairness, RoundRobinFairnessPolicy)
    assert other.gate == DispatchGate() and not other.gate.active


def test_defaults_match_the_reference() -> None:
    loaded = load_config(HEADER, Datastore())
    fc = loaded.flow_control_config
    assert fc is not None and loaded.flow_control == {}
    band = fc.band(0)
    assert isinstance(band.fairness, GlobalStrictFairnessPolicy) and isinstance(band.ordering, FcfsOrderingPolicy)
    assert band.max_bytes == DEFAULT_BAND_MAX_BYTES and band.max_requests == 0
    assert (fc.max_bytes, fc.max_requests, fc.default_request_ttl) == (0, 0, 0.0)
    assert fc.usage_limit.ceiling(0) == 1.0 and fc.evict_sheddable and not fc.vllm_priority
    assert {"global-strict-fairness-policy", "fcfs-ordering-policy", "static-usage-limit-policy"} <= set(loaded.plugins)


def test_the_gate_off_means_no_flow_control() -> None:
    loaded = load_config("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
                         "flowControl: {maxRequests: 5}\n", Datastore())
    assert loaded.flow_control_config is None


def test_a_ref_to_an_unlisted_policy_type_creates_it() -> None:
    fc = flow_config("flowControl:\n  defaultPriorityBand: {fairnessPolicyRef: token-fairness-policy}\n")
    assert isinstance(fc.default_band.fairness, TokenFairnessPolicy)


@pytest.mark.parametrize("section, message", [
    ("flowControl: {maxBytes: lots}", "flowControl.maxBytes: invalid quantity 'lots'"),
    ("flowControl: {maxRequests: -1}", "flowControl.maxRequests: invalid quantity -1: negative"),
    ("flowControl: {defaultRequestTTL: soon}", "flowControl.defaultRequestTTL: invalid duration 'soon'"),
    ("flowControl: {maxQueue: 1}", "flowControl.maxQueue: unknown field"),
    ("flowControl: {priorityBands: [{maxBytes: 1}]}", "flowControl.priorityBands[0].priority: required"),
    ("flowControl: {priorityBands: [{priority: 1}, {priority: 1}]}",
     "flowControl.priorityBands[1].priority: duplicate priority band 1"),
    ("flowControl: {priorityBands: [{priority: 1, fairnessPolicyRef: nope}]}",
     "flowControl.priorityBands[0].fairnessPolicyRef: no plugin named 'nope'"),
    ("flowControl: {priorityBands: [{priority: 1, fairnessPolicyRef: fcfs-ordering-policy}]}",
     "flowControl.priorityBands[0].fairnessPolicyRef: 'fcfs-ordering-policy' (type fcfs-ordering-policy) "
     "is not a fairness policy"),
    ("flowControl: {defaultPriorityBand: {orderingPolicyRef: round-robin-fairness-policy}}",
     "flowControl.defaultPriorityBand.orderingPolicyRef: 'round-robin-fairness-policy' (type "
     "round-robin-fairness-policy) is not an ordering policy"),
    ("flowControl: {usageLimitPolicyPluginRef: fcfs-ordering-policy}",
     "flowControl.usageLimitPolicyPluginRef: 'fcfs-ordering-policy' (type fcfs-ordering-policy) is not a "
     "usage-limit policy"),
    ("flowControl: {priorityBands: [{priority: 1, dispatchGate: {queueDepthThreshold: 0}}]}",
     "flowControl.priorityBands[0].dispatchGate.queueDepthThreshold: must be >= 1"),
    ("flowControl: {priorityBands: [{priority: 1, dispatchGate: {interTokenLatencyThreshold: 0s}}]}",
     "flowControl.priorityBands[0].dispatchGate.interTokenLatencyThreshold: must be > 0"),
    ("flowControl: {priorityBands: [{priority: 1, dispatchGate: {kvCacheUtilThreshold: 0}}]}",
     "flowControl.priorityBands[0].dispatchGate.kvCacheUtilThreshold: must be > 0.0"),
    ("flowControl: {priorityBands: [{priority: 1, dispatchGate: {queueDepth: 3}}]}",
     "flowControl.priorityBands[0].dispatchGate.queueDepth: unknown field"),
    ("flowControl: {priorityBands: [{priority: x}]}", "flowControl.priorityBands[0].priority: must be an integer"),
    ("flowControl: {priorityBands: {priority: 1}}", "flowControl.priorityBands: must be a list"),
    ("flowControl: {vllmPriority: {bandStride: 0}}", "flowControl.vllmPriority.bandStride: must be >= 1"),
    ("flowControl: {evictSheddable: maybe}", "flowControl.evictSheddable: must be true or false"),
    ("plugins: [{type: static-usage-limit-policy, parameters: {threshold: 0}}]\nflowControl: {}",
     "plugins[0].parameters.threshold: must be > 0.0"),
    ("plugins: [{type: token-fairness-policy, parameters: {inputTokenWeight: 0, outputTokenWeight: 0}}]\n"
     "flowControl: {}", "outputTokenWeight: inputTokenWeight and outputTokenWeight cannot both be 0"),
])
def test_errors_name_the_field(section: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(HEADER + section + "\n", Datastore())
    assert message in str(info.value)


@pytest.mark.parametrize("value, expected", [
    (4096, 4096), ("4096", 4096), ("1k", 1000), ("1Ki", 1024), ("1.5Gi", 3 * 2**29), ("500M", 500_000_000),
    ("1e3", 1000), ("2E2", 200), ("100m", 1), ("0", 0), (" 7 ", 7),
])
def test_quantities(value: object, expected: int) -> None:
    assert parse_quantity(value) == expected


@pytest.mark.parametrize("value", ["", "1Kb", "-5", "1.2.3", "Gi", True, None, [1]])
def test_bad_quantities(value: object) -> None:
    with pytest.raises(ValueError):
        parse_quantity(value)


OBJECTIVES = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: chat}
spec: {priority: 10, poolRef: {name: pool}}
---
apiVersion: v1
kind: List
items:
- apiVersion: inference.networking.x-k8s.io/v1alpha2
  kind: InferenceObjective
  metadata: {name: batch}
  spec: {priority: -1}
- apiVersion: inference.networking.x-k8s.io/v1alpha2
  kind: InferenceObjective
  metadata: {name: default}
  spec: {}
- apiVersion: inference.networking.x-k8s.io/v1alpha2
  kind: InferenceObjective
  metadata: {name: theirs}
  spec: {priority: 99, poolRef: {name: other-pool}}
"""


def test_objectives_file_into_the_datastore(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "objectives.yaml"
    path.write_text(OBJECTIVES)
    store = Datastore()
    assert load_objectives_file(path, store, pool_name="pool") == 3
    assert store.objectives() == {"chat": 10, "batch": -1, "default": None}
    assert store.objective_priority("batch") == -1 and store.objective_priority("unknown") == 0
    assert set(parse_objectives(OBJECTIVES)) == {"chat", "batch", "default", "theirs"}  # no pool: all


@pytest.mark.parametrize("text, message", [
    ("kind: InferenceObjective\n", "document 1.apiVersion: must be"),
    ("apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\n", "document 1.kind: must be"),
    ("apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceObjective\nmetadata: {}\n",
     "document 1.metadata.name: required"),
    ("apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceObjective\nmetadata: {name: a}\n"
     "spec: {priority: high}\n", "document 1.spec.priority: must be an integer"),
    ("kind: List\nitems: [{apiVersion: inference.networking.x-k8s.io/v1alpha2, kind: InferenceObjective, "
     "metadata: {name: a}}, {apiVersion: inference.networking.x-k8s.io/v1alpha2, kind: InferenceObjective, "
     "metadata: {name: a}}]\n", "document 1.items[1].metadata.name: duplicate objective 'a'"),
    ("a: [", "invalid YAML"),
])
def test_objectives_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_objectives(text)
    assert message in str(info.value)


def test_flow_control_without_metrics_warns_when_its_detector_needs_them() -> None:
    loaded = load_config(HEADER + "dataLayer: {sources: []}\n", Datastore())
    assert any("nothing is dispatched" in w for w in loaded.warnings)
    loaded = load_config(HEADER + "plugins: [{type: concurrency-detector}]\n"
                         "saturationDetector: {pluginRef: concurrency-detector}\ndataLayer: {sources: []}\n",
                         Datastore())
    assert not any("nothing is dispatched" in w for w in loaded.warnings)
