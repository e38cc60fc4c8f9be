"""Load and affinity scorers: each returns one score per endpoint, higher is better."""

from __future__ import annotations

import pytest

from epp.params import ConfigError, Params
from epp.datastore import Datastore
from epp.scheduling.plugins.active_request_scorer import ActiveRequestScorer
from epp.scheduling.plugins.kv_cache_utilization_scorer import KvCacheUtilizationScorer
from epp.scheduling.plugins.lora_affinity_scorer import LoraAffinityScorer
from epp.scheduling.plugins.queue_scorer import QueueScorer
from epp.scheduling.plugins.running_requests_size_scorer import RunningRequestsSizeScorer
from epp.scheduling.plugins.token_load_scorer import TokenLoadScorer
from epp.plugin import PluginContext

from .helpers import cycle, endpoint, request


def ctx() -> PluginContext:
    return PluginContext(datastore=Datastore())


def test_queue_scorer_prefers_shorter_queue_min_max() -> None:
    eps = [endpoint("10.0.0.1", waiting_queue_size=0), endpoint("10.0.0.2", waiting_queue_size=5),
           endpoint("10.0.0.3", waiting_queue_size=10)]
    assert QueueScorer().score(cycle(), request(), eps) == [1.0, 0.5, 0.0]


def test_queue_scorer_all_equal_scores_one() -> None:
    eps = [endpoint("10.0.0.1", waiting_queue_size=3), endpoint("10.0.0.2", waiting_queue_size=3)]
    assert QueueScorer().score(cycle(), request(), eps) == [1.0, 1.0]
    assert QueueScorer().score(cycle(), request(), [eps[0]]) == [1.0]
    assert QueueScorer().score(cycle(), request(), []) == []


def test_queue_scorer_reads_scraped_queue_not_inflight() -> None:
    # The scraped queue is the reference's signal; in-flight is active-request-scorer's job.
    eps = [endpoint("10.0.0.1", inflight=9), endpoint("10.0.0.2")]
    assert QueueScorer().score(cycle(), request(), eps) == [1.0, 1.0]


def test_running_requests_size_scorer() -> None:
    eps = [endpoint("10.0.0.1", running_requests=4), endpoint("10.0.0.2", running_requests=2)]
    assert RunningRequestsSizeScorer().score(cycle(), request(), eps) == [0.0, 1.0]


def test_kv_cache_scorer_is_one_minus_usage() -> None:
    eps = [endpoint("10.0.0.1", kv_cache_usage=0.25), endpoint("10.0.0.2", kv_cache_usage=1.0)]
    assert KvCacheUtilizationScorer().score(cycle(), request(), eps) == [0.75, 0.0]


def test_lora_affinity_table() -> None:
    eps = [
        endpoint("10.0.0.1", active_models=frozenset({"lora-a"}), max_active_models=1),  # running
        endpoint("10.0.0.2", active_models=frozenset({"x"}), max_active_models=4),  # free slot
        endpoint("10.0.0.3", active_models=frozenset({"x"}), waiting_models=frozenset({"lora-a"}),
                 max_active_models=2),  # waiting, no free slot
        endpoint("10.0.0.4", active_models=frozenset({"x", "y"}), max_active_models=2),  # full
    ]
    assert LoraAffinityScorer().score(cycle(), request(model="lora-a"), eps) == [1.0, 0.8, 0.6, 0.0]


def test_lora_free_slot_is_checked_before_waiting() -> None:
    ep = endpoint("10.0.0.1", waiting_models=frozenset({"lora-a"}), max_active_models=4)
    assert LoraAffinityScorer().score(cycle(), request(model="lora-a"), [ep]) == [0.8]


def test_token_load_scorer() -> None:
    scorer = TokenLoadScorer(queue_threshold_tokens=1000)
    eps = [endpoint("10.0.0.1", tokens=0), endpoint("10.0.0.2", tokens=250), endpoint("10.0.0.3", tokens=5000)]
    assert scorer.score(cycle(), request(), eps) == [1.0, 0.75, 0.0]


def test_token_load_scorer_config() -> None:
    assert TokenLoadScorer.from_config("t", Params(None, "p"), ctx()).queue_threshold_tokens == 4194304
    scorer = TokenLoadScorer.from_config("t", Params({"queueThresholdTokens": 10}, "p"), ctx())
    assert scorer.queue_threshold_tokens == 10
    with pytest.raises(ConfigError, match=r"^p\.queueThresholdTokens: must be >= 1"):
        TokenLoadScorer.from_config("t", Params({"queueThresholdTokens": 0}, "p"), ctx())
    with pytest.raises(ConfigError, match=r"^p\.bogus: unknown field"):
        TokenLoadScorer.from_config("t", Params({"bogus": 1}, "p"), ctx())


def test_parameterless_scorers_reject_parameters() -> None:
    with pytest.raises(ConfigError, match=r"^plugins\[0\]\.parameters\.x: unknown field"):
        QueueScorer.from_config("q", Params({"x": 1}, "plugins[0].parameters"), ctx())


def test_active_request_scorer_prefers_fewer_inflight() -> None:
    eps = [endpoint("10.0.0.1", inflight=4), endpoint("10.0.0.2", inflight=0), endpoint("10.0.0.3", inflight=2)]
    assert ActiveRequestScorer().score(cycle(), request(), eps) == [0.0, 1.0, 0.5]
    busy = ActiveRequestScorer().score(cycle(), request(), [endpoint("10.0.0.1", inflight=3)] * 2)
    assert busy[0] == busy[1]
    assert ActiveRequestScorer().score(cycle(), request(), [endpoint("10.0.0.1", inflight=0)] * 2) == [1.0, 1.0]
    # Proportional, not min-max: one request apart among busy pods is a small difference.
    close = ActiveRequestScorer().score(cycle(), request(), [endpoint("10.0.0.1", inflight=5),
                                                             endpoint("10.0.0.2", inflight=6)])
    assert close[0] - close[1] < 0.2
