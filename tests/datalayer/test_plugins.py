"""The two data-layer plugins built from EndpointPickerConfig parameters."""

from __future__ import annotations

from typing import Any

import pytest

from epp.params import ConfigError, Params
from epp.datalayer import PLUGIN_CLASSES
from epp.datalayer.core_metrics_extractor import CoreMetricsExtractor
from epp.datalayer.extract import extract_metrics
from epp.datalayer.metrics_data_source import MetricsDataSource
from epp.datastore import EMPTY_METRICS, Datastore, EndpointSpec
from epp.plugin import PluginContext

from .helpers import fixture_body

PATH = "plugins[0].parameters"


def build(cls: Any, raw: Any, name: str = "") -> Any:
    return cls.from_config(name or cls.type, Params(raw, PATH), PluginContext(Datastore()))


def test_plugin_types() -> None:
    assert {cls.type for cls in PLUGIN_CLASSES} == {"metrics-data-source", "core-metrics-extractor"}


# -- metrics-data-source --


def test_data_source_defaults() -> None:
    source = build(MetricsDataSource, None)
    assert (source.name, source.scheme, source.path, source.insecure_skip_verify) == \
        ("metrics-data-source", "http", "/metrics", True)
    assert source.url(EndpointSpec("p", "10.0.0.1", 8000)) == "http://10.0.0.1:8000/metrics"


def test_data_source_parameters_and_urls() -> None:
    source = build(MetricsDataSource, {"scheme": "https", "path": "/custom/metrics",
                                       "insecureSkipVerify": False}, name="src")
    assert (source.name, source.scheme, source.path, source.insecure_skip_verify) == \
        ("src", "https", "/custom/metrics", False)
    assert source.url(EndpointSpec("p", "fd00::1", 8000, metrics_port=9100)) == "https://[fd00::1]:9100/custom/metrics"


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"scheme": "ftp"}, f"{PATH}.scheme: must be one of http, https"),
        ({"path": "metrics"}, f"{PATH}.path: must start with '/'"),
        ({"insecureSkipVerify": "yes"}, f"{PATH}.insecureSkipVerify: must be true or false"),
        ({"port": 9000}, f"{PATH}.port: unknown field"),
        ([1], f"{PATH}: must be a mapping"),
    ],
)
def test_data_source_errors_name_the_field(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build(MetricsDataSource, raw)
    assert str(err.value).startswith(message)


# -- core-metrics-extractor --


def test_extractor_defaults() -> None:
    ex = build(CoreMetricsExtractor, {})
    assert ex.default_engine == "vllm"
    assert ex.engine_label_key == "inference.networking.k8s.io/engine-type"
    assert set(ex.engines) == {"vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm", "tgi"}


def test_extractor_parameters_like_the_helm_chart_writes_them() -> None:
    ex = build(CoreMetricsExtractor, {"defaultEngine": "sglang", "engineLabelKey": "example.com/engine"})
    assert ex.default_engine == "sglang" and ex.engine_label_key == "example.com/engine"


def test_engine_config_replaces_the_whole_builtin_entry() -> None:
    ex = build(CoreMetricsExtractor, {"engineConfigs": [{
        "name": "vllm",
        "queuedRequestsSpec": "vllm:num_requests_waiting",
        "runningRequestsSpec": "vllm:num_requests_running",
        "kvUsageSpec": "vllm:gpu_cache_usage_perc",
        "loraSpec": "",  # off
    }]})
    vllm = ex.engines["vllm"]
    assert [str(s) for s in vllm.kv_usage] == ["vllm:gpu_cache_usage_perc"]
    assert vllm.lora == () and vllm.cache_info == ()  # omitted fields are off, not inherited
    result = extract_metrics(vllm, fixture_body("busy"), EMPTY_METRICS, now=1.0)
    assert result.metrics is not None
    assert (result.metrics.waiting_queue_size, result.metrics.running_requests) == (8, 4)
    assert result.metrics.cache_block_size == 0  # cache info turned off
    assert ex.engines["sglang"] is not None  # other built-ins stay


def test_engine_config_adds_a_new_engine_with_cache_label_names() -> None:
    ex = build(CoreMetricsExtractor, {"defaultEngine": "mine", "engineConfigs": [{
        "name": "mine",
        "queuedRequestsSpec": "my_queue{kind=waiting}",
        "runningRequestsSpec": "",
        "kvUsageSpec": "my_kv",
        "cacheInfoSpec": "my_info",
        "cacheBlockSizeLabelName": "bs",
        "cacheNumBlocksLabelName": "nb",
        "cacheBlockSizeSpec": "",
        "cacheNumBlocksSpec": "my_blocks",
    }]})
    mine = ex.engines["mine"]
    body = (b'my_queue{kind="waiting"} 4\nmy_queue{kind="done"} 99\nmy_kv 0.5\n'
            b'my_info{bs="32",nb="10"} 1\nmy_blocks 77\n')
    result = extract_metrics(mine, body, EMPTY_METRICS, now=1.0)
    assert result.metrics is not None
    assert (result.metrics.waiting_queue_size, result.metrics.kv_cache_usage) == (4, 0.5)
    assert (result.metrics.cache_block_size, result.metrics.cache_num_blocks) == (32, 77)  # gauge overrides label
    assert ex.default_engine == "mine"


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"defaultEngine": "llamacpp"}, f"{PATH}.defaultEngine: unknown engine 'llamacpp'"),
        ({"engineConfigs": {"name": "x"}}, f"{PATH}.engineConfigs: must be a list"),
        ({"engineConfigs": ["vllm"]}, f"{PATH}.engineConfigs[0]: must be a mapping"),
        ({"engineConfigs": [{"queuedRequestsSpec": "q"}]}, f"{PATH}.engineConfigs[0].name: required"),
        ({"engineConfigs": [{"name": "default"}]}, f"{PATH}.engineConfigs[0].name: 'default' is reserved"),
        ({"engineConfigs": [{"name": "a"}, {"name": "a"}]}, f"{PATH}.engineConfigs[1].name: duplicate engine"),
        ({"engineConfigs": [{"name": "a", "kvUsageSpec": "m{x!=1}"}]},
         f"{PATH}.engineConfigs[0].kvUsageSpec: invalid metric spec"),
        ({"engineConfigs": [{"name": "a", "kvSpec": "m"}]}, f"{PATH}.engineConfigs[0].kvSpec: unknown field"),
        ({"engineConfigs": [{"name": "a", "loraSpec": 3}]}, f"{PATH}.engineConfigs[0].loraSpec: must be a string"),
        ({"engine": "vllm"}, f"{PATH}.engine: unknown field"),
    ],
)
def test_extractor_errors_name_the_field(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build(CoreMetricsExtractor, raw)
    assert str(err.value).startswith(message), str(err.value)
