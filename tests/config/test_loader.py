"""EndpointPickerConfig loading: defaults, GIE sample configs, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.config.defaults import PRESETS, REFERENCE_DEFAULT_CONFIG, WEIGHTED_CONFIG
from epp.config.loader import load_config, load_config_file
from epp.params import ConfigError
from epp.datalayer.core_metrics_extractor import CoreMetricsExtractor
from epp.datalayer.metrics_data_source import MetricsDataSource
from epp.datastore import Datastore
from epp.flowcontrol.concurrency_detector import ConcurrencyDetector
from epp.flowcontrol.utilization_detector import UtilizationDetector
from epp.scheduling.plugins.active_request_scorer import ActiveRequestScorer
from epp.scheduling.plugins.approx_prefix_cache_producer import ApproxPrefixCacheProducer
from epp.scheduling.plugins.destination_endpoint_served_verifier import DestinationEndpointServedVerifier
from epp.scheduling.plugins.header_based_testing_filter import HeaderBasedTestingFilter
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from epp.scheduling.plugins.single_profile_handler import SingleProfileHandler

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def load(body: str):  # type: ignore[no-untyped-def]
    return load_config(HEAD + body, Datastore())


def weights(config, profile: str = "default") -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {ws.scorer.name: ws.weight for ws in config.scheduler.profiles[profile].scorers}


# -- defaults --


def test_default_config_is_predicted_latency() -> None:
    config = load_config(None, Datastore())
    assert list(config.scheduler.profiles) == ["default"]
    assert weights(config) == {"latency-scorer": 1.0}
    profile = config.scheduler.profiles["default"]
    assert [f.type for f in profile.filters] == ["slo-headroom-tier-filter"]
    assert isinstance(profile.picker, MaxScorePicker) and profile.picker.max_endpoints == 1
    prefix = config.plugins["approx-prefix-cache-producer"]
    latency = config.plugins["predicted-latency-producer"]
    # The prediction reads the prefix match: its producer runs first.
    assert config.scheduler.producers == [prefix, latency]
    assert isinstance(prefix, ApproxPrefixCacheProducer) and prefix.config.max_prefix_tokens == 131072
    assert config.pre_request == [prefix] and config.response_complete == [prefix]
    assert config.warnings == [] and config.parser == "openai-parser"
    for preset in PRESETS.values():
        load_config(preset, Datastore())


def test_weighted_preset() -> None:
    config = load_config(WEIGHTED_CONFIG, Datastore())
    assert list(config.scheduler.profiles) == ["default"]
    assert weights(config) == {"queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0, "prefix-cache-scorer": 3.0,
                               "active-request-scorer": 2.0}
    profile = config.scheduler.profiles["default"]
    assert profile.filters == [] and isinstance(profile.picker, MaxScorePicker)
    assert profile.picker.max_endpoints == 1
    assert isinstance(config.scheduler.handler, SingleProfileHandler)
    producer = config.plugins["approx-prefix-cache-producer"]
    assert isinstance(producer, ApproxPrefixCacheProducer)
    assert config.scheduler.producers == [producer] and config.pre_request == [producer]
    scorer = config.plugins["prefix-cache-scorer"]
    assert isinstance(scorer, PrefixCacheScorer) and scorer.producer is producer
    detector = config.saturation_detector
    assert isinstance(detector, UtilizationDetector) and detector.queue_depth_threshold == 5
    assert config.data_layer is not None and len(config.data_layer) == 1
    assert isinstance(config.data_source, MetricsDataSource) and isinstance(config.extractor, CoreMetricsExtractor)
    assert config.parser == "openai-parser"
    assert config.feature_gates == frozenset() and config.flow_control is None
    assert config.response_received == [] and config.response_complete == [producer] and config.warnings == []


def test_reference_default_config() -> None:
    config = load_config(REFERENCE_DEFAULT_CONFIG, Datastore())
    assert weights(config) == {"queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0, "prefix-cache-scorer": 3.0}
    assert "active-request-scorer" not in config.plugins


def test_no_profiles_builds_default_with_every_filter_scorer_and_first_picker() -> None:
    config = load("""
