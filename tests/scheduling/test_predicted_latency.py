"""The predicted-latency path: what each candidate is predicted to cost, how the scorer ranks it,
and what the SLO filter keeps — through the real config loader and director."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from epp.api.request import Api, InferenceRequest
from epp.api.response import Usage
from epp.config.loader import load_config
from epp.core import build_core
from epp.datastore import Datastore, Endpoint, EndpointLoad, EndpointMetrics, EndpointSpec, Outstanding
from epp.errors import EppError
from epp.observability.metrics import EppMetrics
from epp.observability.trace import DecisionRecord
from epp.scheduling.framework import CycleState
from epp.scheduling.plugins._cold_reuse import ColdReuse
from epp.scheduling.plugins._prefix_rates import PrefixRates
from epp.scheduling.plugins.latency_scorer import LatencyScorer
from epp.scheduling.plugins.predicted_latency_producer import (_KV_FULL, PredictedLatencyProducer, _early_copy,
                                                               _kv_filling_charge, _kv_time_charge, _kv_utilization,
                                                               _reused_prefix)
from epp.scheduling.prediction import Prediction
from epp.scheduling.prefix_match import PrefixMatch

PODS = 4
FOUR_SLOTS = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: predicted-latency-producer, parameters: {maxNumSeqs: 4}}
- type: latency-scorer
"""  # a pod runs at most 4 requests at once


def pool(**metrics: object) -> Datastore:
    store = Datastore(clock=lambda: 100.0)
    for i in range(PODS):
        ep = store.upsert(EndpointSpec(name=f"pod-{i}", ip=f"10.0.0.{i + 1}", port=8000))
        ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99,
                                          **metrics))  # type: ignore[arg-type]
    return store


def request(prompt: str, *, priority: int = 0, slo_ttft: float | None = None, max_tokens: int | None = 100,
            model: str = "m") -> InferenceRequest:
    return InferenceRequest(request_id=f"r{random.random()}", api=Api.COMPLETIONS, model=model, target_model=model,
                            body={"model": model, "prompt": prompt}, prompt=prompt.encode(), max_tokens=max_tokens,
                            priority=priority, slo_ttft=slo_ttft, stream=True)


def predictions(store: Datastore, req: InferenceRequest, config: str | None = None) -> dict[str, Prediction]:
    core = build_core(store, config, tick=0.05, seed=1)
    cycle = CycleState()
    for producer in core.config.scheduler.producers:
        producer.prepare(cycle, req, list(store.endpoints()))
    return cycle.predictions


def credit_copies(producer: PredictedLatencyProducer, endpoints: list, found: list[Prediction], match: PrefixMatch,
                  now: float) -> None:
    """What `prepare` does for the copy credit: count the prefix's reuse, and credit copies once it has a rate."""
    reused = _reused_prefix(match)
    assert reused is not None
    depth, key = reused
    rate = producer._prefix_rates.hit(key, now)
    if rate > 0.0:
        producer._credit_copies(endpoints, found, match, depth, key, rate, now)


def queue_prefill(store: Datastore, index: int, tokens: int) -> None:
    ep = store.endpoints()[index]
    ep.load.add(Outstanding(tokens, 0, 100, 100.0, predicted_ttft=10.0), 100.0)


def test_queued_prefill_makes_a_pod_slower_in_seconds() -> None:
    store = pool()
    queue_prefill(store, 0, 20_000)
    p = predictions(store, request("x" * 4000))
    busy, idle = p["10.0.0.1:8000"], p["10.0.0.2:8000"]
    assert busy.queued_prefill == pytest.approx(20_000) and idle.queued_prefill == 0
    assert busy.ttft > idle.ttft + 0.3  # 20k tokens at ~20 µs each, in 3 steps
    assert idle.own_prefill == busy.own_prefill == 1000 and idle.cached_tokens == 0
    assert busy.prefill_seconds == busy.ttft and busy.wait_seconds == 0.0


def test_a_pod_with_the_prefix_cached_is_credited_with_it() -> None:
    store = pool()
    core = build_core(store, None, tick=0.05, seed=1)
    document = "d" * 40_000

    async def send() -> str:
        decision, record = await core.director.handle_request(request(document + " first"))
        core.director.release(record, Usage.of(10_000, 1))
        return decision.targets[0].address

    cached_on = asyncio.run(send())
    cycle = CycleState()
    req = request(document + " second question")
    for producer in core.config.scheduler.producers:
        producer.prepare(cycle, req, list(store.endpoints()))
    p = cycle.predictions
    assert p[cached_on].cached_tokens > 9_000
    others = [v for a, v in p.items() if a != cached_on]
    assert all(p[cached_on].ttft < o.ttft for o in others)
    assert all(p[cached_on].work_seconds < o.work_seconds for o in others)


def test_a_full_batch_waits_for_a_slot() -> None:
    store = pool()
    ep = store.endpoints()[0]
    for _ in range(4):
        item = Outstanding(100, 0, 200, 100.0, predicted_ttft=0.0)
        ep.load.add(item, 100.0)
        ep.load.first_byte(item, 100.0)
    p = predictions(store, request("q" * 400), FOUR_SLOTS)
    assert p["10.0.0.1:8000"].wait_seconds > 0.1 and p["10.0.0.2:8000"].wait_seconds == 0.0


def test_a_deep_slot_queue_is_ranked_at_least_at_the_pace_the_pod_admits_it() -> None:
    """Deeper than the expected ends looked up, the slot wait is ranked at least at the pod's
    measured pace of first tokens while backlogged (its slots free at that pace) times the queue
    ahead; the prediction keeps its own estimate. Without a measured pace, as before."""
    def ranked(interval: float) -> tuple[Prediction, Prediction]:
        store = pool()
        ep = store.endpoints()[0]
        for i in range(24):
            item = Outstanding(100, 0, 200, 99.0, predicted_ttft=0.0 if i < 4 else 0.5)
            ep.load.add(item, 99.0)
            if i < 4:
                ep.load.first_byte(item, 99.0)
        ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99,
                                          running_requests=4, waiting_queue_size=20))
        ep.load.busy_interval = interval
        found = predictions(store, request("q" * 400), FOUR_SLOTS)
        return found[ep.address], found[store.endpoints()[1].address]

    unmeasured, _ = ranked(0.0)
    deep, roomy = ranked(0.5)
    drain = 21 * 0.5  # the 20 waiting ahead and its own turn
    assert unmeasured.wait_seconds < drain / 2
    assert deep.wait_seconds == pytest.approx(drain, rel=0.01) and deep.cost > unmeasured.cost + drain / 2
    assert deep.paced_wait_seconds == pytest.approx(unmeasured.paced_wait_seconds)  # the prediction's own
    assert roomy.wait_seconds == 0.0


def test_a_pick_that_waits_for_a_slot_is_charged_the_wait_it_adds_to_the_requests_behind_it() -> None:
    """On a pod whose slots are all taken, a request holds one for its whole decode once it gets
    it, and the requests sent there while it waits queue behind it: each waits its share of the
    slots' time longer. Charged in the cost (`slot_charge`), by its length: a long generation
    far more than a short request, and nothing on a pod with a free slot. Without it, long
    generations gathered on the 32-slot pods of a pool that mixes them with 256-slot ones,
    their wait for a slot looking cheaper than their decode on the busier pods."""
    store = pool()
    full, roomy = store.endpoints()[:2]
    for i in range(4):
        item = Outstanding(100, 0, 2000, 99.0 + i * 0.1, predicted_ttft=0.0)
        full.load.add(item, 99.0 + i * 0.1)
        full.load.first_byte(item, 99.0 + i * 0.1)
    long = predictions(store, request("q" * 400, max_tokens=2000), FOUR_SLOTS)
    short = predictions(store, request("q" * 400, max_tokens=20), FOUR_SLOTS)
    p = long[full.address]
    assert p.wait_seconds > 0.0
    rate = full.load.rate_at(100.0)
    assert p.slot_charge == pytest.approx(rate * p.wait_seconds * 2000 * p.itl / 4, rel=0.01)
    assert short[full.address].slot_charge < p.slot_charge / 50
    assert long[roomy.address].slot_charge == 0.0
    assert "slot_charge=" in p.compact()
    off = FOUR_SLOTS.replace("maxNumSeqs: 4}", "maxNumSeqs: 4, slotCharge: false}")
    unc = predictions(store, request("q" * 400, max_tokens=2000), off)[full.address]
    assert unc.slot_charge == 0.0 and unc.cost == pytest.approx(p.cost - p.slot_charge)


def test_a_pick_on_a_full_kv_cache_with_a_queue_is_charged_the_cache_time_its_blocks_take() -> None:
    """A pod whose KV cache is full with a queue admits as running requests free blocks, so what
    a request costs the queued ones there is its new blocks (uncached prompt and output) over the
    cache's capacity, for as long as it holds them, once for each request queued (at most 19,
    the busy factor's cap). A hit on a document's holder brings few new blocks, a copy of the
    document many; a pod with room, or with no queue, charges nothing (`kv_time_charge`)."""
    store = pool()
    full, holder, roomy, idle_queue = store.endpoints()
    capacity = 16 * 20_000
    for ep in (full, holder):
        ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99,
                                          kv_cache_usage=0.97, waiting_queue_size=5, running_requests=30))
    idle_queue.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99,
                                              kv_cache_usage=0.97, waiting_queue_size=0, running_requests=30))
    producer = PredictedLatencyProducer(datastore=store)
    cycle = CycleState()
    cycle.data["match"] = PrefixMatch(total=400, block_size_tokens=16, matched={holder.address: 375},
                                      hashes=list(range(400)))
    producer.prefix_producer = SimpleNamespace(name="match")  # type: ignore[assignment]
    req = request("x" * 25_600, max_tokens=100)
    producer.prepare(cycle, req, list(store.endpoints()))
    found = cycle.predictions
    copy, hit = found[full.address], found[holder.address]
    # Both pods are in one state, so the decode they would hold their blocks for is the same.
    share_copy = (copy.own_prefill + copy.output_tokens) / capacity * 5
    decode = copy.kv_time_charge / share_copy - copy.prefill_work_seconds
    assert decode > 0.0
    share_hit = (hit.own_prefill + hit.output_tokens) / capacity * 5
    assert hit.kv_time_charge == pytest.approx(share_hit * (hit.prefill_work_seconds + decode))
    assert copy.kv_time_charge > 5 * hit.kv_time_charge
    assert found[roomy.address].kv_time_charge == 0.0 and found[idle_queue.address].kv_time_charge == 0.0
    assert "kv_time_charge=" in copy.compact()
    five = _kv_time_charge(full, 1_000, 2.0)
    assert five == pytest.approx(1_000 / capacity * 2.0 * 5)
    full.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99,
                                        kv_cache_usage=0.97, waiting_queue_size=500, running_requests=30))
    assert _kv_time_charge(full, 1_000, 2.0) == pytest.approx(five * 19 / 5)  # the cap
    stats = store.models.get(req.target_model)
    deep = PredictedLatencyProducer(datastore=store).predict(full, cycle.data["match"], copy.prompt_tokens,
                                                             copy.output_tokens, 100.0, stats)
    assert deep.kv_time_charge > copy.kv_time_charge
    off = PredictedLatencyProducer(datastore=store, kv_time_charge=False)
    unc = off.predict(full, cycle.data["match"], copy.prompt_tokens, copy.output_tokens, 100.0, stats)
    assert unc.kv_time_charge == 0.0 and unc.cost == pytest.approx(deep.cost - deep.kv_time_charge)


def test_a_long_generation_is_charged_on_a_pod_whose_kv_forecast_binds_before_its_cache_fills() -> None:
    """A pod lately sent many long generations will hold their blocks for a minute: its KV
    forecast (the KV token-seconds sent there per second) binds while its cache still reads
    20% used. A long generation is charged for filling it there, nowhere else; a short request
    is not (it is gone before the forecast's window is), nor is any while the model's output
    lengths are not yet learned (a request is expected to write all its max_tokens then)."""
    store = pool(kv_cache_usage=0.2)
    herded, *others = store.endpoints()
    capacity = 16 * 20_000
    for i in range(20):  # 20 long generations in 5 s, each 6,000 tokens held for a minute
        herded.load.add(Outstanding(4_000, 0, 2_000, 95.0 + i * 0.25, predicted_ttft=0.5), 95.0 + i * 0.25,
                        kv_token_seconds=6_000 * 60.0)
    assert herded.load.kv_forecast_at(100.0) > capacity  # what it was sent would overflow it
    producer = PredictedLatencyProducer(datastore=store)

    def charges(max_tokens: int) -> dict[str, float]:
        cycle = CycleState()
        producer.prepare(cycle, request("x" * 16_000, max_tokens=max_tokens), list(store.endpoints()))
        return {a: p.kv_time_charge for a, p in cycle.predictions.items()}

    assert set(charges(2_000).values()) == {0.0}  # nothing learned yet
    stats = store.models.get("m")
    for _ in range(50):
        stats.observe(16_000, 4_000, 2_000, max_tokens=2_000)  # they run to their max_tokens
    long = charges(2_000)
    assert long[herded.address] > 1.0  # seconds
    assert all(long[ep.address] == 0.0 for ep in others)
    assert set(charges(50).values()) == {0.0}
    off = PredictedLatencyProducer(datastore=store, kv_forecast_charge=False)
    cycle = CycleState()
    off.prepare(cycle, request("x" * 16_000, max_tokens=2_000), list(store.endpoints()))
    assert cycle.predictions[herded.address].kv_time_charge == 0.0


def test_a_flow_is_expected_to_write_what_its_own_responses_wrote() -> None:
    """A chat flow answers in ~100 tokens and a batch flow in ~1,000, both asking for up to 2,048:
    each request is predicted with its flow's length, so the batch job's decode is priced at ten
    times the chat's, not both at the model's mean of the mix."""
    store = pool()
    for _ in range(100):
        store.models.observe("m", "chat", 4_000, 1_000, 100, max_tokens=2_048)
        store.models.observe("m", "batch", 4_000, 1_000, 1_000, max_tokens=2_048)
    producer = PredictedLatencyProducer(datastore=store)

    def predicted(flow: str) -> Prediction:
        req = request("x" * 4_000, max_tokens=2_048)
        req.fairness_id = flow
        cycle = CycleState()
        producer.prepare(cycle, req, list(store.endpoints()))
        return next(iter(cycle.predictions.values()))

    chat, batch, unknown = predicted("chat"), predicted("batch"), predicted("someone-new")
    assert chat.output_tokens == 100 and batch.output_tokens == 1_000
    assert 400 < unknown.output_tokens < 700  # the model's: the two flows' mixture
    assert batch.decode_charge > 5 * chat.decode_charge


def test_a_pod_yet_to_show_its_batch_limit_is_held_to_the_one_its_pool_showed() -> None:
    """vLLM does not export max_num_seqs; each pod's scrapes reveal it (`BatchLimit`). Until a pod's
    own do, it is assumed to run the smallest limit another candidate has shown: else the pods
    that showed theirs look full and the one that has not draws every request."""
    store = pool()
    learned, unknown, idle, _ = store.endpoints()
    for ep in (learned, unknown):
        for _ in range(8):
            item = Outstanding(100, 0, 200, 100.0, predicted_ttft=0.0)
            ep.load.add(item, 100.0)
            ep.load.first_byte(item, 100.0)
    for t in range(4):  # requests waiting at its most running, the engine stepping each time
        learned.batch_limit.observe(8, 2, 0.2 + t * 0.01, 0, 8192)
    assert learned.batch_limit.taken and not unknown.batch_limit.taken
    p = predictions(store, request("q" * 400))
    assert p[unknown.address].wait_seconds > 0.05 and p[idle.address].wait_seconds == 0.0
    assert p[unknown.address].wait_seconds == pytest.approx(p[learned.address].wait_seconds)
    unknown.batch_limit.observe(9, 0, 0.5, 0, 8192)  # a pod seen running more is not held to it
    assert predictions(store, request("q" * 400))[unknown.address].wait_seconds == 0.0


