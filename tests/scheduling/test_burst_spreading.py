"""A burst between two scrapes: equal scraped metrics everywhere, only our own accounting moves.

The director counts a request against its endpoint at pick time (its in-flight count and its
ledger of outstanding work); these tests send the burst through the real director and check the
default configuration spreads it evenly, where the reference's default would not.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

import asyncio

from epp.config.defaults import REFERENCE_DEFAULT_CONFIG, WEIGHTED_CONFIG
from epp.core import build_core
from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.scheduling.framework import SchedulerProfile, WeightedScorer
from epp.scheduling.plugins.active_request_scorer import ActiveRequestScorer
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.plugins.queue_scorer import QueueScorer
from epp.scheduling.plugins.single_profile_handler import SingleProfileHandler
from epp.scheduling.scheduler import Scheduler

from .helpers import request

PODS = 4
BURST = 16
SYSTEM = "S" * 64 * 12  # a shared system prompt of 12 whole blocks


def pool() -> Datastore:
    store = Datastore(clock=lambda: 10.0)
    for i in range(PODS):
        ep = store.upsert(EndpointSpec(name=f"pod-{i}", ip=f"10.0.0.{i + 1}", port=8000))
        ep.metrics = EndpointMetrics(waiting_queue_size=2, running_requests=3, kv_cache_usage=0.3, update_time=9.99)
    return store


def run_burst(config_text: str | None, store: Datastore, prompts: list[str]) -> Counter[str]:
    """Send every prompt through the director before any scrape or response."""
    core = build_core(store, config_text, tick=0.05, seed=0)

    async def burst() -> Counter[str]:
        counts: Counter[str] = Counter()
        for prompt in prompts:
            decision, _ = await core.director.handle_request(request(prompt))
            counts[decision.targets[0].address] += 1
        return counts

    return asyncio.run(burst())


def distinct_prompts() -> list[str]:
    return [f"question {i}: " + "x" * 300 for i in range(BURST)]


def shared_prefix_prompts() -> list[str]:
    return [SYSTEM + f"user question number {i} " * 20 for i in range(BURST)]


def test_active_request_scorer_alone_spreads_a_burst() -> None:
    store = pool()
    profile = SchedulerProfile(
        "default",
        scorers=[WeightedScorer(QueueScorer(), 1.0), WeightedScorer(ActiveRequestScorer(), 1.0)],
        picker=MaxScorePicker(rng=random.Random(0)),
    )
    scheduler = Scheduler({"default": profile}, SingleProfileHandler())
    counts: Counter[str] = Counter()
    for _ in range(BURST):
        ep = scheduler.schedule(request("p"), list(store.endpoints())).primary
        ep.inflight_requests += 1
        counts[ep.address] += 1
    assert sorted(counts.values()) == [BURST // PODS] * PODS


@pytest.mark.parametrize("config", [None, WEIGHTED_CONFIG], ids=["default", "weighted"])
def test_default_config_spreads_a_burst_of_distinct_prompts(config: str | None) -> None:
    store = pool()
    counts = run_burst(config, store, distinct_prompts())
    assert sorted(counts.values()) == [BURST // PODS] * PODS


@pytest.mark.parametrize("config", [None, WEIGHTED_CONFIG], ids=["default", "weighted"])
def test_default_config_spreads_a_burst_sharing_a_system_prompt(config: str | None) -> None:
    store = pool()
    counts = run_burst(config, store, shared_prefix_prompts())
    assert sorted(counts.values()) == [BURST // PODS] * PODS


def test_reference_default_piles_a_shared_prefix_burst_onto_one_pod() -> None:
    # Why the default differs: with only scraped signals, the first pick's prefix entry makes
    # that pod the best choice for the whole burst.
    store = pool()
    counts = run_burst(REFERENCE_DEFAULT_CONFIG, store, shared_prefix_prompts())
    assert list(counts.values()) == [BURST]


def test_identical_prompts_keep_cache_affinity_under_the_weighted_preset() -> None:
    # A near-complete prefix match (weight 3) outweighs a one-request in-flight difference (2).
    store = pool()
    counts = run_burst(WEIGHTED_CONFIG, store, [SYSTEM + "same question"] * 3)
    assert list(counts.values()) == [3]


def test_a_long_shared_document_keeps_its_followers_under_the_default() -> None:
    """Requests after the first reuse the 8k-token document where it is (or is being) cached: a
    second copy elsewhere costs that pod the whole prefill again, for no faster answer."""
    store = pool()
    document = "D" * (8192 * 4)
    counts = run_burst(None, store, [document + f" question {i}" for i in range(3)])
    assert list(counts.values()) == [3]