plugins:
- type: header-based-testing-filter
- type: queue-scorer
- {type: lora-affinity-scorer, name: lora}
- {type: random-picker, name: r1}
- {type: weighted-random-picker, name: r2}
- type: destination-endpoint-served-verifier
""")
    profile = config.scheduler.profiles["default"]
    assert [f.name for f in profile.filters] == ["header-based-testing-filter"]
    assert weights(config) == {"queue-scorer": 1.0, "lora": 1.0}
    assert profile.picker is config.plugins["r1"]
    assert "max-score-picker" not in config.plugins


def test_minimal_config_gets_every_system_default() -> None:
    config = load("plugins: []\n")
    profile = config.scheduler.profiles["default"]
    assert profile.scorers == [] and isinstance(profile.picker, MaxScorePicker)
    assert {"single-profile-handler", "max-score-picker", "utilization-detector", "openai-parser",
            "metrics-data-source", "core-metrics-extractor"} <= set(config.plugins)


# -- GIE sample configs --


def test_conformance_config() -> None:
    config = load("""
plugins:
- type: header-based-testing-filter
- type: destination-endpoint-served-verifier
schedulingProfiles:
- name: conformance-profile
  plugins:
  - pluginRef: header-based-testing-filter
""")
    profile = config.scheduler.profiles["conformance-profile"]
    assert [type(f) for f in profile.filters] == [HeaderBasedTestingFilter]
    assert profile.scorers == [] and isinstance(profile.picker, MaxScorePicker)
    assert [type(p) for p in config.response_received] == [DestinationEndpointServedVerifier]
    assert isinstance(config.scheduler.handler, SingleProfileHandler)


def test_docs_style_prefix_parameters_on_the_scorer() -> None:
    config = load("""
plugins:
- type: prefix-cache-scorer
  parameters:
    blockSizeTokens: 32
    maxPrefixBlocksToMatch: 128
    lruCapacityPerServer: 1000
    autoTune: false
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 50
""")
    producer = config.plugins["approx-prefix-cache-producer"]
    assert isinstance(producer, ApproxPrefixCacheProducer)
    assert (producer.config.block_size_tokens, producer.config.max_prefix_blocks,
            producer.config.lru_capacity_per_server, producer.config.auto_tune) == (32, 128, 1000, False)
    assert weights(config) == {"prefix-cache-scorer": 50.0}


def test_explicit_producer_is_used_by_the_scorer() -> None:
    config = load("""
plugins:
- type: prefix-cache-scorer
- name: my-producer
  type: approx-prefix-cache-producer
  parameters: {blockSizeTokens: 64}
""")
    assert config.plugins["prefix-cache-scorer"].producer is config.plugins["my-producer"]
    assert "approx-prefix-cache-producer" not in config.plugins
    assert config.scheduler.producers == [config.plugins["my-producer"]]


def test_full_gie_style_config() -> None:
    config = load("""
featureGates: [dataLayer]
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: running-requests-size-scorer
- type: token-load-scorer
  parameters: {queueThresholdTokens: 1000000}
- type: inflight-load-producer
- {name: picker, type: max-score-picker, parameters: {maxNumOfEndpoints: 3}}
- type: single-profile-handler
- name: sat
  type: concurrency-detector
  parameters: {concurrencyMode: tokens, maxTokenConcurrency: 50000, headroom: 0.1}
- type: metrics-data-source
  parameters: {scheme: https, path: /custom/metrics, insecureSkipVerify: false}
- type: core-metrics-extractor
  parameters: {defaultEngine: sglang}
- type: openai-parser
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: sat}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer}
  - {pluginRef: running-requests-size-scorer, weight: 0.5}
  - {pluginRef: token-load-scorer, weight: 1}
  - {pluginRef: picker}
saturationDetector:
  pluginRef: sat
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors:
    - pluginRef: core-metrics-extractor
parser:
  pluginRef: openai-parser
""")
    profile = config.scheduler.profiles["default"]
    assert weights(config) == {"queue-scorer": 2.0, "kv-cache-utilization-scorer": 1.0,
                               "running-requests-size-scorer": 0.5, "token-load-scorer": 1.0}
    assert profile.filters == [config.plugins["sat"]] and profile.picker is config.plugins["picker"]
    assert isinstance(config.saturation_detector, ConcurrencyDetector) and config.saturation_detector.mode == "tokens"
    assert config.data_source.scheme == "https" and config.extractor.default_engine == "sglang"
    assert config.parser == "openai-parser"
    assert config.feature_gates == {"dataLayer"}
    assert config.warnings == ["featureGates[0]: dataLayer is deprecated, the data layer is always on"]
    assert config.injected == {}  # everything this config runs with, it names
    assert "utilization-detector" not in config.plugins and "max-score-picker" not in config.plugins


def test_explicit_empty_sources_turn_collection_off() -> None:
    config = load("plugins: [{type: queue-scorer}]\ndataLayer:\n  sources: []\n")
    assert config.data_layer is None and config.data_source is None and config.extractor is None
    assert "metrics-data-source" not in config.plugins


def test_configured_utilization_detector_becomes_the_saturation_detector() -> None:
    config = load("""