def test_a_pod_that_runs_more_than_its_pool_showed_runs_another_configuration() -> None:
    """A pool mid-rollout, or groups given other engine flags: pods of 8 slots beside pods of
    many. A pod seen running more than the 8 the others showed is held to the configured limit
    (`maxNumSeqs`) until its own scrapes show one, not to the most it has run: held to that, it
    looked full at every count it reached."""
    store = pool()
    small, big, _, _ = store.endpoints()
    for t in range(4):
        small.batch_limit.observe(8, 2, 0.2 + t * 0.01, 0, 8192)
    big.batch_limit.observe(12, 0, 0.3, 0, 8192)
    for _ in range(12):  # as many in flight as it was ever seen running
        item = Outstanding(100, 0, 200, 100.0, predicted_ttft=0.0)
        big.load.add(item, 100.0)
        big.load.first_byte(item, 100.0)
    assert predictions(store, request("q" * 400))[big.address].wait_seconds == 0.0
    assert big.batch_limit.limit(8) == 12 and big.batch_limit.limit(8, 256) == 256
    for t in range(4):  # then its own scrapes show its limit
        big.batch_limit.observe(12, 3, 0.4 + t * 0.01, 0, 8192)
    assert big.batch_limit.limit(8, 256) == 12
    assert predictions(store, request("q" * 400))[big.address].wait_seconds > 0.0


def test_a_lora_adapter_without_a_free_slot_waits_for_one() -> None:
    store = pool(models=frozenset({"base"}), active_models=frozenset({"a", "b"}), max_active_models=2,
                 running_requests=4)
    for ep in store.endpoints()[1:]:
        ep.update_metrics(EndpointMetrics(models=frozenset({"base"}), active_models=frozenset({"c"}),
                                          max_active_models=2, cache_block_size=16, cache_num_blocks=20_000,
                                          update_time=99.99))
    ep0 = store.endpoints()[0]
    for _ in range(4):
        item = Outstanding(100, 0, 200, 100.0)
        ep0.load.add(item, 100.0)
        ep0.load.first_byte(item, 100.0)
    p = predictions(store, request("q" * 400, model="c"))
    assert p["10.0.0.1:8000"].wait_seconds > p["10.0.0.2:8000"].wait_seconds == 0.0


def test_the_scorer_ranks_on_cost_and_breaks_ties_by_work() -> None:
    def pred(cost: float, work: float) -> Prediction:
        return Prediction(ttft=cost, cost=cost, queued_prefill=0, own_prefill=1, cached_tokens=0, prompt_tokens=1,
                          output_tokens=1, prefill_seconds=cost, wait_seconds=0.0, itl=0.01, work_seconds=work)

    store = pool()
    eps = list(store.endpoints())
    cycle = CycleState()
    cycle.predictions = {eps[0].address: pred(0.10, 0.05), eps[1].address: pred(0.101, 0.01),
                         eps[2].address: pred(0.2, 0.01), eps[3].address: pred(0.4, 0.0)}
    scores = LatencyScorer().score(cycle, request("x"), eps)
    assert max(range(4), key=scores.__getitem__) == 1  # ties with 0 (within 2%), less work
    assert scores[2] == pytest.approx(0.5) and scores[3] == pytest.approx(0.25)


def test_a_shared_decode_overload_ranks_a_long_generation_by_ttft_within_its_charges_noise() -> None:
    """Every pod at its busy cap, a long generation's cost is its decode charge (tens of seconds)
    and differs between pods by that charge's noise: costs within 5% of the cheapest tie and the
    one predicted to answer first, and to delay the fewest others' first tokens, wins. With a
    candidate below its cap the tie is the usual 2%, ranked the same. Not for a request whose
    cost is mostly its own TTFT, nor among pods of different speeds."""
    def pred(ttft: float, cost: float, work: float) -> Prediction:
        return Prediction(ttft=ttft, cost=cost, queued_prefill=0, own_prefill=4000, cached_tokens=0,
                          prompt_tokens=4000, output_tokens=2000, prefill_seconds=ttft, wait_seconds=0.0,
                          itl=0.03, work_seconds=work, credited_ttft=ttft, decode_charge=cost - ttft,
                          at_busy_cap=True)

    store = pool()
    eps = list(store.endpoints())

    def ranked(found: list[Prediction]) -> int:
        cycle = CycleState()
        cycle.predictions = {ep.address: p for ep, p in zip(eps, found)}
        scores = LatencyScorer().score(cycle, request("x"), eps)
        return max(range(len(found)), key=scores.__getitem__)

    def overloaded() -> list[Prediction]:  # 20.0 s cheapest; 0.20 s to its first token against 0.45 s
        return [pred(0.45, 20.0, 1.0), pred(0.30, 20.6, 1.02), pred(0.20, 20.9, 0.99), pred(0.10, 21.5, 1.0)]

    found = overloaded()
    assert ranked(found) == 2  # 21.5 s is beyond 5%: out of the tie, however soon it answers
    assert all(p.overload_ranked for p in found) and "overload_ranked(decode_charge=20700.0ms)" in found[2].compact()
    found = overloaded()
    found[2].work_seconds = 0.6  # a faster kind of pod (a mixed pool): the charges differ by the speeds
    assert ranked(found) == 0 and not any(p.overload_ranked for p in found)
    found = overloaded()
    found[3].at_busy_cap = False  # a pod with headroom: the usual tie (2%), nothing within it
    assert ranked(found) == 0 and not any(p.overload_ranked for p in found)
    assert all(p.first_token_ranked for p in found) and "first_token_ranked(" in found[0].compact()
    found = overloaded()
    found[1].cost, found[3].at_busy_cap = 20.3, False  # within 2%: ranked by first token there too
    assert ranked(found) == 1
    found = overloaded()
    found[2].chunk_charge = 0.3  # its chunk would delay the first tokens of requests prefilling there
    assert ranked(found) == 1 and "chunk_charge=300.0ms" in found[2].compact()
    found = overloaded()
    for p in found:  # a short request: its cost mostly its own TTFT
        p.decode_charge = 0.5
    assert ranked(found) == 0 and not any(p.overload_ranked or p.first_token_ranked for p in found)


def test_a_long_generation_in_a_shared_overload_is_counted_and_traced_through_the_director() -> None:
    """Every pod sent more work lately than it can do (its busy factor at the cap): a long
    generation's pick is ranked on its first token, and SREs see that in the metrics and the
    trace; a short request's is not."""
    store = pool()
    for ep in store.endpoints():
        load = ep.load
        load.work_rate, load.prefill_rate, load.pick_rate = 1.4, 0.3, 30.0
        load.rates_at, load.rates_since = 100.0, 0.0
    core = build_core(store, None, tick=0.05, seed=1)
    metrics = EppMetrics(store)
    core.director.metrics = metrics
    decision, _ = asyncio.run(core.director.handle_request(request("q " * 3000, max_tokens=2000)))
    found = decision.result.cycle.predictions
    assert len(found) == PODS and all(p.at_busy_cap and p.overload_ranked for p in found.values())
    picked = found[decision.targets[0].address]
    assert picked.decode_charge > 4.0 * picked.credited_ttft
    record = DecisionRecord("r", 0.0, "m", "m", "", "", 0, "picked", result=decision.result)  # type: ignore[arg-type]
    assert all(row["overload_ranked"] and row["first_token_ranked"] and row["decode_charge_ms"] > 0
               and "chunk_charge_ms" in row for row in record.predictions())
    assert metrics.registry.get_sample_value("inference_extension_overload_ranked_picks_total") == 1.0
    decision, _ = asyncio.run(core.director.handle_request(request("q " * 200, max_tokens=20)))
    assert not any(p.overload_ranked for p in decision.result.cycle.predictions.values())
    assert metrics.registry.get_sample_value("inference_extension_overload_ranked_picks_total") == 1.0


def test_the_scorer_does_not_trade_a_requests_ttft_beyond_the_bound() -> None:
    """The cheapest pick by cost can be a slow idle pod that makes this request wait 2-3x the
    fastest one's time: the bound (1.5x the fastest + 20 ms; here whatever the pool's cold prompts
    do) keeps the pick among those predicted to answer within it, cheapest first, and says so."""
    def pred(ttft: float, cost: float) -> Prediction:
        return Prediction(ttft=ttft, cost=cost, queued_prefill=0, own_prefill=4000, cached_tokens=0,
                          prompt_tokens=4000, output_tokens=200, prefill_seconds=ttft, wait_seconds=0.0, itl=0.01,
                          work_seconds=ttft)

    def bounded() -> LatencyScorer:
        return LatencyScorer(ttft_bound_ratio=1.5, ttft_bound_max_reuse=1.0)

    store = pool()
    eps = list(store.endpoints())

    def ranked(scorer: LatencyScorer, *pairs: tuple[float, float]) -> tuple[list[float], list[Prediction]]:
        cycle = CycleState()
        found = [pred(t, c) for t, c in pairs]
        cycle.predictions = {ep.address: p for ep, p in zip(eps, found)}
        return scorer.score(cycle, request("x"), eps), found

    # fast busy pods (0.12 s to first token, costly for the requests after) against slow idle ones
    pairs = ((0.12, 0.55), (0.15, 0.60), (0.28, 0.40), (0.30, 0.41))
    scores, found = ranked(bounded(), *pairs)
    assert scores[2] == scores[3] == 0.0 and max(range(4), key=scores.__getitem__) == 0
    assert scores[1] == pytest.approx(0.55 / 0.60)
    assert found[2].beyond_bound == pytest.approx(0.28 - (0.12 * 1.5 + 0.02))
    assert found[0].ttft_bounded and found[1].ttft_bounded and not found[2].ttft_bounded
    assert "beyond_bound=80.0ms" in found[2].compact() and ",bounded" in found[0].compact()
    # a wider bound lets the cheapest through; 0 turns it off; by default it waits for the pool
    # to show that its cold prompts are not asked for again (here: no evidence)
    for scorer in (LatencyScorer(ttft_bound_ratio=2.5, ttft_bound_max_reuse=1.0),
                   LatencyScorer(ttft_bound_ratio=0.0, ttft_bound_max_reuse=1.0), LatencyScorer()):
        scores, found = ranked(scorer, *pairs)
        assert max(range(4), key=scores.__getitem__) == 2 and not any(p.beyond_bound for p in found)
    # the default bounds a cold prompt once the pool's cold prompts are mostly not asked for again
    cycle = CycleState()
    found = [pred(t, c) for t, c in pairs]
    for p in found:
        p.cold_prompts_reused = 0.2
    cycle.predictions = {ep.address: p for ep, p in zip(eps, found)}
    assert max(range(4), key=LatencyScorer().score(cycle, request("x"), eps).__getitem__) == 0
    # and not a prompt a pod holds a quarter of (there, by cost: the first turn of a chat, say)
    found[3].cached_tokens = 1000
    assert max(range(4), key=LatencyScorer().score(cycle, request("x"), eps).__getitem__) == 2
    # beyond it but clearly cheaper (it saves the others more than twice what this request loses:
    # a long generation kept off a busy pod, a prefix not evicted), a candidate stays
    scores, found = ranked(bounded(), (0.12, 0.55), (0.15, 0.60), (0.28, 0.30), (0.30, 0.41))
    assert max(range(4), key=scores.__getitem__) == 2 and scores[3] == 0.0 and not found[2].beyond_bound
    # the fastest pod has more prefill queued than this prompt's: the TTFTs are queues, unbounded
    cycle = CycleState()
    found = [pred(t, c) for t, c in pairs]
    found[0].queued_prefill = 5000
    cycle.predictions = {ep.address: p for ep, p in zip(eps, found)}
    assert max(range(4), key=bounded().score(cycle, request("x"), eps).__getitem__) == 2
    # within the bound the cost decides, and nothing is marked
    scores, found = ranked(bounded(), (0.12, 0.55), (0.15, 0.40), (0.16, 0.45), (0.18, 0.50))
    assert max(range(4), key=scores.__getitem__) == 1
    assert not any(p.beyond_bound or p.ttft_bounded for p in found)
    # a candidate beyond the bound that was not the cheapest: marked, but the bound made no pick
    scores, found = ranked(bounded(), (0.12, 0.40), (0.15, 0.60), (0.28, 0.50), (0.13, 0.45))
    assert scores[2] == 0.0 and found[2].beyond_bound > 0 and not any(p.ttft_bounded for p in found)
    # beyond it because of a wait for a batch slot or KV blocks (a long generation's best pod is
    # full): a queue, which the cost ranks; kept
    cycle = CycleState()
    found = [pred(t, c) for t, c in pairs]
    found[2].wait_seconds = 0.2
    cycle.predictions = {ep.address: p for ep, p in zip(eps, found)}
    scores = bounded().score(cycle, request("x"), eps)
    assert max(range(4), key=scores.__getitem__) == 2 and scores[3] == 0.0
    # a saturated pool is ranked for its throughput, unbounded
    cycle = CycleState()
    found = [pred(t, c) for t, c in pairs]
    for p in found:
        p.saturated = True
    cycle.predictions = {ep.address: p for ep, p in zip(eps, found)}
    scores = bounded().score(cycle, request("x"), eps)
    assert max(range(4), key=scores.__getitem__) == 2 and not any(p.beyond_bound for p in found)


