"""The config never lies: what is ignored is a warning, what cannot run is an error, and every
default the loader injects is listed — by `epp check-config` (`--strict`, `--effective`) and at
`epp serve` start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from epp.cli import main
from epp.config.loader import load_config
from epp.datalayer.metrics_data_source import MetricsDataSource
from epp.datastore import Datastore
from epp.params import ConfigError
from tests.conftest import running_picker

HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def load(body: str):  # type: ignore[no-untyped-def]
    return load_config(HEAD + body, Datastore())


# -- accepted and ignored, no more --


@pytest.mark.parametrize("body", [
    "plugins: [{type: passthrough-parser}]\n",
    "plugins: [{type: passthrough-parser}]\nparser: {pluginRef: passthrough-parser}\n",
])
def test_the_passthrough_parser_is_rejected_with_what_to_do(body: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(body)
    message = str(info.value)
    assert message.startswith("plugins[0].type: passthrough-parser is not supported")
    assert "parses every request body as OpenAI JSON" in message and "openai-parser" in message


def test_enable_legacy_metrics_collects_the_legacy_way_and_says_so() -> None:
    config = load("""
featureGates: [enableLegacyMetrics]
plugins:
- {type: metrics-data-source, parameters: {scheme: https, path: /custom}}
- type: core-metrics-extractor
dataLayer:
  sources: [{pluginRef: metrics-data-source, extractors: [{pluginRef: core-metrics-extractor}]}]
""")
    assert config.legacy_metrics()
    source = config.data_source
    assert isinstance(source, MetricsDataSource) and (source.scheme, source.path) == ("http", "/metrics")
    assert "legacy" in config.injected[source.name]
    assert config.warnings[0].startswith("dataLayer: ignored, the enableLegacyMetrics feature gate collects metrics "
                                         "the legacy way")
    unused = [w for w in config.warnings if "configured but not used (not bound in dataLayer.sources)" in w]
    assert len(unused) == 2  # the configured source and extractor


@pytest.mark.parametrize("body, message", [
    ("plugins: [{type: metrics-data-source, name: a}, {type: metrics-data-source, name: b}, "
     "{type: core-metrics-extractor}]\n"
     "dataLayer: {sources: [{pluginRef: a, extractors: [{pluginRef: core-metrics-extractor}]}, "
     "{pluginRef: b, extractors: [{pluginRef: core-metrics-extractor}]}]}\n",
     "dataLayer.sources[1]: only one data source is supported"),
    ("plugins: [{type: metrics-data-source}, {type: core-metrics-extractor, name: x}, "
     "{type: core-metrics-extractor, name: y}]\n"
     "dataLayer: {sources: [{pluginRef: metrics-data-source, extractors: [{pluginRef: x}, {pluginRef: y}]}]}\n",
     "dataLayer.sources[0].extractors[1]: only one extractor per source is supported"),
    ("plugins: [{type: metrics-data-source}]\ndataLayer: {sources: [{pluginRef: metrics-data-source}]}\n",
     "dataLayer.sources[0].extractors: a source needs one extractor"),
])
def test_data_layer_sources_or_extractors_beyond_one_are_rejected(body: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(body)
    assert str(info.value).startswith(message)


def test_plugins_nothing_uses_are_warnings() -> None:
    config = load("""
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: round-robin-fairness-policy
- {type: concurrency-detector, name: spare}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer, weight: 1}]
""")
    assert config.warnings == [
        "plugins: 'kv-cache-utilization-scorer' (type kv-cache-utilization-scorer) is configured but not used "
        "(in no scheduling profile)",
        "plugins: 'round-robin-fairness-policy' (type round-robin-fairness-policy) is configured but not used "
        "(flow control is off or no band refers to it)",
        "plugins: 'spare' (type concurrency-detector) is configured but not used (not the saturationDetector and "
        "in no scheduling profile)",
    ]


# -- every default, spelled out --


def test_every_injected_default_is_recorded_with_why() -> None:
    config = load("""
