"""Saturation detectors (`epp.flowcontrol`): pool saturation and their Filter side."""

from __future__ import annotations

import pytest

from epp.params import ConfigError, Params
from epp.datastore import Datastore
from epp.flowcontrol.concurrency_detector import ConcurrencyDetector
from epp.flowcontrol.saturation import SaturationDetector
from epp.flowcontrol.utilization_detector import UtilizationDetector
from epp.scheduling.framework import Filter
from epp.plugin import PluginContext

from .helpers import cycle, endpoint, request

NOW = 100.0


def util(**kw: object) -> UtilizationDetector:
    return UtilizationDetector(clock=lambda: NOW, **kw)  # type: ignore[arg-type]


def fresh(ip: str, **metrics: object):  # type: ignore[no-untyped-def]
    return endpoint(ip, update_time=NOW - 0.05, **metrics)


def test_detectors_are_filters_and_detectors() -> None:
    for cls in (UtilizationDetector, ConcurrencyDetector):
        assert issubclass(cls, Filter) and issubclass(cls, SaturationDetector)


def test_utilization_mean_of_per_endpoint_roofline() -> None:
    eps = [fresh("10.0.0.1", waiting_queue_size=5, kv_cache_usage=0.4),  # max(1.0, 0.5)
           fresh("10.0.0.2", waiting_queue_size=0, kv_cache_usage=0.4)]  # max(0, 0.5)
    assert util().saturation(eps) == pytest.approx(0.75)
    assert not util().is_saturated(eps)


def test_utilization_stale_or_never_scraped_counts_full() -> None:
    stale = endpoint("10.0.0.1", update_time=NOW - 0.5)
    never = endpoint("10.0.0.2")
    idle = fresh("10.0.0.3")
    assert util().saturation([stale, never, idle]) == pytest.approx(2 / 3)
    assert util().saturation([stale]) == 1.0 and util().is_saturated([never])
    assert util().saturation([]) == 1.0


def test_utilization_filter_keeps_fresh_endpoints_below_thresholds() -> None:
    ok = fresh("10.0.0.1", waiting_queue_size=4, kv_cache_usage=0.79)
    deep = fresh("10.0.0.2", waiting_queue_size=5)
    full = fresh("10.0.0.3", kv_cache_usage=0.8)
    stale = endpoint("10.0.0.4", update_time=NOW - 1)
    assert util().filter(cycle(), request(), [ok, deep, full, stale]) == [ok]
    assert util(headroom=0.2).filter(cycle(), request(), [ok, deep, full, stale]) == [ok, deep, full]


def test_utilization_filter_fails_open() -> None:
    eps = [fresh("10.0.0.1", waiting_queue_size=50), endpoint("10.0.0.2")]
    assert util().filter(cycle(), request(), eps) == eps


def test_utilization_config() -> None:
    store = Datastore(clock=lambda: 7.0)
    ctx = PluginContext(datastore=store)
    d = UtilizationDetector.from_config("u", Params(None, "x"), ctx)
    assert (d.queue_depth_threshold, d.kv_cache_util_threshold, d.metrics_staleness_threshold, d.headroom) == (
        5, 0.8, 0.2, 0.0)
    assert d.clock() == 7.0
    d = UtilizationDetector.from_config(
        "u", Params({"queueDepthThreshold": 3, "kvCacheUtilThreshold": 1, "metricsStalenessThreshold": "1s",
                     "headroom": 0.5}, "x"), ctx)
    assert (d.queue_depth_threshold, d.kv_cache_util_threshold, d.metrics_staleness_threshold, d.headroom) == (
        3, 1.0, 1.0, 0.5)
    for bad, message in [
        ({"queueDepthThreshold": 0}, r"^x\.queueDepthThreshold: must be >= 1"),
        ({"kvCacheUtilThreshold": 0}, r"^x\.kvCacheUtilThreshold: must be > 0"),
        ({"kvCacheUtilThreshold": 1.5}, r"^x\.kvCacheUtilThreshold: must be <= 1"),
        ({"metricsStalenessThreshold": "0s"}, r"^x\.metricsStalenessThreshold: must be > 0"),
        ({"metricsStalenessThreshold": "soon"}, r"^x\.metricsStalenessThreshold: invalid duration"),
        ({"headroom": -1}, r"^x\.headroom: must be >= 0"),
        ({"queueDepth": 1}, r"^x\.queueDepth: unknown field"),
    ]:
        with pytest.raises(ConfigError, match=message):
            UtilizationDetector.from_config("u", Params(bad, "x"), ctx)


def test_concurrency_requests_mode() -> None:
    d = ConcurrencyDetector(max_concurrency=4)
    eps = [endpoint("10.0.0.1", inflight=4), endpoint("10.0.0.2", inflight=2)]
    assert d.saturation(eps) == pytest.approx(6 / 8)
    assert d.filter(cycle(), request(), eps) == [eps[1]]
    assert d.saturation([]) == 1.0


def test_concurrency_filter_has_no_fail_open_and_honours_headroom() -> None:
    eps = [endpoint("10.0.0.1", inflight=4)]
    assert ConcurrencyDetector(max_concurrency=4).filter(cycle(), request(), eps) == []
    assert ConcurrencyDetector(max_concurrency=4, headroom=0.5).filter(cycle(), request(), eps) == eps


def test_concurrency_tokens_mode() -> None:
    d = ConcurrencyDetector(mode="tokens", max_token_concurrency=1000)
    eps = [endpoint("10.0.0.1", inflight=99, tokens=1000), endpoint("10.0.0.2", tokens=500)]
    assert d.saturation(eps) == pytest.approx(0.75)
    assert d.filter(cycle(), request(), eps) == [eps[1]]


def test_concurrency_config() -> None:
    ctx = PluginContext(datastore=Datastore())
    d = ConcurrencyDetector.from_config("c", Params(None, "x"), ctx)
    assert (d.mode, d.max_concurrency, d.max_token_concurrency, d.headroom) == ("requests", 100, 1_000_000, 0.0)
    d = ConcurrencyDetector.from_config("c", Params({"concurrencyMode": "tokens", "maxTokenConcurrency": 5}, "x"), ctx)
    assert d.limit == 5
    with pytest.raises(ConfigError, match=r"^x\.concurrencyMode: must be one of requests, tokens"):
        ConcurrencyDetector.from_config("c", Params({"concurrencyMode": "hybrid"}, "x"), ctx)
    with pytest.raises(ConfigError, match=r"^x\.maxConcurrency: must be >= 1"):
        ConcurrencyDetector.from_config("c", Params({"maxConcurrency": 0}, "x"), ctx)


def invalid(ip: str, **metrics: object):  # type: ignore[no-untyped-def]
    """An endpoint whose last scrape was rejected: fresh-looking old metrics, flagged invalid."""
    ep = fresh(ip, **metrics)
    ep.metrics_valid = False
    return ep


def test_utilization_an_invalid_endpoint_counts_full_and_never_saturates_the_pool_alone() -> None:
    bad = invalid("10.0.0.3")  # its last valid metrics say idle; they are not trusted any more
    idle = [fresh("10.0.0.1"), fresh("10.0.0.2")]
    assert util().endpoint_saturation(bad, NOW) == 1.0
    assert util().saturation([*idle, bad]) == pytest.approx(1 / 3)  # capped at 1.0 per endpoint
    assert not util().is_saturated([idle[0], bad])
    assert util().is_saturated([bad])  # nothing we can vouch for: the pool is full
    assert util().filter(cycle(), request(), [*idle, bad]) == idle
    assert util().filter(cycle(), request(), [bad]) == [bad]  # fail open