def test_a_long_cold_prompt_is_not_sent_to_a_slow_idle_pod_to_spare_the_busy_fast_ones() -> None:
    """A pool mixing GPU types: the fast pods are busy, the slow ones idle. By cost, a long cold
    prompt belongs on a slow pod (there its prefill and decode delay fewer requests), where it
    would wait 2.4x what a fast pod gives it. Through the real director, the bound keeps it on a
    fast pod and SREs see why, once the pool has shown that its cold prompts are not asked for
    again (unrelated API calls); while they are (a document's first request, whose later ones
    follow it by cache affinity), or with the bound off, it goes to the slow pod."""
    def route(parameters: str, cold_prompts_reused: float | None = None
              ) -> tuple[str, dict[str, Prediction], EppMetrics, object]:
        store = pool()
        endpoints = list(store.endpoints())
        for ep in endpoints[2:]:  # A100s beside H100s, as learned
            ep.service.step_scale, ep.service.prefill_scale = 1.6, 2.5
        for ep in endpoints[:2]:  # busy: 70% of their time, 20 picks a second
            load = ep.load
            load.work_rate = load.prefill_rate = 0.7
            load.pick_rate = 20.0
            load.rates_at, load.rates_since = 100.0, 0.0
        core = build_core(store, with_parameters("latency-scorer", parameters), tick=0.05, seed=1)
        producer = next(p for p in core.config.scheduler.producers if isinstance(p, PredictedLatencyProducer))
        producer.eviction_charge = False  # (the fast pods' caches turn over in ~10 s: tested on its own)
        if cold_prompts_reused is not None:
            producer.cold_reuse.share = cold_prompts_reused
        metrics = EppMetrics(store)
        core.director.metrics = metrics
        decision, _ = asyncio.run(core.director.handle_request(request("q " * 4000, max_tokens=300)))
        return decision.targets[0].address, decision.result.cycle.predictions, metrics, decision.result

    fast = {"10.0.0.1:8000", "10.0.0.2:8000"}
    for parameters, reused in (("{}", None), ("{}", 0.9), ("{ttftBoundRatio: 0}", 0.0)):
        unbounded, found, _, _ = route(parameters, reused)
        assert unbounded not in fast
        assert found[unbounded].cost < min(found[a].cost for a in fast)
        assert found[unbounded].ttft > 2.0 * max(found[a].ttft for a in fast)
    for parameters, reused in (("{}", 0.1), ("{ttftBoundMaxReuse: 1}", None)):
        picked, found, metrics, result = route(parameters, reused)
        assert picked in fast and found[picked].ttft_bounded
    slow = next(a for a in found if a not in fast)
    assert found[slow].beyond_bound == pytest.approx(found[slow].ttft - (1.5 * found[picked].ttft + 0.02))
    record = DecisionRecord("r", 0.0, "m", "m", "", "", 0, "picked", result=result)  # type: ignore[arg-type]
    rows = {row["address"]: row for row in record.predictions()}
    assert rows[slow]["beyond_bound_ms"] > 0 and rows[picked]["ttft_bounded"]
    assert metrics.registry.get_sample_value("inference_extension_ttft_bounded_picks_total") == 1.0
    _, _, metrics, _ = route("{}", 0.1)
    assert metrics.registry.get_sample_value("inference_extension_cold_prompt_reuse_ratio") == pytest.approx(0.1)


def test_the_share_of_cold_prompts_asked_for_again_is_learned_from_the_block_keys() -> None:
    """`ColdReuse`: a cold prompt is remembered by one key inside its first half; a later request
    sharing that much of it counts it reused (and is told it came back), the window passing first
    counts it not. Starts at 1
    (no evidence: the bound stays out), bounded in memory, and blind to short prompts and to
    prompts a pod already holds."""
    def prompt(doc: int, blocks: int, tail: int = 0) -> list[int]:
        return [hash((doc, i)) for i in range(blocks)] + [hash((doc, "q", tail, i)) for i in range(4)]

    documents = ColdReuse(window=10.0, alpha=0.1)
    for doc in range(40):  # each document's first request is cold, its second (3 s on) shares it
        assert not documents.observe(prompt(doc, 60), 0, doc * 1.0)
        assert documents.observe(prompt(doc, 60, tail=1), 60, doc * 1.0 + 3.0)  # it came back
    assert documents.share > 0.9 and documents.resolved >= 30

    unrelated = ColdReuse(window=10.0, alpha=0.1)
    for i in range(200):  # API calls: every prompt its own, two a second
        unrelated.observe(prompt(1000 + i, 40), 0, i * 0.5)
    assert unrelated.share < 0.1 and unrelated.resolved == 200 - len(unrelated)
    assert len(unrelated) <= 21  # the last window's only

    warm = ColdReuse(window=10.0, alpha=0.1)
    for i in range(100):  # held by a pod (or too short to matter): never remembered
        warm.observe(prompt(2000 + i, 40), 30, i * 0.5)
        warm.observe([hash(("short", i))] * 3, 0, i * 0.5)
    assert (warm.share, warm.resolved, len(warm)) == (1.0, 0, 0)

    small = ColdReuse(window=1e9, capacity=8, alpha=0.1)
    for i in range(50):
        small.observe(prompt(3000 + i, 40), 0, float(i))
    assert len(small) == 8 and small.resolved == 42 and small.share < 0.1


def with_parameters(plugin_type: str, parameters: str) -> str:
    """A config of one plugin with `parameters` (YAML flow), the latency scorer after it."""
    config = f"""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: {plugin_type}
  parameters: {parameters}
"""
    return config if plugin_type == "latency-scorer" else config + "- type: latency-scorer\n"


def test_the_ttft_bound_is_a_validated_config_parameter() -> None:
    def scorer(parameters: str) -> LatencyScorer:
        plugin = load_config(with_parameters("latency-scorer", parameters), pool()).plugins["latency-scorer"]
        assert isinstance(plugin, LatencyScorer)
        return plugin

    default = scorer("{}")
    assert (default.ttft_bound_ratio, default.ttft_bound_slack, default.ttft_bound_max_reuse) == (
        1.5, pytest.approx(0.02), 0.5)
    assert scorer("{ttftBoundMaxReuse: 1}").ttft_bound_max_reuse == 1.0
    wide = scorer("{ttftBoundRatio: 2, ttftBoundSlackMs: 5}")
    assert (wide.ttft_bound_ratio, wide.ttft_bound_slack) == (2.0, pytest.approx(0.005))
    assert scorer("{ttftBoundRatio: 0}").ttft_bound_ratio == 0.0
    for bad in ("{ttftBoundRatio: 0.5}", "{ttftBoundRatio: -1}", "{ttftBoundSlackMs: -3}", "{ttftBoundRatio: wide}",
                "{ttftBoundMaxReuse: 1.5}", "{ttftBoundMaxReuse: -0.1}"):
        with pytest.raises(Exception, match="ttftBound"):
            scorer(bad)


def test_slo_mode_sheds_a_sheddable_request_no_pod_can_serve_in_time() -> None:
    store = pool()
    for i in range(PODS):
        queue_prefill(store, i, 100_000)  # every pod: seconds of prefill queued
    core = build_core(store, None, tick=0.05, seed=1)

    async def run(req: InferenceRequest) -> str:
        decision, record = await core.director.handle_request(req)
        core.director.release(record)
        return decision.targets[0].address

    with pytest.raises(EppError) as err:
        asyncio.run(run(request("x" * 400, priority=-1, slo_ttft=0.2)))
    assert err.value.http_status == 429
    asyncio.run(run(request("x" * 400, priority=0, slo_ttft=0.2)))  # not sheddable: served anyway
    asyncio.run(run(request("x" * 400, priority=-1)))  # no objective: served
    store.endpoints()[2].load = type(store.endpoints()[2].load)()  # one pod drains
    assert asyncio.run(run(request("x" * 400, priority=-1, slo_ttft=0.2))) == "10.0.0.3:8000"


def test_the_prediction_error_and_slo_outcomes_are_reported() -> None:
    store = pool()
    seen: list[tuple[str, float, float]] = []

    class Sink:
        def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
            def record(*args: object) -> None:
                if name in ("ttft_predicted", "slo_outcome"):
                    seen.append((name, *args[1:]))  # type: ignore[arg-type]
            return record

    core = build_core(store, None, tick=0.05, seed=1)
    core.director.metrics = Sink()  # type: ignore[assignment]
    times = iter([100.0, 100.0, 100.0, 100.05, 100.05, 100.3, 100.3])
    store.clock = lambda: next(times, 100.3)

    async def run() -> None:
        decision, record = await core.director.handle_request(request("x" * 400, slo_ttft=0.1))
        core.director.first_byte(record)
        core.director.release(record, Usage.of(100, 10))

    asyncio.run(run())
    names = [name for name, *_ in seen]
    assert names == ["ttft_predicted", "slo_outcome"] and seen[1][1] == "met"
    ep = next(e for e in store.endpoints() if e.service.observations)
    assert ep.service.observations >= 1
    assert all(e.load.requests == 0 and e.inflight_requests == 0 for e in store.endpoints())


def test_a_prefill_is_charged_for_the_prefills_it_holds_up_not_for_the_decodes_beside_it() -> None:
    """A long prompt's prefill delays the prefills queued behind it (FCFS), and more so on a pod
    whose prefill is busy; decode steps run beside each prefill chunk, so a pod kept busy by
    decodes does not make that prefill hold anyone up longer. The first version amplified the
    prefill by the pod's whole utilisation: on long-document traffic a cold prompt looked dearer
    on a decode-busy pod than it was, and hot prefixes stayed on too few pods."""
    store = pool()
    decode_busy, prefill_busy = store.endpoints()[1], store.endpoints()[2]
    # The same pod-seconds of work lately sent to each (rates at 100.0, no decay): all decode on
    # one, mostly prefill on the other.
    # one decoding request each: what runs there now is the same, only the recent work differs.
    for ep, prefill_seconds in ((decode_busy, 0.0), (prefill_busy, 7.0)):
        ep.load.rates_since = 0.0  # watched for 100 s: (almost) no warm-up correction
        item = Outstanding(100, 0, 100, 100.0)
        ep.load.add(item, 100.0, work_seconds=8.0, prefill_seconds=prefill_seconds)
        ep.load.first_byte(item, 100.0)
    assert decode_busy.load.utilization_at(100.0) == prefill_busy.load.utilization_at(100.0) == pytest.approx(0.8, rel=1e-3)
    assert prefill_busy.load.prefill_utilization_at(100.0) == pytest.approx(0.7, rel=1e-3)
    assert decode_busy.load.prefill_utilization_at(100.0) == 0.0
    p = predictions(store, request("x" * 40_000, max_tokens=1))  # ~10k uncached tokens, one output token
    idle = p["10.0.0.1:8000"]
    on_decodes, on_prefills = p["10.0.0.2:8000"], p["10.0.0.3:8000"]
    extra = lambda q: q.cost - q.ttft  # noqa: E731 - what the pick costs others
    assert extra(on_prefills) > 2.0 * extra(on_decodes)
    assert extra(on_decodes) < 2.0 * extra(idle) + 0.01


def test_a_prompt_longer_than_a_step_is_charged_for_the_requests_arriving_while_it_blocks() -> None:
    """A prompt beyond the step's token budget fills whole steps alone, and every request sent to
    its pod meanwhile waits for the rest of it: half of it on average, at the pod's pick rate
    (M/G/1's λ·S²/2). Without that, a cold copy of a long document on a pod others' requests keep
    coming to looked as cheap as on an idle one (the warm-up's cold-copy storm). A prompt that
    fits one step blocks nobody for longer than a step, and is not charged for it."""
    store = pool()
    busy, idle = store.endpoints()[0], store.endpoints()[1]
    busy.load.rates_since, busy.load.rates_at, busy.load.pick_rate = 0.0, 100.0, 2.0  # 2 picks/s, all done
    extra = lambda q: q.cost - q.ttft  # noqa: E731 - what the pick costs others
    long = predictions(store, request("x" * 80_000, max_tokens=1))  # ~20k tokens: 2.5 steps' budget
    p = long["10.0.0.1:8000"]
    blocking = p.prefill_work_seconds * (p.own_prefill - 8192) / p.own_prefill
    assert blocking > 0.2
    charged = extra(p) - extra(long["10.0.0.2:8000"])
    assert charged == pytest.approx(2.0 * blocking * blocking / 2, rel=0.05)
    short = predictions(store, request("x" * 24_000, max_tokens=1))  # ~6k tokens: within one step
    assert extra(short["10.0.0.1:8000"]) - extra(short["10.0.0.2:8000"]) < 0.005
    assert idle.load.rate_at(100.0) == 0.0


DOC_CHARS = 10_000  # ~2,500 tokens, and a question of ~600: within what the approximate index hashes


def route_document_requests(copy_credit: bool, documents: int = 1, count: int = 60,
                            gap: float = 0.02, metrics: object = None, results: list[object] | None = None,
                            first_gap: float | None = None, kv_usage: float = 0.0,
                            waiting: int = 0, young_copy: bool = False) -> list[tuple[str, Prediction]]:
    """Route `count` questions over `documents` shared documents, `gap` seconds apart, none
    ending (each first byte comes when predicted): the chosen pod and its prediction, per request.
    `kv_usage`, `waiting`: the share of every pod's KV cache its last scrape showed in use, and
    the requests it showed waiting. `young_copy`: `youngCopyCredit` (off: the other cases alone)."""
    now = [100.0]
    store = Datastore(clock=lambda: now[0])
    for i in range(PODS):
        ep = store.upsert(EndpointSpec(name=f"pod-{i}", ip=f"10.0.0.{i + 1}", port=8000))
        ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, kv_cache_usage=kv_usage,
                                          waiting_queue_size=waiting, update_time=now[0]))
    config = f"""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: predicted-latency-producer
  parameters: {{copyCredit: {str(copy_credit).lower()}, youngCopyCredit: {str(young_copy).lower()}}}
- type: latency-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{{pluginRef: latency-scorer}}, {{pluginRef: max-score-picker}}]
"""
    core = build_core(store, config, tick=0.05, seed=1)
    if metrics is not None:
        core.director.metrics = metrics(store)  # type: ignore[operator]
    picks: list[tuple[str, Prediction]] = []
    first_bytes: list[tuple[float, object]] = []

    async def run() -> None:
        for i in range(count):
            arrival = now[0] + (first_gap if i == 1 and first_gap is not None else gap)
            for due, record in sorted((f for f in first_bytes if f[0] <= arrival), key=lambda f: f[0]):
                now[0] = due
                core.director.first_byte(record)  # type: ignore[arg-type]
                first_bytes.remove((due, record))
            now[0] = arrival
            document = chr(ord("a") + i % documents) * DOC_CHARS
            decision, record = await core.director.handle_request(request(document + f" {i:07d}" * 300,
                                                                          max_tokens=200))
            address = decision.targets[0].address
            picks.append((address, decision.result.cycle.predictions[address]))
            first_bytes.append((now[0] + picks[-1][1].ttft, record))
            if results is not None:
                results.append(decision.result)

    asyncio.run(run())
    return picks


def test_a_prompt_is_charged_for_the_first_tokens_it_delays_in_the_step_it_joins() -> None:
    """vLLM packs the waiting prefills into one step, first come first served: a long prompt sent
    to a pod whose queued short prompts fit in one step fills the rest of that step with its
    chunk, and each of them gets its first token that much later. The first version saw only
    this request's own TTFT, so it put long prompts beside short ones and the short ones' TTFT
    tail was 1.1x the oracle's on the head-of-line workload."""
    store = pool()
    last = {}
    for index, short in ((1, 3), (2, 1)):
        for _ in range(short):
            last[index] = Outstanding(100, 0, 1, 100.0, predicted_ttft=0.05)
            store.endpoints()[index].load.add(last[index], 100.0)
    p = predictions(store, request("x" * 8000, max_tokens=1))  # ~2k tokens, in the same step
    idle, three, one = p["10.0.0.1:8000"], p["10.0.0.2:8000"], p["10.0.0.3:8000"]
    extra = lambda q: q.cost - q.ttft  # noqa: E731 - what the pick costs others
    assert extra(three) - extra(idle) == pytest.approx(3 * (extra(one) - extra(idle)), rel=0.05)
    assert extra(one) - extra(idle) > 0.5 * one.prefill_work_seconds  # the chunk is its whole prefill
    # Once their first tokens are out, it holds nobody up.
    for index, item in last.items():
        store.endpoints()[index].load.first_byte(item, 100.05)
    p = predictions(store, request("x" * 8000, max_tokens=1))
    assert extra(p["10.0.0.2:8000"]) == pytest.approx(extra(p["10.0.0.1:8000"]), abs=1e-3)