featureGates: [flowControl]
plugins:
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-scorer}]
""")
    assert set(config.injected) == {
        "approx-prefix-cache-producer", "single-profile-handler", "max-score-picker", "utilization-detector",
        "metrics-data-source", "core-metrics-extractor", "openai-parser", "global-strict-fairness-policy",
        "fcfs-ordering-policy", "static-usage-limit-policy"}
    assert config.injected["single-profile-handler"] == "one scheduling profile and no profile handler"
    assert "prefix-cache-scorer" in config.injected["approx-prefix-cache-producer"]
    assert any(d.startswith("schedulingProfiles[0].plugins[0].weight: 1.0") for d in config.defaults)
    assert any(d.startswith("schedulingProfiles[default].picker: 'max-score-picker'") for d in config.defaults)
    effective = config.effective()
    by_name = {p["name"]: p for p in effective["plugins"]}
    assert set(config.injected) <= {name for name, p in by_name.items() if "injected" in p}
    assert by_name["utilization-detector"]["settings"]["queue_depth_threshold"] == 5
    assert effective["schedulingProfiles"] == [{"name": "default", "filters": [], "picker": "max-score-picker",
                                                "scorers": [{"pluginRef": "prefix-cache-scorer", "weight": 1.0}]}]
    assert effective["profileHandler"] == "single-profile-handler"
    assert effective["saturationDetector"] == "utilization-detector"
    assert effective["parser"] == "openai-parser"
    band = effective["flowControl"]["defaultPriorityBand"]
    assert (band["fairnessPolicy"], band["orderingPolicy"]) == ("global-strict-fairness-policy", "fcfs-ordering-policy")
    assert effective["flowControl"]["usageLimitPolicy"] == "static-usage-limit-policy"
    assert yaml.safe_load(yaml.safe_dump(effective)) == effective


def test_no_config_says_it_is_the_built_in_default() -> None:
    config = load_config(None, Datastore())
    assert config.defaults[0].startswith("config: none given, the built-in default")
    assert config.warnings == []


# -- shown: check-config and serve --


def write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(HEAD + body)
    return str(path)


def test_check_config_prints_warnings_and_fails_on_them_with_strict(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "flowControl: {maxRequests: 10}\n")
    assert main(["check-config", path]) == 0
    out, err = capsys.readouterr()
    assert "warning: flowControl: ignored, the flowControl feature gate is off" in err
    assert out.startswith("ok: profiles default (1 warning(s))")
    assert main(["check-config", "--strict", path]) == 1
    assert "invalid with --strict: 1 warning(s)" in capsys.readouterr().err
    assert main(["check-config", "--strict", write(tmp_path, "plugins: []\n")]) == 0
    assert main(["check-config", write(tmp_path, "plugins: [{type: passthrough-parser}]\n")]) == 2
    assert "passthrough-parser is not supported" in capsys.readouterr().err


def test_check_config_effective_prints_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--preset", "weighted", "--effective"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    injected = {p["name"]: p["injected"] for p in printed["plugins"] if "injected" in p}
    assert set(injected) == {"approx-prefix-cache-producer", "single-profile-handler", "max-score-picker",
                             "utilization-detector", "openai-parser"}
    assert [s["weight"] for s in printed["schedulingProfiles"][0]["scorers"]] == [2.0, 2.0, 3.0, 2.0]
    assert printed["flowControl"].startswith("off")
    assert main(["check-config", "--effective"]) == 0  # the built-in default: predicted latency
    printed = yaml.safe_load(capsys.readouterr().out)
    injected = {p["name"]: p["injected"] for p in printed["plugins"] if "injected" in p}
    assert set(injected) == {"single-profile-handler", "max-score-picker", "utilization-detector", "openai-parser"}
    assert [s["weight"] for s in printed["schedulingProfiles"][0]["scorers"]] == [1.0]


async def test_serve_logs_the_warnings_and_the_effective_config(caplog: pytest.LogCaptureFixture) -> None:
    config = HEAD + "plugins: [{type: queue-scorer}, {type: lora-affinity-scorer}]\n" \
                    "schedulingProfiles: [{name: p, plugins: [{pluginRef: queue-scorer}]}]\n" \
                    "dataLayer: {sources: []}\nflowControl: {}\n"
    with caplog.at_level(logging.INFO, logger="epp"):
        async with running_picker(config_text=config):
            pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "epp"]
    assert "config: flowControl: ignored, the flowControl feature gate is off" in warnings
    assert any("'lora-affinity-scorer'" in w and "not used" in w for w in warnings)
    [record] = [r for r in caplog.records if r.getMessage() == "effective configuration"]
    effective = record.effective_config  # type: ignore[attr-defined]
    assert effective["dataLayer"].startswith("off")
    assert {p["name"] for p in effective["plugins"] if "injected" in p} >= {"single-profile-handler",
                                                                             "utilization-detector"}
