"""The optimised per-candidate prediction (`predict_all`) gives the very same results as the
readable one kept beside it (`_predict`), on random states: ledgers with requests in every
phase, scraped metrics the ledger does and does not explain, full batches (configured and
learned batch limits), full KV caches, LoRA adapters, learned service models and calibrations,
paces measured while backlogged, KV use as utilisation and as a filling queue, KV forecasts, prefix credit, evictions and prefixes to compute again. A change to the prediction is made in both; this test
says where they part."""

from __future__ import annotations

import random

import pytest

from epp.datastore import Endpoint, EndpointMetrics, EndpointSpec, ModelStats, Outstanding, StepCosts
from epp.datastore.service_model import ServiceModel
from epp.scheduling.plugins.predicted_latency_producer import (_KV_FULL, PredictedLatencyProducer, _full_with_queue,
                                                               _kv_states, _kv_utilization)
from epp.scheduling.prefix_match import PrefixMatch
from epp.datastore import Datastore


def random_endpoint(rng: random.Random, i: int, now: float) -> Endpoint:
    ep = Endpoint(EndpointSpec(f"pod-{i}", f"10.0.0.{i}", 8000))
    max_seqs = rng.choice([4, 8, 256])
    ep.service = ServiceModel(prior=StepCosts(max_num_seqs=max_seqs, max_batched_tokens=rng.choice([2048, 8192])),
                              step_scale=rng.uniform(0.3, 3.0), prefill_scale=rng.uniform(0.3, 3.0),
                              ttft_bias=rng.choice([0.0, rng.uniform(-1.0, 1.0)]))
    load = ep.load
    t = now - rng.uniform(0.0, 30.0)
    for _ in range(rng.randint(0, 12)):
        t += rng.uniform(0.0, 2.0)
        item = Outstanding(rng.randint(1, 8000), 0, rng.randint(1, 500), t, predicted_ttft=rng.uniform(0.0, 2.0),
                           streamed=rng.random() < 0.7, model=rng.choice(["", "base", "lora-a", "lora-b"]))
        item.cached_tokens = rng.randint(0, item.prompt_tokens - 1)
        if rng.random() < 0.3:  # a prefix the pod is expected to compute again
            item.recompute_tokens = rng.randint(0, item.cached_tokens)
        load.add(item, t, rng.uniform(0.0, 3.0), 0.0, rng.choice([0.0, rng.uniform(0.0, 400_000.0)]))
        if rng.random() < 0.3:
            load.first_byte(item, t + rng.uniform(0.0, 1.0))
        load.step_seconds = rng.choice([0.0, rng.uniform(0.005, 0.1)])  # the pace of the pod's step count
        if rng.random() < 0.2:
            load.mark_scrape()
    if rng.random() < 0.5:
        load.settle(now - rng.uniform(0.0, 1.0))
    if rng.random() < 0.3:  # a pace of first tokens measured while backlogged
        load.busy_interval = rng.uniform(0.001, 0.5)
    blocks = rng.choice([0, 16, 4096])
    ep.metrics = EndpointMetrics(
        waiting_queue_size=rng.randint(0, 12), running_requests=rng.randint(0, 40),
        kv_cache_usage=rng.choice([rng.random(), rng.uniform(0.9, 1.0)]), models=frozenset({"base"}),
        active_models=frozenset(rng.sample(["lora-a", "lora-b", "lora-c"], rng.randint(0, 3))),
        max_active_models=rng.choice([0, 1, 2, 4]), cache_block_size=16 if blocks else 0, cache_num_blocks=blocks,
        update_time=now - 0.01)
    if rng.random() < 0.3:  # a pod seen full with requests waiting for a slot for a while
        running = rng.randint(1, 12)
        for t in range(3):
            ep.batch_limit.observe(running, rng.randint(1, 5), 0.2 + t * 0.01, 0, 8192)
    return ep


@pytest.mark.parametrize("seed", range(40))
def test_predict_all_equals_the_reference_on_random_states(seed: int) -> None:
    rng = random.Random(seed)
    now = 1000.0 + rng.uniform(0, 100)
    endpoints = [random_endpoint(rng, i, now) for i in range(rng.randint(1, 40))]
    producer = PredictedLatencyProducer(datastore=Datastore(), learn=rng.random() < 0.8,
                                        kv_time_charge=rng.random() < 0.8)
    stats = ModelStats()
    for _ in range(rng.randint(0, 50)):
        stats.observe(rng.randint(1, 20000), rng.randint(1, 5000), rng.randint(0, 800))
    prompt = rng.randint(1, 20000)
    output = rng.randint(1, 1000)
    match = None
    if rng.random() < 0.8:
        total = rng.randint(1, 300)
        match = PrefixMatch(total=total, block_size_tokens=16,
                            matched={ep.address: rng.randint(0, total) for ep in endpoints if rng.random() < 0.7},
                            tokens_per_block=rng.choice([0.0, 16.0, 3.7]))
        if rng.random() < 0.3:
            match.weighted = {a: v * rng.uniform(0.3, 1.0) for a, v in match.matched.items() if rng.random() < 0.5}
        if rng.random() < 0.5:
            match.evicted_tokens = {ep.address: rng.randint(0, 4000) for ep in endpoints if rng.random() < 0.4}
        if rng.random() < 0.5:
            match.recompute_share = {a: rng.uniform(0.0, 1.0) for a in match.matched if rng.random() < 0.5}
    model = rng.choice(["", "base", "lora-a", "lora-c", "lora-z"])
    arrivals = rng.choice([0.0, rng.uniform(0.0, 50.0)])
    certainty = rng.choice([0.0, 1.0, rng.uniform(0.0, 1.0)])
    kv_floor = rng.random() < 0.5
    kv_pressure = rng.random() < 0.5
    kv_forecast = rng.random() < 0.5
    fast = producer.predict_all(endpoints, match, prompt, output, now, stats, "src", arrivals, model, certainty,
                                kv_floor, kv_pressure, kv_forecast)
    for ep, got in zip(endpoints, fast):
        assert got == producer._predict(ep, match, prompt, output, now, stats, "src", arrivals, model,
                                        producer.assumed_batch_limit(endpoints), certainty, kv_floor,
                                        kv_pressure, kv_forecast), ep.name


@pytest.mark.parametrize("seed", range(20))
def test_kv_states_are_the_utilisations_and_counts_on_random_states(seed: int) -> None:
    rng = random.Random(seed)
    now = 1000.0
    endpoints = [random_endpoint(rng, i, now) for i in range(rng.randint(1, 30))]
    uses, with_room, full = _kv_states(endpoints)
    assert uses == [_kv_utilization(ep) for ep in endpoints]
    assert with_room == sum(1 for u in uses if u < _KV_FULL)
    assert full == sum(1 for ep in endpoints if _full_with_queue(ep.metrics))