def test_a_hot_prefix_is_copied_once_its_holder_is_overloaded() -> None:
    made: list[EppMetrics] = []

    def metrics(store: Datastore) -> EppMetrics:
        made.append(EppMetrics(store))
        return made[-1]

    # The document's first question alone (its ~80 ms prefill is over before the next), then one
    # every 25 ms: a hit's prefill takes about that, and the decodes pile up (none end), so its
    # holder falls behind until copying the document elsewhere pays.
    results: list[object] = []
    with_credit = route_document_requests(True, gap=0.025, first_gap=0.1, metrics=metrics, results=results)
    without = route_document_requests(False, gap=0.025, first_gap=0.1)

    def first_copy(picks: list[tuple[str, Prediction]]) -> int:
        return next((i for i, (address, _) in enumerate(picks) if address != picks[0][0]), len(picks))

    copied = first_copy(with_credit)
    assert 1 < copied < first_copy(without)  # not at once (the holder is idle then), but sooner
    address, chosen = with_credit[copied]
    assert chosen.cached_tokens == 0 and chosen.copy_credit > 0.0
    # and the copies pay: the prefix's requests wait less over the run.
    mean_ttft = [sum(p.ttft for _, p in picks) / len(picks) for picks in (with_credit, without)]
    assert mean_ttft[0] < 0.95 * mean_ttft[1]  # (its reuse rate is read over 3 s at least: 1.5 s of it)
    # The credit never makes a copy look cheaper than a hit: at most the prefill it costs.
    assert all(p.copy_credit <= p.prefill_work_seconds for _, p in with_credit)
    assert all(p.copy_credit == 0.0 for _, p in without)
    # SREs see the copies being made, and the credit given for them: in the decision trace,
    record = DecisionRecord("r", 0.0, "m", "m", "", "", 0, "picked", result=results[copied])  # type: ignore[arg-type]
    rows = {row["address"]: row for row in record.predictions()}
    assert rows[address]["copy_credit_ms"] == round(chosen.copy_credit * 1e3, 2) > 0
    assert f"copy={chosen.copy_credit * 1e3:.1f}ms/busy" in chosen.compact()
    assert rows[address]["copy_reason"] == "busy"  # (within the document's first seconds: not `choice`)
    # and in the metrics.
    registry = made[0].registry
    reasons = [p.copy_reason for _, p in with_credit if p.copy_credit > 0.0]
    assert set(reasons) <= {"choice", "busy"}  # one speed: a sole holder, then busy holders
    for reason in ("choice", "busy"):
        assert (registry.get_sample_value("inference_extension_prefix_copies_total", {"reason": reason})
                or 0.0) == reasons.count(reason)
    assert registry.get_sample_value("inference_extension_prefix_copy_credit_seconds_total") == pytest.approx(
        sum(p.copy_credit for _, p in with_credit))


def test_a_long_prefix_gets_a_second_copy_in_its_first_seconds_onto_an_idle_pod_with_room() -> None:
    """In a prefix's first seconds of reuse, while one pod holds it, an idle pod whose cache stays
    under half full with it takes a second copy as a hit would (`youngCopyCredit`): later the
    copy would cost a request a whole cold prefill, now the second request would mostly wait for
    the first's. Once, the prefix on two pods; not onto caches that fill, nor with it off."""
    made: list[EppMetrics] = []

    def metrics(store: Datastore) -> EppMetrics:
        made.append(EppMetrics(store))
        return made[-1]

    picks = route_document_requests(True, gap=0.025, first_gap=0.1, young_copy=True, metrics=metrics)
    holder = picks[0][0]
    # (The second request is the prefix's first reuse: its rate is known from the third.)
    first = next(i for i, (address, _) in enumerate(picks) if address != holder)
    copy = picks[first][1]
    assert first == 2 and copy.cached_tokens == 0
    assert copy.copy_reason == "young" and 0.0 < copy.copy_credit <= copy.prefill_work_seconds
    reasons = [p.copy_reason for _, p in picks if p.copy_credit > 0.0]
    assert reasons.count("young") == 1  # a second holder, not a third
    assert made[0].registry.get_sample_value("inference_extension_prefix_copies_total", {"reason": "young"}) == 1.0
    # Not onto caches already over half full (the copy stays, and would push other prefixes out),
    fuller = route_document_requests(True, gap=0.025, first_gap=0.1, young_copy=True, kv_usage=0.6)
    assert fuller[2][0] == holder and all(p.copy_reason != "young" for _, p in fuller)
    # nor with it off: the second request goes to the holder.
    off = route_document_requests(True, gap=0.025, first_gap=0.1)
    assert off[2][0] == holder and all(p.copy_reason != "young" for _, p in off)


def test_a_young_prefix_gets_more_copies_while_its_holder_is_still_computing_it() -> None:
    """Requests for a new document arriving together: while the best holder still has a long
    prefix's worth of prefill queued (its first computation of the document), a request would
    wait that out there, so an idle pod with room takes a third copy, and more, as a hit would
    (`young`). Spaced out, the holder is done by the third request: a second holder, not a third
    (the test above)."""
    made: list[EppMetrics] = []

    def metrics(store: Datastore) -> EppMetrics:
        made.append(EppMetrics(store))
        return made[-1]

    results: list[object] = []
    burst = route_document_requests(True, gap=0.005, count=8, young_copy=True, metrics=metrics, results=results)
    young = [i for i, (_, p) in enumerate(burst) if p.copy_reason == "young"]
    assert len(young) >= 2 and len({address for address, _ in burst}) == PODS
    for i in young:
        predictions = results[i].cycle.predictions  # type: ignore[attr-defined]
        holders = [p for p in predictions.values() if p.cached_tokens > 0]
        assert holders and min(holders, key=lambda p: p.cost).queued_prefill >= 2_048
    assert made[0].registry.get_sample_value("inference_extension_prefix_copies_total",
                                             {"reason": "young"}) == len(young)
    # Without the credit the same burst copies on the holders' queue alone (`busy`), less credited.
    off = route_document_requests(True, gap=0.005, count=8)
    assert all(p.copy_reason != "young" for _, p in off)


def test_a_young_prefix_is_copied_early_only_onto_an_idle_pod_for_a_long_prefix() -> None:
    """`_early_copy`'s conditions, one at a time: prefill queued on the candidate, a prefix
    shorter than `_LONG_PREFIX_TOKENS`, an eviction there, or a cache it would leave half full."""
    store = pool()
    ep = store.endpoints()[1]
    match = PrefixMatch(total=200, block_size_tokens=16, matched={store.endpoints()[0].address: 200})

    def prediction(own: int, queued: float = 0.0, prompt: int = 3_300) -> Prediction:
        return Prediction(ttft=0.1, cost=0.1, queued_prefill=queued, own_prefill=own, cached_tokens=prompt - own,
                          prompt_tokens=prompt, output_tokens=200, prefill_seconds=0.1, wait_seconds=0.0, itl=0.01)

    best = prediction(100)
    assert _early_copy(ep, prediction(3_300), best, match)
    assert not _early_copy(ep, prediction(3_300, queued=10.0), best, match)
    assert not _early_copy(ep, prediction(2_000), best, match)  # 1,900 tokens of prefix: short
    match.evicted_tokens[ep.address] = 1_000
    assert not _early_copy(ep, prediction(3_300), best, match)
    match.evicted_tokens.clear()
    big = 200_000  # of the pod's 320,000 tokens: past half with it
    assert not _early_copy(ep, prediction(big, prompt=big), prediction(big - 3_200, prompt=big), match)


def test_no_copy_goes_where_the_kv_has_no_room_for_it() -> None:
    """A copy adds capacity only where the pod's KV can take it: on pods whose requests in flight
    fill their caches (deep overload), the copy's blocks would wait for others to end and push
    another prefix out. The same traffic that earns copies on roomy pods earns none there."""
    roomy = route_document_requests(True, gap=0.025, first_gap=0.1)
    full = route_document_requests(True, gap=0.025, first_gap=0.1, kv_usage=0.999)
    assert any(p.copy_credit > 0.0 for _, p in roomy)
    assert all(p.copy_credit == 0.0 for _, p in full)


def test_a_saturated_pool_keeps_a_prefix_on_its_holder() -> None:
    """Every pod's KV cache full with a queue: the pool is past its capacity, and a copy of the
    document is the same prefill done again, work the pool cannot absorb. Charged at the
    utilisation cap, the document's requests stay on its holder far longer as its queue grows
    (none of them ends here); with the same full caches and no queue anywhere, the second
    request already goes elsewhere."""
    made: list[EppMetrics] = []

    def metrics(store: Datastore) -> EppMetrics:
        made.append(EppMetrics(store))
        return made[-1]

    def first_copy(picks: list[tuple[str, Prediction]]) -> int:
        return next((i for i, (address, _) in enumerate(picks) if address != picks[0][0]), len(picks))

    results: list[object] = []
    kept = route_document_requests(True, gap=0.01, kv_usage=0.999, waiting=3, metrics=metrics, results=results)
    spread = route_document_requests(True, gap=0.01, kv_usage=0.999)
    assert first_copy(kept) > first_copy(spread) + 5
    assert all(p.saturation_charge == 0.0 for _, p in spread)
    # The charge is the premium (the document's prefill the holder does not do) at the cap,
    # u / (1 - u) with u = 0.95, on each pod without the document; never on the holder.
    holder, at = kept[0][0], first_copy(kept) - 1  # the last pick the holder kept
    last = results[at].cycle.predictions  # type: ignore[attr-defined]
    hit = last[holder]
    assert hit.saturation_charge == 0.0 and hit.cached_tokens > 0
    for address, p in last.items():
        if address != holder:
            assert p.cached_tokens == 0
            assert p.saturation_charge == pytest.approx(19.0 * (p.prefill_work_seconds - hit.prefill_work_seconds),
                                                        rel=0.01)
            assert p.cost - p.saturation_charge < hit.cost  # copied, but for the charge
    # SREs see it: per candidate in the decision trace and x-epp-decision, and counted.
    record = DecisionRecord("r", 0.0, "m", "m", "", "", 0, "picked", result=results[at])  # type: ignore[arg-type]
    rows = {row["address"]: row for row in record.predictions()}
    other = next(a for a in last if a != holder)
    assert rows[other]["saturation_charge_ms"] == round(last[other].saturation_charge * 1e3, 2) > 0
    assert f"saturated={last[other].saturation_charge * 1e3:.1f}ms" in last[other].compact()
    assert "saturated=" not in hit.compact()
    assert rows[other]["saturated"] and rows[holder]["saturated"]
    registry = made[0].registry
    assert registry.get_sample_value("inference_extension_saturated_pool_picks_total") == len(kept)


def test_the_saturated_ranking_needs_every_pod_full_with_a_queue_and_can_be_turned_off() -> None:
    def charged(config: str | None = None, **metrics: object) -> bool:
        store = pool(**metrics)
        producer = PredictedLatencyProducer(datastore=store, saturated_pool=config != "off", young_prefix_charge=False)
        producer.prefix_producer = LatencyScorer("match")  # only its name: where the match is found
        holder = store.endpoints()[0].address
        cycle = CycleState()
        cycle.data["match"] = PrefixMatch(total=8, block_size_tokens=16, matched={holder: 8}, hashes=list(range(8)))
        producer.prepare(cycle, request("x" * 4000), list(store.endpoints()))
        assert cycle.predictions[holder].saturation_charge == 0.0
        saturated = {p.saturated for p in cycle.predictions.values()}
        assert len(saturated) == 1  # the pool's state, the same for every candidate
        assert saturated.pop() == any(p.saturation_charge > 0.0 for p in cycle.predictions.values())
        return any(p.saturation_charge > 0.0 for p in cycle.predictions.values())

    assert charged(kv_cache_usage=0.95, waiting_queue_size=2)
    assert not charged("off", kv_cache_usage=0.95, waiting_queue_size=2)
    assert not charged(kv_cache_usage=0.95, waiting_queue_size=0)
    assert not charged(kv_cache_usage=0.5, waiting_queue_size=2)
    store = pool(kv_cache_usage=0.95, waiting_queue_size=2)  # one pod with room: no charge
    ep = store.endpoints()[3]
    ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, kv_cache_usage=0.4,
                                      waiting_queue_size=0, update_time=99.99))
    producer = PredictedLatencyProducer(datastore=store, young_prefix_charge=False)
    producer.prefix_producer = LatencyScorer("match")
    cycle = CycleState()
    cycle.data["match"] = PrefixMatch(total=8, block_size_tokens=16, matched={store.endpoints()[0].address: 8},
                                      hashes=list(range(8)))
    producer.prepare(cycle, request("x" * 4000), list(store.endpoints()))
    assert all(p.saturation_charge == 0.0 for p in cycle.predictions.values())


def test_a_saturated_pool_is_ranked_without_the_externality() -> None:
    """Every pod full with a queue: what a pick adds to the requests after it is the same work on
    whichever pod it lands, and its estimate follows each queue's noise, so the cost is the
    credited TTFT with the prefill the pod computes again (and a copy's charge), the slot and
    KV-time charges 0. With one pod's cache roomy the pool is not saturated, and the full pods'
    costs count the cache time the request's blocks take there."""
    def ranked(roomy: bool) -> dict[str, Prediction]:
        store = pool(kv_cache_usage=0.95, waiting_queue_size=6, running_requests=40)
        if roomy:
            store.endpoints()[3].update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000,
                                                                kv_cache_usage=0.4, update_time=99.99))
        return predictions(store, request("x" * 4000))

    saturated = ranked(False)
    for p in saturated.values():
        assert p.saturated and p.slot_charge == 0.0 and p.kv_time_charge == 0.0
        assert p.cost == pytest.approx(p.credited_ttft + p.recompute_seconds + p.saturation_charge + p.tail_charge
                                       - p.copy_credit)
    full = [p for address, p in ranked(True).items() if address != "10.0.0.4:8000"]
    assert all(not p.saturated and p.kv_time_charge > 0.0 for p in full)
    assert all(p.cost > p.credited_ttft + p.recompute_seconds + p.kv_time_charge for p in full)


def test_a_copy_of_a_prefix_in_its_first_seconds_of_reuse_is_charged_at_the_candidates_queue() -> None:
    """In its first seconds of reuse a prefix's holder is likely still computing it, and a copy is
    the same prefill twice: a candidate with prefill queued is charged the copy's premium at the
    load its queue shows (u / (1 - u), u the share of its next step the queue fills; the cap's at
    a full step), an idle one nothing, so a burst on an idle pool still spreads. Past those
    seconds, or with `youngPrefixCharge` off, no charge."""
    now = [100.0]
    store = pool()
    store.clock = lambda: now[0]
    endpoints = list(store.endpoints())
    holder, light, heavy, idle = endpoints
    queue_prefill(store, 1, 2_048)  # a quarter of a step queued
    queue_prefill(store, 2, 20_000)  # more than two steps
    match = PrefixMatch(total=200, block_size_tokens=16, matched={holder.address: 200}, hashes=list(range(200)))

    def prepare(producer: PredictedLatencyProducer) -> dict[str, Prediction]:
        producer.prefix_producer = LatencyScorer("match")  # only its name: where the match is found
        cycle = CycleState()
        cycle.data["match"] = match
        producer.prepare(cycle, request("x" * 16_000), endpoints)
        return cycle.predictions

    producer = PredictedLatencyProducer(datastore=store)
    found = prepare(producer)
    hit = found[holder.address]
    assert hit.saturation_charge == 0.0 and not hit.young_prefix and hit.cached_tokens > 0
    assert found[idle.address].queued_prefill == 0 and found[idle.address].saturation_charge == 0.0
    for ep in (light, heavy):
        p = found[ep.address]
        premium = PredictedLatencyProducer._own_prefill_seconds(holder, p.own_prefill, 0) - hit.prefill_work_seconds
        u = min(0.95, p.queued_prefill / 8192)
        assert p.queued_prefill > 0 and p.young_prefix and not p.saturated
        assert p.saturation_charge == pytest.approx(premium * u / (1.0 - u))
        assert f"young_prefix={p.saturation_charge * 1e3:.1f}ms" in p.compact()
    assert found[heavy.address].saturation_charge == pytest.approx(
        19.0 * found[light.address].saturation_charge / (0.25 / 0.75), rel=0.01)  # at the cap
    now[0] += 3.5  # past the prefix's first seconds of reuse
    assert all(p.saturation_charge == 0.0 for p in prepare(producer).values())
    now[0] = 100.0
    assert all(p.saturation_charge == 0.0 for p in prepare(PredictedLatencyProducer(
        datastore=store, young_prefix_charge=False)).values())