plugins:
- {name: util, type: utilization-detector, parameters: {queueDepthThreshold: 3}}
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
""")
    assert config.saturation_detector is config.plugins["util"]
    assert "utilization-detector" not in config.plugins


def test_flow_control_only_with_its_gate() -> None:
    off = load("flowControl: {maxRequests: 10}\n")
    assert off.flow_control is None
    assert off.warnings == ["flowControl: ignored, the flowControl feature gate is off"]
    on = load("featureGates: [flowControl]\nflowControl:\n  maxRequests: 10\n  priorityBands: []\n")
    assert on.flow_control == {"maxRequests": 10, "priorityBands": []} and on.flow_control_enabled()
    assert load("featureGates: [flowControl]\n").flow_control == {}


def test_weight_on_a_non_scorer_is_ignored_with_a_warning() -> None:
    config = load("""
plugins: [{type: max-score-picker}]
schedulingProfiles:
- name: default
  plugins: [{pluginRef: max-score-picker, weight: 3}]
""")
    assert config.warnings == [
        "schedulingProfiles[0].plugins[0].weight: ignored, 'max-score-picker' (type max-score-picker) is not a scorer"
    ]


def test_multiple_profiles_with_a_handler_plugin_that_is_not_single() -> None:
    with pytest.raises(ConfigError, match=r"^schedulingProfiles: 'single-profile-handler' .* exactly one profile"):
        load("""