def test_a_saturated_pools_copy_is_charged_at_the_holders_speed_whatever_the_candidates() -> None:
    """Past its capacity a pod admits as its running requests end, not at its prefill rate, so a
    fast GPU absorbs a copy of a document no better than a slow one: the copy's premium is priced
    at the best holder's speed, the same for a fast and a slow candidate (at each candidate's own
    speed, copies onto the fast pods looked cheap and documents piled up there)."""
    store = pool(kv_cache_usage=0.95, waiting_queue_size=2)
    endpoints = list(store.endpoints())
    holder, fast, slow = endpoints[0], endpoints[1], endpoints[2]
    for ep in (holder, slow):  # A100s beside H100s, as learned
        ep.service.step_scale, ep.service.prefill_scale = 1.6, 2.5
    producer = PredictedLatencyProducer(datastore=store)
    producer.prefix_producer = LatencyScorer("match")  # only its name: where the match is found
    cycle = CycleState()
    cycle.data["match"] = PrefixMatch(total=200, block_size_tokens=16, matched={holder.address: 200},
                                      hashes=list(range(200)))
    producer.prepare(cycle, request("x" * 16_000), endpoints)
    found = cycle.predictions
    hit = found[holder.address]
    assert hit.saturation_charge == 0.0 and hit.cached_tokens > 0
    premium = PredictedLatencyProducer._own_prefill_seconds(holder, found[fast.address].own_prefill, 0) \
        - hit.prefill_work_seconds
    for ep in (fast, slow):
        assert found[ep.address].saturation_charge == pytest.approx(19.0 * premium)
    assert found[fast.address].prefill_work_seconds < 0.5 * found[slow.address].prefill_work_seconds


def test_a_prompt_a_pod_does_not_hold_is_charged_the_queue_its_filling_cache_will_make() -> None:
    """While the pool's caches bind (a candidate full with a queue in the last 10 s), a prompt a
    pod does not hold is charged its new blocks' share of the cache's time for the queue a cache
    that full makes, rho^2 / (1 - rho) (rho at most 0.95): many times more on a 0.85-full cache
    than on a 0.3-full one; nothing on the pod that holds its prefix (it brings fewer blocks
    there than anywhere), nothing where no cache has bound lately; off with
    `kvFillingCharge: false`."""
    store = pool()
    filling, roomy, holder, full = store.endpoints()
    capacity = 16 * 20_000
    for ep, use in ((filling, 0.85), (roomy, 0.3), (holder, 0.85), (full, 0.3)):
        ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99,
                                          kv_cache_usage=use, running_requests=30))
    match = PrefixMatch(total=500, block_size_tokens=16, matched={holder.address: 450}, hashes=list(range(500)))

    def prepare(producer: PredictedLatencyProducer, now: float) -> list[Prediction]:
        store.clock = lambda: now
        cycle = CycleState()
        cycle.data["match"] = match
        producer.prefix_producer = SimpleNamespace(name="match")  # type: ignore[assignment]
        producer.prepare(cycle, request("x" * 32_000, max_tokens=400), list(store.endpoints()))
        return [cycle.predictions[ep.address] for ep in store.endpoints()]

    producer, off = PredictedLatencyProducer(datastore=store), PredictedLatencyProducer(datastore=store,
                                                                                         kv_filling_charge=False)
    assert all(p.kv_time_charge == 0.0 for p in prepare(producer, 100.0))  # no cache has bound
    prepare(off, 100.0)  # (both see the same requests)
    full.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99,
                                        kv_cache_usage=0.95, waiting_queue_size=3, running_requests=30))
    prepare(producer, 100.0)
    prepare(off, 100.0)
    full.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=104.99,
                                        kv_cache_usage=0.3, running_requests=30))  # its queue gone, 5 s on
    charged, cheap, hit, _ = prepare(producer, 105.0)
    own, output = charged.own_prefill, charged.output_tokens
    rho = 0.85 + (own + output * 0.5) / capacity
    seconds = charged.kv_time_charge / ((own + output) / capacity * rho * rho / (1.0 - rho))
    assert seconds > charged.prefill_work_seconds
    assert 0.0 < cheap.kv_time_charge < charged.kv_time_charge / 10
    assert hit.kv_time_charge == 0.0 and hit.cached_tokens * 2 > hit.prompt_tokens
    unc = prepare(off, 105.0)[0]
    assert unc.kv_time_charge == 0.0 and unc.cost == pytest.approx(charged.cost - charged.kv_time_charge)
    assert all(p.kv_time_charge == 0.0 for p in prepare(producer, 110.5))  # 10 s since the cache bound
    capped = (8_400 / capacity) * 2.0 * 0.95 ** 2 / 0.05
    assert _kv_filling_charge(0.94, capacity, 8_000, 400, 2.0) == pytest.approx(capped)


@pytest.mark.parametrize("parameter, attribute", [("saturatedPool", "saturated_pool"),
                                                  ("drainCharge", "drain_charge"),
                                                  ("kvUtilization", "kv_utilization"),
                                                  ("evictionCharge", "eviction_charge"),
                                                  ("slotCharge", "slot_charge"),
                                                  ("youngPrefixCharge", "young_prefix_charge"),
                                                  ("kvTimeCharge", "kv_time_charge"),
                                                  ("kvFillingCharge", "kv_filling_charge"),
                                                  ("kvForecastCharge", "kv_forecast_charge")])
def test_the_saturated_ranking_and_the_drain_charge_are_validated_config_parameters(parameter: str,
                                                                                      attribute: str) -> None:
    def producer(parameters: str) -> PredictedLatencyProducer:
        core = build_core(pool(), with_parameters("predicted-latency-producer", parameters), tick=0.05, seed=1)
        return next(p for p in core.config.scheduler.producers if isinstance(p, PredictedLatencyProducer))

    assert getattr(producer("{}"), attribute)  # on by default
    assert not getattr(producer(f"{{{parameter}: false}}"), attribute)
    with pytest.raises(Exception, match=parameter):
        producer(f"{{{parameter}: often}}")


def drain_charged(full_pods: int, warm: bool = False, drain_charge: bool = True) -> tuple[str, dict[str, Prediction]]:
    """A ~1,000-token prompt over `PODS` idle pods of which the first `full_pods` show a full KV
    cache with three waiting and give a first token every 0.4 s while backlogged; `warm`: the
    first pod holds all of the prompt. The first pod's address and every candidate's prediction."""
    store = pool()
    for ep in store.endpoints()[:full_pods]:
        ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99,
                                          kv_cache_usage=0.95, waiting_queue_size=3))
        ep.load.busy_interval = 0.4
    producer = PredictedLatencyProducer(datastore=store, drain_charge=drain_charge)
    producer.prefix_producer = LatencyScorer("match")  # only its name: where the match is found
    first = store.endpoints()[0].address
    cycle = CycleState()
    cycle.data["match"] = PrefixMatch(total=100, block_size_tokens=16, matched={first: 100} if warm else {},
                                      hashes=list(range(100)))
    producer.prepare(cycle, request("x" * 4000), list(store.endpoints()))
    return first, cycle.predictions


def test_a_cold_prompt_is_charged_a_full_pods_drain_while_most_of_the_pool_has_room() -> None:
    """A full pod with a queue admits as its running requests end: its credited TTFT reads as a
    pod with room would, so the cost of a cold prompt there is charged what its drain (its queue
    at its measured pace) adds to it. Not for a prompt the pod holds (moving it would cost its
    affinity), not once most of the pool is full (cold prompts would pile onto the few pods with
    room), not on a saturated pool (ranked for its throughput), not when turned off."""
    first, got = drain_charged(1)
    full = got[first]
    assert full.drain_seconds == pytest.approx(0.4)
    assert full.drain_charge == pytest.approx(full.drain_seconds - full.credited_ttft)
    assert full.drain_charge > 0.3
    assert all(p.drain_charge == 0.0 for address, p in got.items() if address != first)
    _, uncharged = drain_charged(1, drain_charge=False)
    assert full.cost == pytest.approx(uncharged[first].cost + full.drain_charge)
    assert full.ttft == uncharged[first].ttft  # the prediction does not move
    assert f"drain_charge={full.drain_charge * 1e3:.1f}ms" in full.compact()
    result = SimpleNamespace(cycle=SimpleNamespace(predictions=got))
    record = DecisionRecord("r", 0.0, "m", "m", "", "", 0, "picked", result=result)  # type: ignore[arg-type]
    rows = {row["address"]: row for row in record.predictions()}
    assert rows[first]["drain_charge_ms"] == round(full.drain_charge * 1e3, 2)

    first, half = drain_charged(PODS // 2)
    assert half[first].drain_charge > 0.0  # half the pool has room: still charged
    for pods in (PODS // 2 + 1, PODS):  # most of the pool full, or all of it (saturated)
        _, most = drain_charged(pods)
        assert all(p.drain_charge == 0.0 for p in most.values())
    first, warm = drain_charged(1, warm=True)
    assert warm[first].cached_tokens * 2 >= warm[first].prompt_tokens and warm[first].drain_seconds > 0.0
    assert warm[first].drain_charge == 0.0


def kv_filled(kv_usage: list[float], kv_utilization: bool = True) -> dict[str, Prediction]:
    """A cold 1,000-token prompt expecting 800 tokens of output over `PODS` pods alike in compute
    (each decoding one request of ours), whose last scrapes show `kv_usage` of their KV caches
    in use and no queue: every candidate's prediction."""
    store = pool()
    for ep, usage in zip(store.endpoints(), kv_usage):
        ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99,
                                          kv_cache_usage=usage, running_requests=1))
        item = Outstanding(500, 0, 200, 99.0, predicted_ttft=0.05)
        ep.load.add(item, 99.0, 0.2)  # a fifth of the pod's compute, read over the second it covers
        ep.load.first_byte(item, 99.05)
        ep.load.mark_scrape()
    producer = PredictedLatencyProducer(datastore=store, kv_utilization=kv_utilization)
    cycle = CycleState()
    producer.prepare(cycle, request("x" * 4000, max_tokens=800), list(store.endpoints()))
    return cycle.predictions


def test_a_pod_whose_kv_cache_is_fuller_than_its_compute_is_as_busy_as_its_cache() -> None:
    """The externality's busy factor takes the larger of a pod's compute utilisation and the
    share of its KV cache in use: a pod whose running requests fill its cache admits the next
    only as they end, however fast its steps. The prediction does not move, only what the pick
    is charged; and only while at least half the pool has room elsewhere."""
    got = kv_filled([0.85, 0.1, 0.1, 0.1])
    addresses = list(got)
    full, roomy = got[addresses[0]], got[addresses[1]]

    def externality(p: Prediction) -> float:
        return p.cost - p.credited_ttft

    # 1 / (1 - 0.85) against the roomy pods' compute-bound factor: several times the charge.
    assert externality(full) > 4.0 * externality(roomy) > 0.0
    assert full.ttft == roomy.ttft
    off = kv_filled([0.85, 0.1, 0.1, 0.1], kv_utilization=False)
    assert off[addresses[0]].cost == pytest.approx(off[addresses[1]].cost)
    assert off[addresses[0]].ttft == full.ttft
    assert off[addresses[1]].cost == pytest.approx(roomy.cost, rel=0.05)  # 0.1 used: its compute is busier
    # Half the pool still has room: charged. Most of it full: there is nowhere else to go, and
    # the KV says nothing a pick could use (the B2B overload shapes: every cache is full).
    half = kv_filled([0.95, 0.95, 0.1, 0.1])
    assert externality(half[addresses[0]]) > 4.0 * externality(half[addresses[2]])
    most = kv_filled([0.95, 0.95, 0.95, 0.1])
    baseline = kv_filled([0.95, 0.95, 0.95, 0.1], kv_utilization=False)
    assert all(most[a].cost == pytest.approx(baseline[a].cost) for a in addresses)


def evicting(reused: float, *, blocks: int = 2000, warm: bool = False, busy_pods: int = 1, returned: bool = True,
             eviction_charge: bool = True) -> tuple[list[str], dict[str, Prediction]]:
    """A ~1,000-token prompt over `PODS` idle pods of `blocks` KV blocks each, when `reused` of the
    pool's cold prompts come back; the first `busy_pods` have lately been sent 0.8 pod-seconds of
    prefill per second (their caches turn over fast when small); `warm`: the first holds the prompt;
    `returned`: it came in cold a second before."""
    store = pool()
    for ep in store.endpoints():
        ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=blocks, update_time=99.99))
    for busy in store.endpoints()[:busy_pods]:
        item = Outstanding(4000, 0, 50, 99.0, predicted_ttft=0.05)
        busy.load.add(item, 99.0, 0.9, 0.8)
        busy.load.first_byte(item, 99.05)
        busy.load.mark_scrape()
    producer = PredictedLatencyProducer(datastore=store, eviction_charge=eviction_charge)
    producer.prefix_producer = LatencyScorer("match")  # only its name: where the match is found
    if returned:
        producer.cold_reuse.observe(list(range(64)), 0, 99.0)
    producer.cold_reuse.share = reused
    addresses = [ep.address for ep in store.endpoints()]
    cycle = CycleState()
    cycle.data["match"] = PrefixMatch(total=64, block_size_tokens=16, matched={addresses[0]: 64} if warm else {},
                                      hashes=list(range(64)))
    producer.prepare(cycle, request("x" * 4000), list(store.endpoints()))
    return addresses, cycle.predictions


def test_a_copy_on_a_pod_whose_cache_turns_over_fast_is_charged_its_recompute() -> None:
    """A prompt that comes back soon after it came in cold is placed for its later requests too;
    on a pod whose cache turns over (its capacity over the uncached tokens per second lately sent
    there) in under 30 s they likely find it evicted and compute it again. That recompute is
    charged: its own prefill there x the pool's reuse share x (1 - turnover / 30 s). Not on a pod
    that keeps it (a large cache, or no prefill sent), not on a pod that holds the prompt, not
    for a prompt that has not come back, not where cold prompts are mostly not reused, not when
    turned off; the prediction does not move. Only while at least a quarter of the candidates'
    caches outlast the 30 s."""
    addresses, got = evicting(0.9)
    busy, idle = got[addresses[0]], got[addresses[1]]
    assert 0.0 < busy.eviction_charge <= 0.9 * busy.prefill_work_seconds
    assert busy.eviction_charge > 0.7 * busy.prefill_work_seconds  # 32k tokens at ~13k tokens/s: 2.5 s
    assert all(got[a].eviction_charge == 0.0 for a in addresses[1:])
    _, off = evicting(0.9, eviction_charge=False)
    assert busy.cost == pytest.approx(off[addresses[0]].cost + busy.eviction_charge)
    assert busy.ttft == off[addresses[0]].ttft and idle.cost == pytest.approx(off[addresses[1]].cost)
    assert f"eviction_charge={busy.eviction_charge * 1e3:.1f}ms" in busy.compact()
    result = SimpleNamespace(cycle=SimpleNamespace(predictions=got))
    record = DecisionRecord("r", 0.0, "m", "m", "", "", 0, "picked", result=result)  # type: ignore[arg-type]
    assert {row["address"]: row for row in record.predictions()}[addresses[0]]["eviction_charge_ms"] == \
        round(busy.eviction_charge * 1e3, 2)
    # The charge falls as the turnover nears the horizon, and a cache that outlasts it keeps the copy.
    _, larger = evicting(0.9, blocks=8000)
    assert 0.0 < larger[addresses[0]].eviction_charge < busy.eviction_charge
    _, roomy = evicting(0.9, blocks=40_000)
    assert roomy[addresses[0]].eviction_charge == 0.0
    _, warm = evicting(0.9, warm=True)
    assert warm[addresses[0]].own_prefill * 2 < warm[addresses[0]].prompt_tokens
    assert warm[addresses[0]].eviction_charge == 0.0
    _, one_off = evicting(0.3)  # API calls: where one lands says nothing of later requests
    assert all(p.eviction_charge == 0.0 for p in one_off.values())
    _, first = evicting(0.9, returned=False)  # its first request: it may never come back
    assert all(p.eviction_charge == 0.0 for p in first.values())
    # While a quarter of the pool keeps what it is sent; not where every cache turns over fast (an
    # overload: there is nowhere to keep a copy).
    _, most = evicting(0.9, busy_pods=PODS - PODS // 4)
    assert all(most[a].eviction_charge > 0.0 for a in addresses[:PODS - PODS // 4])
    _, every = evicting(0.9, busy_pods=PODS)
    assert all(p.eviction_charge == 0.0 for p in every.values())


def test_kv_use_counts_the_uncached_prompts_sent_since_the_scrape() -> None:
    """A prompt that hits a prefix the pod holds shares its blocks: only the prefill the EPP sent
    since the pod's last scrape adds to the use it showed."""
    from epp.scheduling.plugins.predicted_latency_producer import _kv_utilization

    store = pool(kv_cache_usage=0.5)
    ep = store.endpoints()[0]
    ep.load.mark_scrape()
    assert _kv_utilization(ep) == pytest.approx(0.5)
    ep.load.add(Outstanding(9000, 6000, 100, 100.0, predicted_ttft=0.1), 100.0)  # 3,000 uncached
    assert _kv_utilization(ep) == pytest.approx(0.5 + 3000 / 320_000)
    ep.load.mark_scrape()
    assert _kv_utilization(ep) == pytest.approx(0.5)  # the next scrape shows what it holds
    ep.update_metrics(EndpointMetrics(update_time=99.99))  # a pod that does not say its cache size
    assert _kv_utilization(ep) == 0.0


def test_kv_use_counts_the_output_the_decoding_requests_have_yet_to_write() -> None:
    """A scrape shows what the running requests hold, not what they will: a long generation grows
    its blocks until it ends. Half of each decoding request's expected output is counted (about
    half way through it), so a pod full of long generations reads fuller than one as full now
    whose requests are about to end."""
    from epp.scheduling.plugins.predicted_latency_producer import _kv_utilization

    store = pool(kv_cache_usage=0.5)
    long_gens, short_ones = store.endpoints()[:2]
    items = []
    for ep, output in ((long_gens, 8000), (short_ones, 20)):
        for _ in range(10):
            item = Outstanding(1000, 0, output, 99.0, predicted_ttft=0.05)
            ep.load.add(item, 99.0)
            ep.load.first_byte(item, 99.05)
            items.append((ep, item))
        ep.load.mark_scrape()
    assert _kv_utilization(long_gens) == pytest.approx(0.5 + 10 * 4000 / 320_000)
    assert _kv_utilization(short_ones) == pytest.approx(0.5 + 10 * 10 / 320_000)
    for ep, item in items:
        ep.load.release(item, 100.0)
    assert _kv_utilization(long_gens) == pytest.approx(0.5)  # ended: nothing more to write


def test_a_saturated_pool_prefers_the_holder_that_still_has_the_prefix() -> None:
    """Two pods hold a document by the index; one's requests in flight pin more prefixes than its
    cache holds, so it is expected to compute the document again (`recompute_share`). The ranking
    keeps the whole credit (a document's requests stay together) and sees them equal; a saturated
    pool ranks on what each will compute again, and the pod that still holds it wins."""
    def costs(**metrics: object) -> tuple[Prediction, Prediction]:
        store = pool(**metrics)
        producer = PredictedLatencyProducer(datastore=store)
        producer.prefix_producer = LatencyScorer("match")
        thrashing, holding = store.endpoints()[0].address, store.endpoints()[1].address
        cycle = CycleState()
        cycle.data["match"] = PrefixMatch(total=200, block_size_tokens=16, matched={thrashing: 190, holding: 190},
                                          hashes=list(range(200)), recompute_share={thrashing: 0.8})
        producer.prepare(cycle, request("x" * 13_000), list(store.endpoints()))
        return cycle.predictions[thrashing], cycle.predictions[holding]

    thrashing, holding = costs(kv_cache_usage=0.5)
    assert thrashing.recompute_tokens > 0 and thrashing.recompute_seconds > 0.0 == holding.recompute_seconds
    assert thrashing.ttft > holding.ttft  # reported as it will be,
    assert thrashing.cost == pytest.approx(holding.cost)  # ranked on the whole credit
    thrashing, holding = costs(kv_cache_usage=0.95, waiting_queue_size=4)
    assert thrashing.saturated and thrashing.cost == pytest.approx(holding.cost + thrashing.recompute_seconds)


def test_a_prefix_seen_once_is_no_reason_to_copy_it() -> None:
    # Every question brings its own document: nothing is reused, nothing is credited.
    picks = route_document_requests(True, documents=60, count=60)
    assert all(p.copy_credit == 0.0 for _, p in picks)


def test_prefix_rates_count_reuse_and_stay_bounded() -> None:
    rates = PrefixRates(10.0, capacity=4)
    assert rates.hit(1, 0.0) == 0.0  # the first request is no evidence of reuse
    # A second request a moment after the first is no evidence of a high rate: read as if from
    # 3 s of history (uncorrected it read 5/s).
    assert rates.hit(1, 0.2) < 0.4
    rate = 0.0
    for i in range(1, 10):  # 2/s over its first five seconds: bias-corrected while young
        rate = rates.hit(1, 0.2 + i * 0.5)
    assert 1.6 < rate < 2.4
    for i in range(1, 300):  # 2/s for a long while
        rate = rates.hit(1, 5.0 + i * 0.5)
    assert 1.8 < rate < 2.2
    for key in range(2, 7):
        rates.hit(key, 200.0)
    assert len(rates) == 4 and rates.hit(1, 201.0) == 0.0  # the least recently seen went first


def test_prefix_rates_average_the_holders_excess_over_the_keys_requests() -> None:
    rates = PrefixRates(10.0)
    assert rates.excess(1) == 0.0  # nothing known
    rates.hit(1, 0.0)
    rates.record_excess(1, 0.5, 0.0)  # its first seconds: the holder computes the prefix, no evidence
    assert rates.excess(1) == 0.0
    rates.hit(1, 3.0)
    rates.record_excess(1, 0.04, 3.0)
    assert rates.excess(1) == pytest.approx(0.04)
    for i in range(1, 10):  # an idle holder since: the average falls
        rates.hit(1, 3.0 + i * 0.5)
        rates.record_excess(1, 0.0, 3.0 + i * 0.5)
    assert rates.excess(1) == pytest.approx(0.004, rel=0.3)
    rates.hit(1, 1_000.0)  # long ago: the old samples weigh nothing beside a new one
    rates.record_excess(1, 0.02, 1_000.0)
    assert rates.excess(1) == pytest.approx(0.02)
    rates.record_excess(2, 1.0, 1_000.0)  # a key never hit is not recorded
    assert rates.excess(2) == 0.0 and len(rates) == 1


def test_the_copy_credit_counts_the_prefix_traffic_other_workers_route() -> None:
    """A worker sees only its share of a prefix's requests; the shared ledger's pick rates say
    how much the pool routes, and the credit scales with it."""
    def credits(pool_rate: float) -> list[float]:
        store = pool()
        producer = PredictedLatencyProducer(datastore=store)
        endpoints = list(store.endpoints())
        holder = endpoints[0].address
        match = PrefixMatch(total=8, block_size_tokens=16, matched={holder: 8}, hashes=list(range(8)))
        out = []
        for i in range(3):
            now = 100.0 + 1.0 * i
            producer._arrival_rate(now)
            for ep in endpoints:  # the pool's picks as the shared ledger shows them
                ep.load.pick_rate, ep.load.rates_at = pool_rate / len(endpoints), now
            found = [Prediction(0.5, 0.5, 0.0, 10, 118, 128, 10, 0.5, 0.0, 0.01, prefill_work_seconds=0.001)]
            found += [Prediction(0.3, 0.3, 0.0, 128, 0, 128, 10, 0.3, 0.0, 0.01, prefill_work_seconds=0.2)
                      for _ in endpoints[1:]]
            credit_copies(producer, endpoints, found, match, now)
            out.append(found[1].copy_credit)
            assert found[0].copy_credit == 0.0  # the holder is never credited
            # at most the premium: the candidate's prefill of the prefix, at its own speed
            premium = 0.2 - producer._own_prefill_seconds(endpoints[1], 10, 118)
            assert all(p.copy_credit <= premium + 1e-12 for p in found)
        return out

    alone, with_others = credits(0.0), credits(1_000.0)
    assert alone[0] == with_others[0] == 0.0  # a prefix's first request is no evidence of reuse
    assert 0.0 < alone[1] < with_others[1]


def test_a_pod_whose_requests_stall_is_predicted_as_late_as_they_are() -> None:
    """The ledger's timeline says a pod's queue is long done, yet its requests have had no first
    byte for seconds (stuck on KV blocks): the prediction adds how late they are, so new requests
    go elsewhere — once the pod has ever answered (else a missing first byte tells nothing)."""
    store = pool()
    stuck = store.endpoints()[0]
    stuck.load.add(Outstanding(500, 0, 100, 80.0, predicted_ttft=0.1), 80.0)
    before = predictions(store, request("x" * 400))
    assert before[stuck.address].wait_seconds == 0.0  # never answered: no evidence
    for ep in store.endpoints():
        ep.service.observations = 5
    after = predictions(store, request("x" * 400))
    assert after[stuck.address].wait_seconds == pytest.approx(100.0 - 80.1)
    assert after[stuck.address].ttft > 19.0
    others = [p.ttft for address, p in after.items() if address != stuck.address]
    assert max(others) < 1.0


def document_questions(holder_scales: tuple[float, float], gap: float, prefill_utilization: float = 0.0,
                       fast_holder_queue: int | None = None, held_blocks: int = 375) -> list[Prediction]:
    """Six questions over one document (7,200-token prompts), `gap` seconds apart, on an idle pool
    whose first pod (step and prefill scales `holder_scales`) holds the document's first
    `held_blocks` blocks; with `fast_holder_queue`, the second pod (full speed) holds them too,
    with that many prefill tokens queued. The last question's predictions, copies credited."""
    store = pool()
    producer = PredictedLatencyProducer(datastore=store)
    endpoints = list(store.endpoints())
    holder = endpoints[0]
    holder.service.step_scale, holder.service.prefill_scale = holder_scales
    matched = {holder.address: held_blocks}
    others = endpoints[1:]
    if fast_holder_queue is not None:
        matched[endpoints[1].address] = held_blocks
        if fast_holder_queue:
            queue_prefill(store, 1, fast_holder_queue)
        others = endpoints[2:]
    match = PrefixMatch(total=450, block_size_tokens=16, matched=matched, hashes=list(range(450)))
    stats = store.models.get("m")
    found: list[Prediction] = []
    for i in range(6):
        now = 100.0 + gap * i
        for ep in others:
            load = ep.load  # (a pod's work includes its prefill)
            load.work_rate = load.prefill_rate = prefill_utilization
            load.rates_at, load.rates_since = now, 0.0
        found = producer.predict_all(endpoints, match, 7_200, 100, now, stats)
        credit_copies(producer, endpoints, found, match, now)
    return found


def test_a_prefix_held_only_by_a_slower_pod_is_copied_to_a_faster_one() -> None:
    """In a pool that mixes GPU types, documents placed before the EPP learned which pods are
    slower stay there: for each request alone a hit on the slow pod beats a cold copy elsewhere.
    A copy on a clearly faster pod that pays its premium back within one window of the prefix's
    requests is credited in full (it ranks as a hit would); the same pods at one speed give no
    such credit, and neither does a prefix reused too rarely to pay it back."""
    slow = document_questions((1.6, 2.5), gap=1.0)  # an A100 beside H100s, a question a second
    premium = slow[1].prefill_work_seconds - PredictedLatencyProducer._own_prefill_seconds(
        pool().endpoints()[1], slow[0].own_prefill, slow[0].cached_tokens)
    assert slow[0].copy_credit == 0.0  # the holder is never credited
    assert all(p.copy_credit == pytest.approx(premium) and p.copy_reason == "faster" for p in slow[1:])
    assert min(slow, key=lambda p: p.cost) is not slow[0]  # the next question makes the copy
    level = document_questions((1.0, 1.0), gap=1.0)  # one speed: the holder's hit wins, nothing is credited
    assert all(p.copy_credit == 0.0 for p in level)
    assert min(level, key=lambda p: p.cost) is level[0]
    rare = document_questions((1.6, 2.5), gap=60.0)  # a question a minute: the copy would not pay back
    assert all(p.copy_credit < 0.5 * premium for p in rare[1:])
    assert min(rare, key=lambda p: p.cost) is rare[0]
    # A hit would not hold up the prefills queued behind it either: on a pod whose prefill is
    # busy, the credit also covers the wait the premium's prefill adds to them.
    # With the premium alone the idle slow holder kept winning there, however fast the others.
    busy = document_questions((1.6, 2.5), gap=1.0, prefill_utilization=0.5)
    assert all(p.copy_reason == "faster" and p.copy_credit == pytest.approx(2.0 * premium, rel=1e-3) for p in busy[1:])
    assert min(busy, key=lambda p: p.cost) is not busy[0]


def test_a_document_whose_fast_holder_is_busy_gets_a_second_fast_copy_not_the_slow_holder() -> None:
    """A document with one copy on a fast pod and one on a slow pod: while the fast holder is the
    busier, its requests would take the slow one, and a copy on another fast pod gains each of
    them, so it is credited as `faster` (it ranks as a hit would). Not while the fast holder is the
    cheapest holder, and not for a short prefix (a system prompt), whose copy is balanced as
    any other prefill."""
    def cheapest(found: list[Prediction]) -> int:
        return min(range(len(found)), key=lambda i: found[i].cost)

    spilled = document_questions((1.6, 2.5), gap=1.0, fast_holder_queue=20_000)
    assert spilled[1].cost > spilled[0].cost  # the slow holder is the one the request would take
    assert all(p.copy_reason == "faster" and p.copy_credit > 0.0 for p in spilled[2:])
    assert cheapest(spilled) >= 2  # so the next question makes the second fast copy
    idle = document_questions((1.6, 2.5), gap=1.0, fast_holder_queue=0)
    assert all(p.copy_credit == 0.0 for p in idle) and cheapest(idle) == 1  # the fast holder's hit
    short = document_questions((1.6, 2.5), gap=1.0, fast_holder_queue=20_000, held_blocks=60)
    assert all(p.copy_reason != "faster" for p in short)


def test_a_prefix_the_pod_will_compute_again_lengthens_the_prediction_not_the_ranking() -> None:
    """Where the pod's requests in flight pin more prefixes than its cache holds, part of the
    credit will be computed again: the prediction counts it (this prompt's share, and the queued
    prompts' own), so its error stays small in deep overload; the cost keeps the whole credit (a
    prefix's requests kept together share its blocks once it is back), and so does the ledger's
    timeline, which request control books from `credited_ttft`."""
    store = pool()
    ep = store.endpoints()[0]
    producer = PredictedLatencyProducer(datastore=store)
    stats = store.models.get("m")
    ep.load.add(Outstanding(8000, 6000, 100, 100.0, predicted_ttft=5.0, recompute_tokens=3000), 100.0)
    match = PrefixMatch(total=500, block_size_tokens=16, matched={ep.address: 375})  # 6,000 tokens held
    whole = producer.predict(ep, match, 8000, 100, 100.0, stats)
    assert whole.recompute_tokens == 0 and whole.ttft > whole.credited_ttft  # the queued prompt's 3,000
    match.recompute_share = {ep.address: 0.5}
    part = producer.predict(ep, match, 8000, 100, 100.0, stats)
    assert part.recompute_tokens == 3000 and part.cached_tokens == whole.cached_tokens == 6000
    assert part.cost == whole.cost and part.credited_ttft == whole.credited_ttft
    per_token = ep.service.prefill_scale * ep.service.prior.per_prefill_token
    assert part.ttft - whole.ttft == pytest.approx(3000 * per_token, rel=0.5)
    assert "recompute=3000" in part.compact()


def test_request_control_books_the_timeline_on_the_credited_prediction_and_reports_the_expected() -> None:
    store = Datastore(clock=lambda: 100.0)
    for i in range(2):
        e = store.upsert(EndpointSpec(name=f"pod-{i}", ip=f"10.0.0.{i + 1}", port=8000))
        e.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=400, update_time=99.99))
    core = build_core(store, None, tick=0.05, seed=1)
    documents = ["%d " % i + "d" * 12_000 for i in range(6)]  # 3,000 tokens each: 6 docs, 2 pods of 6,400

    async def run() -> list[object]:
        records = []
        for document in documents * 2:
            _, record = await core.director.handle_request(request(document + " question"))
            records.append(record)
        decision, record = await core.director.handle_request(request(documents[0] + " one more"))
        prediction = decision.result.cycle.predictions[decision.targets[0].address]
        item = record.outstanding
        assert prediction.recompute_tokens > 0 and prediction.ttft > prediction.credited_ttft
        assert item.predicted_ttft == prediction.credited_ttft and item.reported_ttft == prediction.ttft
        assert item.recompute_tokens == prediction.recompute_tokens
        # the decision trace shows both, so SREs see why the prediction is longer than the ranking's
        trace = DecisionRecord("r", 0.0, "m", "m", "", "", 0, "picked", result=decision.result)  # type: ignore[arg-type]
        row = next(r for r in trace.predictions() if r["address"] == decision.targets[0].address)
        assert row["recompute"] == prediction.recompute_tokens
        assert row["credited_ttft_ms"] == round(prediction.credited_ttft * 1e3, 2) < row["ttft_ms"]
        for r in records + [record]:
            core.director.release(r, Usage.of(3000, 10))
        return records

    asyncio.run(run())
    assert all(e.load.requests == 0 and e.load.recompute_backlog == 0 for e in store.endpoints())


def test_a_full_batch_of_short_and_long_outputs_frees_a_slot_at_the_short_ones_pace() -> None:
    """Without known lengths (no `max_tokens`), the slot and KV waits are paced by how soon the
    running requests end. Two short and two long generations free a slot when the first short one
    ends, far sooner than four of their mean length would: the prediction takes that pace
    (Σ 1 / output); the ranking keeps the mean's."""

    def full_pod(outputs: list[int]) -> Prediction:
        store = pool()
        ep = store.endpoints()[0]
        for output in outputs:
            item = Outstanding(100, 0, output, 100.0, predicted_ttft=0.0)
            ep.load.add(item, 100.0)
            ep.load.first_byte(item, 100.0)
        return predictions(store, request("q" * 400, max_tokens=None), FOUR_SLOTS)["10.0.0.1:8000"]

    even, mixed = full_pod([200, 200, 200, 200]), full_pod([10, 390, 390, 10])
    assert even.wait_seconds > 0.1
    # ranked at the wait's mean + 2 standard deviations (3x the mean for the next free slot),
    # predicted at its mean
    mean_wait = even.wait_seconds / 3
    assert even.ttft == pytest.approx(even.credited_ttft - 2 * mean_wait)
    assert even.ttft == pytest.approx(even.prefill_seconds + mean_wait)
    assert mixed.cost == even.cost and mixed.credited_ttft == even.credited_ttft  # same sums, same ranking
    by_mean = 4 / 100  # requests ending per step: four, each half way through 200 tokens
    by_each = 2 * (1 / 10 + 1 / 390 + 1 / 390 + 1 / 10)
    assert mixed.paced_wait_seconds == pytest.approx(mean_wait * by_mean / by_each, rel=1e-3)
    assert mixed.ttft == pytest.approx(mixed.prefill_seconds + mixed.paced_wait_seconds)
    assert "paced_wait=" in mixed.compact()


def test_a_full_batch_that_started_together_frees_no_slot_until_its_lengths_are_done() -> None:
    """Requests whose lengths are known (`max_tokens` that responses run to) end when their
    outputs are done, counted in the pod's steps. A batch of 800-token generations that started
    together frees its first slot ~800 steps on, where the paced view says one every few steps;
    a batch as full whose requests are near their ends frees one soon. The prediction takes the
    expected end; the ranking the later of it and the pace (a flood's next request went to a full
    pod and waited 12 s for a slot: `bench.flowcontrol`'s `flood-short-prompts`)."""

    def full_pod(done: int, max_tokens: int | None = 800) -> Prediction:
        store = pool()
        ep = store.endpoints()[0]
        ep.load.step_seconds = 0.02
        for _ in range(4):
            item = Outstanding(100, 0, 800, 100.0 - done * 0.02, predicted_ttft=0.0)
            ep.load.add(item, 100.0 - done * 0.02)
            ep.load.first_byte(item, 100.0 - done * 0.02)
        ep.load.settle(100.0)  # `done` steps of 20 ms each since
        return predictions(store, request("q" * 400, max_tokens=max_tokens), FOUR_SLOTS)["10.0.0.1:8000"]

    young, old = full_pod(0), full_pod(790)
    step = young.wait_seconds / 799
    assert 0.005 < step < 0.1  # the pod's step, as its service model prices it
    assert young.paced_wait_seconds == pytest.approx(young.wait_seconds)  # predicted as ranked
    assert old.paced_wait_seconds == pytest.approx(9 * step, rel=0.05)  # predicted: its expected end
    assert young.ttft > 20 * old.ttft and young.cost > old.cost
    # Lengths not known: the paced view, the same for both (it does not see ages), ranked at its
    # mean (what the ranking keeps for the batch near its end) + 2 standard deviations.
    paced = full_pod(0, None).wait_seconds
    assert full_pod(790, None).wait_seconds == pytest.approx(paced) == pytest.approx(3 * old.wait_seconds)
    assert old.wait_seconds < 0.2 * young.wait_seconds  # half the output left, 4 at once


def test_a_slot_wait_of_unknown_lengths_is_ranked_at_its_tail() -> None:
    """With the lengths unknown, the running requests end as a random stream: the wait for the
    next free slot has a spread as large as its mean, for the k-th one the mean / sqrt(k). The
    ranking takes it at its mean + 2 standard deviations; the prediction at its mean. Known
    lengths (responses that run to their `max_tokens`) add nothing."""

    def full_pod(running: int, max_tokens: int | None) -> Prediction:
        store = pool()
        ep = store.endpoints()[0]
        for _ in range(running):
            item = Outstanding(100, 0, 200, 100.0, predicted_ttft=0.0)
            ep.load.add(item, 100.0)
            ep.load.first_byte(item, 100.0)
        return predictions(store, request("q" * 400, max_tokens=max_tokens), FOUR_SLOTS)["10.0.0.1:8000"]

    next_slot, fifth_slot = full_pod(4, None), full_pod(8, None)  # 1 and 5 ends needed
    for p, needed in ((next_slot, 1), (fifth_slot, 5)):
        mean = p.ttft - p.prefill_seconds
        assert mean > 0.0 and p.wait_seconds == pytest.approx(mean * (1 + 2 / needed ** 0.5))
        assert p.credited_ttft == pytest.approx(p.prefill_seconds + p.wait_seconds)
    known = full_pod(4, 200)
    assert known.wait_seconds == pytest.approx(known.ttft - known.prefill_seconds)


def test_the_ledger_counts_the_pods_steps_to_each_expected_end() -> None:
    """`EndpointLoad.steps_until_end`: steps are time over the step time last set; a request ends
    its output's count of steps after its first token (re-keyed then), the k-th end is found among
    the live ones, ended ones drop out, and the heap stays bounded as requests come and go."""
    load = EndpointLoad()
    load.step_seconds = 0.01
    a, b, c = (Outstanding(10, 0, n, 0.0, predicted_ttft=0.05) for n in (100, 50, 300))
    for item in (a, b, c):
        load.add(item, 0.0)
    assert load.steps_until_end(1, 0.0) == pytest.approx(5 + 50)  # b: its prefill (5 steps), then 50
    load.first_byte(b, 0.2)  # 20 steps later, its first token: 49 to go from here
    assert load.steps_until_end(1, 0.2) == pytest.approx(49)
    assert load.steps_until_end(2, 0.3) == pytest.approx(5 + 100 - 30)  # a, on its prefill's estimate
    assert load.steps_until_end(4, 0.3) == -1.0
    load.release(b, 0.3)
    assert load.steps_until_end(1, 0.3) == pytest.approx(75)
    for i in range(1000):
        item = Outstanding(10, 0, 5, 1.0, predicted_ttft=0.01)
        load.add(item, 1.0)
        load.release(item, 1.0)
    assert len(load.ends) <= 2 * load.requests + 17
    assert load.steps_until_end(1, 1.0) >= 0.0


def test_the_step_count_learns_its_pace_from_the_responses_that_end() -> None:
    """The step time predicted for a batch misses what its steps also carry: a response that
    generated more tokens than the steps counted since its first byte speeds the count up (and
    one that generated fewer slows it), a little per response and within bounds."""
    load = EndpointLoad()
    load.step_seconds = 0.02
    for k in range(60):  # the pod really steps every 0.01 s: twice what was predicted
        item = Outstanding(10, 0, 100, float(k), predicted_ttft=0.0)
        load.add(item, float(k))
        load.first_byte(item, float(k))
        load.observe_steps(item, 100, float(k) + 1.0)  # 100 tokens in 1 s
        load.release(item, float(k) + 1.0)
    assert load.step_pace == pytest.approx(2.0, rel=0.02)
    load.observe_steps(Outstanding(10, 0, 5, 0.0), 5, 100.0)  # no first byte seen: nothing learned
    assert load.step_pace == pytest.approx(2.0, rel=0.02)
    for k in range(200):  # a wild one cannot throw it past its bounds
        item = Outstanding(10, 0, 100, 100.0 + k, predicted_ttft=0.0)
        load.add(item, 100.0 + k)
        load.first_byte(item, 100.0 + k)
        load.observe_steps(item, 100_000, 100.0 + k + 1.0)
        load.release(item, 100.0 + k + 1.0)
    assert load.step_pace == pytest.approx(5.0)


def test_a_full_kv_cache_admits_the_queue_ahead_before_this_prompt() -> None:
    """With the KV cache full, vLLM admits the waiting prompts first come first served as their
    blocks fit: a pod whose queue ahead needs 20,000 tokens of blocks makes this prompt wait for
    requests to end and free them, beyond the queue's prefill; a pod with the same batch and no
    queue does not. The queue is counted once, whether the last scrape saw it waiting (it is not
    in the KV use) or it was sent since (its footprint already is)."""
    store = pool(kv_cache_usage=0.99)  # 3,200 tokens of 320,000 free
    before, after, idle = store.endpoints()[:3]
    for ep in (before, after, idle):
        for _ in range(8):
            item = Outstanding(4000, 0, 2000, 100.0, predicted_ttft=0.0)  # long generations: they end slowly
            ep.load.add(item, 100.0)
            ep.load.first_byte(item, 100.0)
    before.load.add(Outstanding(20_000, 0, 100, 100.0, predicted_ttft=10.0), 100.0)
    for ep in (before, after, idle):
        ep.load.mark_scrape()
    after.load.add(Outstanding(20_000, 0, 100, 100.0, predicted_ttft=10.0), 100.0)
    p = predictions(store, request("q" * 4000))
    waited, sent_since, free = p[before.address], p[after.address], p[idle.address]
    assert free.wait_seconds == 0.0
    assert waited.wait_seconds > 0.0
    assert sent_since.wait_seconds == pytest.approx(waited.wait_seconds, rel=0.05)
    # The admissions' time: the blocks short over what 9 requests' ends free per second.
    service = before.service
    step = service.step_seconds(8, 8 * (4000 + 1000))
    freed_per_second = 8 / (1000 * step) * (8 * 6000 + 20_100) / 9
    short = 20_000 + waited.own_prefill - 3200
    assert waited.wait_seconds == pytest.approx(short / freed_per_second - waited.prefill_seconds, rel=0.02)


def test_a_full_pod_with_a_queue_is_predicted_at_its_measured_pace_and_ranked_as_before() -> None:
    """A pod whose KV is full admits its queue as running requests end: the prediction is at least
    its queue ahead at the pace measured between its first tokens while backlogged. Only with a
    full cache and a scraped queue, and only the prediction: the ranking's cost does not move."""
    store = pool()
    ep = store.endpoints()[0]
    producer = PredictedLatencyProducer(datastore=store)
    stats = store.models.get("m")
    for _ in range(5):
        ep.load.add(Outstanding(500, 0, 100, 99.0, predicted_ttft=0.05), 99.0)
    ep.load.busy_interval = 0.4  # measured: a first token every 0.4 s while it had a backlog
    plain = producer.predict(ep, None, 500, 100, 100.0, stats)
    assert plain.ttft < 1.0
    for waiting, kv, paced in [(3, 0.95, True), (0, 0.95, False), (3, 0.5, False)]:
        ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99,
                                          waiting_queue_size=waiting, kv_cache_usage=kv))
        ep.load.mark_scrape()
        got = producer.predict(ep, None, 500, 100, 100.0, stats)
        if paced:
            # of the five sent, the scrape saw three waiting (two admitted): three ahead, then this one
            assert got.ttft == pytest.approx(4 * 0.4) and got.raw_ttft == got.ttft
            assert got.drain_seconds == got.ttft and "drain=1600.0ms" in got.compact()
        else:
            assert got.ttft < 1.0 and got.drain_seconds == 0.0
        assert got.cost == producer.predict(ep, None, 500, 100, 100.0, stats).cost