plugins: [{type: single-profile-handler}, {type: queue-scorer}]
schedulingProfiles:
- {name: a, plugins: [{pluginRef: queue-scorer}]}
- {name: b, plugins: [{pluginRef: queue-scorer}]}
""")


def test_load_config_file(tmp_path: Path) -> None:
    path = tmp_path / "epp.yaml"
    path.write_text(HEAD + "plugins: [{type: queue-scorer}]\n")
    assert "queue-scorer" in load_config_file(path, Datastore()).plugins
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config_file(tmp_path / "missing.yaml", Datastore())


# -- errors: every message starts with the path of the field --

ERRORS = [
    ("", "config: empty document", False),
    ("kind: EndpointPickerConfig\n", "apiVersion: required", False),
    ("apiVersion: v1\nkind: EndpointPickerConfig\n", "apiVersion: must be", False),
    ("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: Other\n", "kind: must be", False),
    ("- a\n", "config: must be a mapping", False),
    ("plugins: [\n", "config: invalid YAML", False),
    ("bogus: 1\n", "bogus: unknown field", True),
    ("data: {sources: []}\n", "data: unknown field (the field is `dataLayer`)", True),
    ("plugins: []\nplugins: []\n", "plugins: duplicate field", True),
    ("featureGates: [magic]\n", "featureGates[0]: unknown feature gate 'magic' (known: dataLayer, enableLegacyMetrics, "
                                "flowControl)", True),
    ("featureGates: flowControl\n", "featureGates: must be a list", True),
    ("plugins: {type: queue-scorer}\n", "plugins: must be a list", True),
    ("plugins: [{type: nope}]\n", "plugins[0].type: unknown plugin type 'nope' (known: active-request-scorer,", True),
    ("plugins: [{name: x}]\n", "plugins[0].type: must be a non-empty string", True),
    ("plugins: [{type: queue-scorer, params: {}}]\n", "plugins[0].params: unknown field", True),
    ("plugins: [{type: queue-scorer}, {type: queue-scorer}]\n", "plugins[1].name: duplicate plugin name 'queue-scorer'",
     True),
    ("plugins: [{type: queue-scorer, parameters: {x: 1}}]\n", "plugins[0].parameters.x: unknown field", True),
    ("plugins: [{type: queue-scorer, parameters: [1]}]\n", "plugins[0].parameters: must be a mapping", True),
    ("plugins: [{type: max-score-picker, parameters: {maxNumOfEndpoints: 0}}]\n",
     "plugins[0].parameters.maxNumOfEndpoints: must be >= 1", True),
    ("plugins: [{type: prefix-cache-scorer, parameters: {blockSize: 64}}]\n",
     "plugins[0].parameters.blockSize: is deprecated", True),
    ("plugins: [{type: utilization-detector, parameters: {metricsStalenessThreshold: 5 parsecs}}]\n",
     "plugins[0].parameters.metricsStalenessThreshold: invalid duration", True),
    ("plugins: [{type: metrics-data-source, parameters: {scheme: ftp}}]\n",
     "plugins[0].parameters.scheme: must be one of http, https", True),
    ("schedulingProfiles: [{name: a, plugins: [{pluginRef: ghost}]}]\n",
     "schedulingProfiles[0].plugins[0].pluginRef: no plugin named 'ghost'", True),
    ("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer, "
     "weight: heavy}]}]\n", "schedulingProfiles[0].plugins[0].weight: must be a number", True),
    ("plugins: [{type: queue-scorer}, {type: kv-cache-utilization-scorer}]\nschedulingProfiles: [{name: a, plugins: "
     "[{pluginRef: queue-scorer}, {pluginRef: kv-cache-utilization-scorer, weight: true}]}]\n",
     "schedulingProfiles[0].plugins[1].weight: must be a number", True),
    ("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer, w: 1}]}]\n",
     "schedulingProfiles[0].plugins[0].w: unknown field", True),
    ("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer}, "
     "{pluginRef: queue-scorer}]}]\n", "schedulingProfiles[0].plugins[1].pluginRef: plugin 'queue-scorer' is listed "
                                       "twice", True),
    ("schedulingProfiles: [{plugins: []}]\n", "schedulingProfiles[0].name: must be a non-empty string", True),
    ("schedulingProfiles: [{name: a}, {name: a}]\n", "schedulingProfiles[1].name: duplicate profile name 'a'", True),
    ("plugins: [{type: approx-prefix-cache-producer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: "
     "approx-prefix-cache-producer}]}]\n",
     "schedulingProfiles[0].plugins[0].pluginRef: 'approx-prefix-cache-producer' (type approx-prefix-cache-producer) is "
     "not a filter, scorer or picker", True),
    ("plugins: [{type: random-picker}, {type: max-score-picker}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: "
     "random-picker}, {pluginRef: max-score-picker}]}]\n",
     "schedulingProfiles[0].plugins[1].pluginRef: profile 'a' already has picker 'random-picker'", True),
    ("schedulingProfiles: [{name: a}, {name: b}]\n", "schedulingProfiles: several profiles need a profile handler", True),
    ("plugins: [{type: single-profile-handler}, {name: h2, type: single-profile-handler}]\n",
     "plugins: only one profile handler may be configured", True),
    ("saturationDetector: {pluginRef: nope}\n", "saturationDetector.pluginRef: no plugin named 'nope'", True),
    ("plugins: [{type: queue-scorer}]\nsaturationDetector: {pluginRef: queue-scorer}\n",
     "saturationDetector.pluginRef: 'queue-scorer' (type queue-scorer) is not a saturation detector", True),
    ("saturationDetector: {name: x}\n", "saturationDetector.name: unknown field", True),
    ("dataLayer: {sources: [{pluginRef: ghost}]}\n", "dataLayer.sources[0].pluginRef: no plugin named 'ghost'", True),
    ("plugins: [{type: queue-scorer}]\ndataLayer: {sources: [{pluginRef: queue-scorer}]}\n",
     "dataLayer.sources[0].pluginRef: 'queue-scorer' (type queue-scorer) is not a data source", True),
    ("plugins: [{type: metrics-data-source}]\ndataLayer: {sources: [{pluginRef: metrics-data-source, extractors: "
     "[{pluginRef: metrics-data-source}]}]}\n",
     "dataLayer.sources[0].extractors[0].pluginRef: 'metrics-data-source' (type metrics-data-source) is not a metrics "
     "extractor", True),
    ("dataLayer: {sources: [{pluginRef: x, interval: 1s}]}\n", "dataLayer.sources[0].interval: unknown field", True),
    ("dataLayer: []\n", "dataLayer: must be a mapping", True),
    ("parser: {pluginRef: queue-scorer}\nplugins: [{type: queue-scorer}]\n",
     "parser.pluginRef: 'queue-scorer' (type queue-scorer) is not a request parser", True),
    ("featureGates: [flowControl]\nflowControl: [1]\n", "flowControl: must be a mapping", True),
]


@pytest.mark.parametrize(("body", "message", "with_head"), ERRORS, ids=[e[1][:50] for e in ERRORS])
def test_errors_name_the_field(body: str, message: str, with_head: bool) -> None:
    with pytest.raises(ConfigError) as err:
        load_config((HEAD if with_head else "") + body, Datastore())
    assert str(err.value).startswith(message), str(err.value)