def test_request_control_calibrates_the_reported_prediction_per_pod() -> None:
    """Each streamed first byte steps the pod's calibration towards observed / predicted; the
    calibrated prediction is what is reported, the raw one what it learns from, and the cost
    (the ranking) does not move. (The step model does not learn here, so the calibration is all
    that can follow the slow pod.)"""
    clock = [100.0]
    store = Datastore(clock=lambda: clock[0])
    for i in range(2):
        e = store.upsert(EndpointSpec(name=f"pod-{i}", ip=f"10.0.0.{i + 1}", port=8000))
        e.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99))
    config = FOUR_SLOTS.replace("maxNumSeqs: 4", "learn: false")
    core = build_core(store, config, tick=0.05, seed=1)
    slow = store.endpoints()[0]

    async def one(text: str) -> Prediction:
        decision, record = await core.director.handle_request(request(text))
        prediction = decision.result.cycle.predictions[decision.targets[0].address]
        assert record.outstanding.raw_ttft == prediction.raw_ttft
        # pod-0 answers 3x later than its raw prediction, pod-1 as predicted
        late = 3.0 if record.endpoint is slow else 1.0
        clock[0] += prediction.raw_ttft * late
        core.director.first_byte(record)
        core.director.release(record, Usage.of(100, 10))
        clock[0] += 1.0
        return prediction

    async def run() -> None:
        for i in range(300):
            await one(f"{i} " + "w " * 200)

    asyncio.run(run())
    assert slow.service.ttft_factor == pytest.approx(3.0 * math.exp(-0.05), rel=0.05)
    assert store.endpoints()[1].service.ttft_factor == 1.0
    cycle = CycleState()
    for producer in core.config.scheduler.producers:
        producer.prepare(cycle, request("x " * 200), list(store.endpoints()))
    p = cycle.predictions[slow.address]
    assert p.ttft == pytest.approx(p.raw_ttft * slow.service.ttft_factor)
    assert p.credited_ttft < p.ttft  # the ranking's prediction is not calibrated
    assert f"uncalibrated={p.raw_ttft * 1e3:.1f}ms" in p.compact()


def test_a_reused_prefix_held_by_one_pod_gets_a_second_holder() -> None:
    """A prefix on one pod gives its requests no choice: they wait for whatever else that pod is
    doing. A second copy lets each later request take the less busy of two (the big step of the
    power of two choices), so a copy whose gain, over the requests it would take in one window,
    pays its premium back is credited in full, as a hit would be (`choice`). With two holders
    there is a choice already, and a prefix reused too rarely would not pay it back: neither is
    credited so."""
    def picks(holders: int, gap: float, busy_from: int = 0, full: bool = False) -> list[Prediction]:
        store = pool()
        producer = PredictedLatencyProducer(datastore=store)
        producer.prefix_producer = SimpleNamespace(name="prefix")  # type: ignore[assignment]
        endpoints = list(store.endpoints())
        if full:  # the last pod: its KV cache full, with a queue
            endpoints[-1].update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000,
                                                         kv_cache_usage=0.95, waiting_queue_size=2,
                                                         update_time=99.99))
        match = PrefixMatch(total=450, block_size_tokens=16, hashes=list(range(450)),
                            matched={ep.address: 375 for ep in endpoints[:holders]})
        chars = int(7_200 * store.models.get("m").chars_per_token)
        cycle = CycleState()
        waiting: list[Outstanding] = []
        for i in range(16):  # the document's questions, `gap` seconds apart
            now = 100.0 + gap * i
            store.clock = lambda at=now: at
            for ep, item in zip(endpoints, waiting):  # the last prompt there decodes now,
                ep.load.first_byte(item, now)
            busy = endpoints[:holders] if i >= busy_from else []
            waiting = [Outstanding(400, 0, 100, now, predicted_ttft=0.05) for _ in busy]
            for ep, item in zip(endpoints, waiting):  # and another one is queued: the holders stay busy
                ep.load.add(item, now)
            cycle = CycleState()
            cycle.data["prefix"] = match
            producer.prepare(cycle, request("x" * chars), endpoints)
        return [cycle.predictions[ep.address] for ep in endpoints]

    one = picks(1, gap=0.3)
    premium = one[1].prefill_work_seconds - PredictedLatencyProducer._own_prefill_seconds(
        pool().endpoints()[1], one[0].own_prefill, one[0].cached_tokens)
    assert one[0].copy_credit == 0.0  # the holder is never credited
    assert all(p.copy_reason == "choice" and p.copy_credit == pytest.approx(premium) for p in one[1:])
    assert min(one, key=lambda p: p.cost) is not one[0]  # the next question makes the second copy
    two = picks(2, gap=0.3)
    assert not any(p.copy_reason == "choice" for p in two)
    assert min(two, key=lambda p: p.cost) in two[:2]
    rare = picks(1, gap=60.0)
    assert not any(p.copy_reason == "choice" for p in rare)
    assert min(rare, key=lambda p: p.cost) is rare[0]
    # The holder's excess is averaged over the prefix's requests: a moment's queue is no reason
    # (at 100 pods under KV pressure such copies, cold requests all, put the TTFT p99 1.7x up).
    moment = picks(1, gap=0.3, busy_from=15)
    assert moment[0].cost > one[1].cost + 0.02  # its holder is busy now (one[1]: an idle pod, credited as a hit)
    assert not any(p.copy_reason == "choice" for p in moment)
    # A pod full with a queue: the pool has no prefill to spare for a copy that only shortens tails
    # (on the overloads of the mixed pools such copies put the TTFT p99 1.46x up).
    busy = picks(1, gap=0.3, full=True)
    assert not any(p.copy_reason == "choice" for p in busy)


def run_long_generations(ep: Endpoint, usage: float) -> None:
    """70 long generations decoding on `ep` (4k-token prompts, 2k-token outputs), its cache `usage` full."""
    for _ in range(70):
        item = Outstanding(4000, 0, 2000, 99.0, predicted_ttft=0.05)
        ep.load.add(item, 99.0, work_seconds=5.0)
        ep.load.first_byte(item, 99.05)
    ep.load.mark_scrape()
    ep.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, kv_cache_usage=usage,
                                      running_requests=70, update_time=99.99))


def test_a_pick_that_would_overflow_the_kv_cache_is_charged_past_the_busy_cap() -> None:
    """Two pods at their compute cap (every pod of a pool near its decode capacity reads so),
    each running 70 long generations; one's cache holds more already. With what those have yet
    to write, a long request there would need more KV than the pod has: vLLM would preempt and
    admit nothing meanwhile. Its busy factor continues past the cap by the overflow, so the pod
    with room wins by far more than the cap alone gives (it saw them equal). The running
    requests overflow the fuller pod whatever is sent there, so a short request is charged too
    (it would wait out the stall); on the pod with room it overflows nothing."""
    store = pool()
    fuller, roomier = store.endpoints()[:2]
    for ep, usage in ((fuller, 0.85), (roomier, 0.5)):
        run_long_generations(ep, usage)
    long = predictions(store, request("x" * 16_000, max_tokens=2000))
    full, room = long[fuller.address], long[roomier.address]
    # held + half the running outputs to come + this prompt and output, beyond the capacity
    assert full.kv_overflow == pytest.approx(0.85 + 70_000 / 320_000 + (4_000 + 2_000) / 320_000 - 1.0, rel=0.02)
    assert room.kv_overflow == 0.0
    full_ext, room_ext = full.cost - full.credited_ttft, room.cost - room.credited_ttft
    assert full_ext > 2.5 * room_ext  # 20 x (1 + 20 x 0.0875) against 20
    assert "kv_overflow=" in full.compact()
    short = predictions(store, request("x" * 16_000, max_tokens=10))
    assert short[fuller.address].kv_overflow > 0.0 and short[roomier.address].kv_overflow == 0.0


def test_an_overflowing_pick_is_charged_even_when_most_caches_read_full() -> None:
    """The same two pods among others whose caches all read past `_KV_FULL` with what their long
    generations have yet to write: the KV floor of the busy factor is off (it would put every pod
    at the cap), but whether this request fits is still a difference between pods. Counted only
    while half the caches had room, the end of `head-of-line-heavy` sent long prompts to pods at
    0.99 (the pick's cost within 2% of the others': 1-2.8 s in their queues) while a few had room."""
    store = pool()
    pods = store.endpoints()
    usages = [0.85, 0.5] + [0.8] * (len(pods) - 2)
    for ep, usage in zip(pods, usages):
        run_long_generations(ep, usage)
    fuller, roomier = pods[:2]
    assert sum(1 for ep in pods if _kv_utilization(ep) < _KV_FULL) * 2 < len(pods)  # the floor is off
    long = predictions(store, request("x" * 16_000, max_tokens=2000))
    full, room = long[fuller.address], long[roomier.address]
    assert full.kv_overflow > 0.05 and room.kv_overflow == 0.0
    assert full.cost - full.credited_ttft > 2.5 * (room.cost - room.credited_ttft)


def test_a_pick_is_charged_the_time_it_and_its_pods_requests_spend_in_the_pools_ttft_tail() -> None:
    """The cost is a sum of TTFTs: it will queue one request long to save many a little each, so
    its mean falls while its tail grows. Each candidate is charged `tailWeight` × the seconds its
    credited TTFT runs beyond the pool's tail (the running p90 of observed first tokens), and its
    externality `tailWeight` × the share of the pod's recent first tokens beyond it: the delay a
    pick adds to requests already in the tail counts for them twice."""
    store = pool()
    store.ttft_tail.seconds = 0.05
    queue_prefill(store, 0, 20_000)  # pod 0 answers beyond the tail
    tail_pod = store.endpoints()[1]
    for _ in range(200):
        tail_pod.load.observe_tail(True)  # pod 1's first tokens lately were in the tail
    req = request("x" * 4000)
    p = predictions(store, req)
    off = predictions(store, req, with_parameters("predicted-latency-producer", "{tailWeight: 0}"))
    slow, tail_one, idle = (store.endpoints()[i].address for i in (0, 1, 2))
    assert off[slow].tail_charge == 0.0 and off[slow].cost == pytest.approx(p[slow].cost - p[slow].tail_charge)
    assert p[slow].credited_ttft > 0.3
    assert p[slow].tail_charge == pytest.approx(p[slow].credited_ttft - 0.05, rel=0.05)
    externality = off[tail_one].cost - off[tail_one].credited_ttft
    assert externality > 0.0 and tail_pod.load.tail_share > 0.95
    assert p[tail_one].tail_charge == pytest.approx(tail_pod.load.tail_share * externality, rel=0.01)
    assert p[idle].tail_charge == 0.0 and p[idle].cost == pytest.approx(off[idle].cost)
    assert "tail_charge=" in p[slow].compact()
    cycle = CycleState()
    cycle.predictions.update(p)
    result = SimpleNamespace(cycle=cycle)
    record = DecisionRecord("r", 0.0, "m", "m", "", "", 0, "picked", result=result)  # type: ignore[arg-type]
    rows = {row["address"]: row for row in record.predictions()}
    assert rows[slow]["tail_charge_ms"] == pytest.approx(p[slow].tail_charge * 1e3, abs=0.01)
    double = predictions(store, req, with_parameters("predicted-latency-producer", "{tailWeight: 2}"))
    assert double[slow].tail_charge == pytest.approx(2 * p[slow].tail_charge, rel=0.01)


def test_the_first_tokens_teach_the_pools_ttft_tail_and_each_pods_share_of_it() -> None:
    now = [100.0]
    store = Datastore(clock=lambda: now[0])
    for i in range(2):
        store.upsert(EndpointSpec(name=f"pod-{i}", ip=f"10.0.0.{i + 1}", port=8000)).update_metrics(
            EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99))
    core = build_core(store, with_parameters("predicted-latency-producer", "{tailQuantile: 0.95}"), tick=0.05, seed=1)
    assert store.ttft_tail.quantile == 0.95

    async def serve(ttft: float) -> str:
        decision, record = await core.director.handle_request(request("q" * 400))
        now[0] += ttft
        core.director.first_byte(record)
        core.director.release(record, Usage.of(100, 10))
        return decision.targets[0].address

    for _ in range(50):
        asyncio.run(serve(0.05))
    assert store.ttft_tail.seconds == pytest.approx(0.05, rel=0.1)
    tail, before = store.ttft_tail.seconds, {ep.address: ep.load.tail_share for ep in store.endpoints()}
    address = asyncio.run(serve(2.0))  # far beyond: its pod's share rises, the tail with it
    assert store.ttft_tail.seconds > tail
    after = {ep.address: ep.load.tail_share for ep in store.endpoints()}
    assert after[address] > before[address] + 0.015
    assert all(after[a] == before[a] for a in after if a != address)
    registry = EppMetrics(store).registry  # what an SRE sees of it
    pool_name = store.pool.name
    assert registry.get_sample_value("inference_extension_ttft_tail_seconds",
                                     {"name": pool_name}) == store.ttft_tail.seconds
    assert registry.get_sample_value("inference_pool_endpoint_ttft_tail_share",
                                     {"name": pool_name, "endpoint": address,
                                      "model_server_pod": store.get(address).name}) == after[address]


@pytest.mark.parametrize("parameters", ["{tailWeight: -1}", "{tailWeight: heavy}", "{tailQuantile: 0.2}",
                                        "{tailQuantile: 1}"])
def test_the_tail_charge_parameters_are_validated(parameters: str) -> None:
    with pytest.raises(Exception, match="tail"):
        build_core(pool(), with_parameters("predicted-latency-producer", parameters), tick=0.05, seed=1)


def test_a_page_taken_before_the_holders_request_ended_does_not_turn_it_into_unexplained_traffic() -> None:
    """Sequential requests sharing a long prefix: the page the EPP reads after the first one ended
    may have been written while it was still queued there. Taken for someone else's request, that
    stale `waiting: 1` cost the holder more than its cache saved, and the next request went to
    an idle pod (the e2e affinity test's flake)."""
    system = "You are a meticulous assistant for the ACME support desk. " * 40

    def second_pick_ttfts(asked_at: float) -> tuple[float, float]:
        store = pool()
        core = build_core(store, None, tick=0.05, seed=1)

        async def send() -> str:
            decision, record = await core.director.handle_request(request(system + "question 0", max_tokens=4))
            core.director.release(record, Usage.of(600, 4))  # at the clock's 100.0
            return decision.targets[0].address

        holder = store.get(asyncio.run(send()))
        assert holder is not None
        holder.update_metrics(replace(holder.metrics, waiting_queue_size=1, update_time=asked_at))
        cycle = CycleState()
        req = request(system + "question 1", max_tokens=4)
        for producer in core.config.scheduler.producers:
            producer.prepare(cycle, req, list(store.endpoints()))
        others = [p.ttft for address, p in cycle.predictions.items() if address != holder.address]
        return cycle.predictions[holder.address].ttft, min(others)

    holder, other = second_pick_ttfts(99.995)  # asked for before the release: the request itself
    assert holder < 0.5 * other
    holder, other = second_pick_ttfts(100.0)  # asked for after it: someone else's request waits there
    assert holder > other
