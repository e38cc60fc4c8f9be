"""`approx-prefix-cache-producer` + `prefix-cache-scorer`: routing follows where prompts were sent."""

from __future__ import annotations

import random

import pytest

from epp.params import ConfigError, Params
from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.scheduling.framework import ProfileResult, SchedulerProfile, SchedulingResult, WeightedScorer
from epp.scheduling.prefix_match import PrefixMatch
from epp.scheduling.plugins.approx_prefix_cache_producer import (
    ApproxPrefixCacheProducer,
    PrefixCacheConfig,
)
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from epp.scheduling.plugins.single_profile_handler import SingleProfileHandler
from epp.plugin import PluginContext
from epp.scheduling.scheduler import Scheduler

from .helpers import cycle, endpoint, request

SYSTEM = "You are a helpful assistant. " * 40  # ~1.1k chars: 18 blocks of 64


def build(config: PrefixCacheConfig | None = None, seed: int = 0) -> tuple[Scheduler, ApproxPrefixCacheProducer]:
    producer = ApproxPrefixCacheProducer(config=config)
    scorer = PrefixCacheScorer(producer=producer)
    profile = SchedulerProfile("default", scorers=[WeightedScorer(scorer, 1.0)], picker=MaxScorePicker(rng=random.Random(seed)))
    return Scheduler({"default": profile}, SingleProfileHandler(), [producer]), producer


def serve(scheduler: Scheduler, producer: ApproxPrefixCacheProducer, req, eps):  # type: ignore[no-untyped-def]
    result = scheduler.schedule(req, eps)
    producer.pre_request(req, result)
    return result.primary


def test_shared_long_prefix_routes_to_the_pod_that_served_it() -> None:
    eps = [endpoint(f"10.0.0.{i}") for i in range(1, 5)]
    scheduler, producer = build(seed=3)
    first = serve(scheduler, producer, request(SYSTEM + "Question one?"), eps)
    for i in range(20):
        assert serve(scheduler, producer, request(SYSTEM + f"Another question {i}?"), eps) is first


def test_score_is_matched_over_total_blocks() -> None:
    eps = [endpoint("10.0.0.1"), endpoint("10.0.0.2")]
    producer = ApproxPrefixCacheProducer()
    scorer = PrefixCacheScorer(producer=producer)
    producer.index.add(producer.lookup(request(b"a" * 128), eps).hashes, eps[0].address, 100)
    c = cycle()
    producer.prepare(c, request(b"a" * 128 + b"b" * 128), eps)  # 4 blocks, first 2 known on eps[0]
    assert scorer.score(c, request(), eps) == [0.5, 0.0]


def test_score_is_zero_without_blocks_or_producer_data() -> None:
    eps = [endpoint("10.0.0.1")]
    producer = ApproxPrefixCacheProducer()
    scorer = PrefixCacheScorer(producer=producer)
    c = cycle()
    producer.prepare(c, request(b"short"), eps)
    assert scorer.score(c, request(), eps) == [0.0]
    assert scorer.score(cycle(), request(), eps) == [0.0]
    assert PrefixCacheScorer().score(cycle(), request(), eps) == [0.0]


def test_different_model_or_salt_does_not_match() -> None:
    eps = [endpoint(f"10.0.0.{i}") for i in range(1, 4)]
    scheduler, producer = build()
    serve(scheduler, producer, request(SYSTEM, model="a"), eps)
    for other in (request(SYSTEM, model="b"), request(SYSTEM, model="a", salt="tenant")):
        c = cycle()
        producer.prepare(c, other, eps)
        assert c.data[producer.name].matched == {}


def test_partial_block_matches_only_the_same_ending() -> None:
    eps = [endpoint("10.0.0.1")]
    producer = ApproxPrefixCacheProducer()
    prompt = b"x" * 64 + b"tail"
    producer.index.add(producer.lookup(request(prompt), eps).hashes, eps[0].address, 100)
    same = producer.lookup(request(prompt), eps)
    longer = producer.lookup(request(prompt + b"more"), eps)
    assert same.matched == {eps[0].address: 2} and same.total == 2
    assert longer.matched == {eps[0].address: 1} and longer.total == 2


def test_index_updated_for_primary_target_only() -> None:
    eps = [endpoint("10.0.0.1"), endpoint("10.0.0.2")]
    producer = ApproxPrefixCacheProducer()
    req = request(SYSTEM)
    producer.prepare(cycle(), req, eps)
    result = SchedulingResult("default", {"default": ProfileResult(targets=[eps[1], eps[0]])})
    producer.pre_request(req, result)
    assert producer.index.servers() == [eps[1].address]
    assert producer.stats().last_hit_ratio == 0.0
    req2 = request(SYSTEM)
    producer.prepare(cycle(), req2, eps)
    producer.pre_request(req2, result)
    stats = producer.stats()
    assert stats.last_hit_ratio == 1.0 and stats.lookups == 2
    assert stats.index_entries == len(producer.lookup(req, eps).hashes)
    assert stats.hit_chars == stats.total_chars // 2


def test_prefill_profile_target_is_recorded_too() -> None:
    eps = [endpoint("10.0.0.1"), endpoint("10.0.0.2")]
    producer = ApproxPrefixCacheProducer()
    req = request(SYSTEM)
    result = SchedulingResult(
        "decode", {"decode": ProfileResult(targets=[eps[0]]), "prefill": ProfileResult(targets=[eps[1]])}
    )
    producer.pre_request(req, result)  # not prepared: hashes are recomputed
    assert sorted(producer.index.servers()) == sorted(ep.address for ep in eps)


def test_a_requests_blocks_are_pinned_on_every_target_until_it_ends() -> None:
    """Pinned from the pick on the decode and the prefill pod alike (vLLM evicts no running
    request's blocks), and unpinned on both when request control reports the end, whatever the
    end (an error has no endpoint and no usage)."""
    eps = [endpoint("10.0.0.1"), endpoint("10.0.0.2")]
    producer = ApproxPrefixCacheProducer()
    for end in (eps[0], None):
        req = request(SYSTEM)
        producer.pre_request(req, SchedulingResult(
            "decode", {"decode": ProfileResult(targets=[eps[0]]), "prefill": ProfileResult(targets=[eps[1]])}))
        blocks = len(producer.lookup(req, eps).hashes)
        assert [producer.index.pinned(ep.address) for ep in eps] == [blocks, blocks]
        producer.response_complete(req, end, None)
        assert [producer.index.pinned(ep.address) for ep in eps] == [0, 0]


def test_the_match_lives_in_the_cycle_not_in_the_plugin() -> None:
    """pre_request reads the match its own cycle computed; the producer keeps no request table."""
    eps = [endpoint("10.0.0.1"), endpoint("10.0.0.2")]
    producer = ApproxPrefixCacheProducer()
    for i in range(100):
        producer.prepare(cycle(), request(SYSTEM, request_id=f"r{i}"), eps)  # never picked: nothing kept
    assert not [k for k, v in vars(producer).items() if isinstance(v, dict) and len(v) >= 100]
    req = request(SYSTEM, request_id="last")
    state = cycle()
    producer.prepare(state, req, eps)
    match = state.data[producer.name]
    producer.pre_request(req, SchedulingResult("d", {"d": ProfileResult(targets=[eps[1]])}, cycle=state))
    assert producer.index.servers() == [eps[1].address]
    assert producer.index.match(match.hashes) == {eps[1].address: match.total}


def test_autotune_reads_block_size_from_first_candidate_and_capacity_per_endpoint() -> None:
    eps = [endpoint("10.0.0.1", cache_block_size=32, cache_num_blocks=3), endpoint("10.0.0.2", cache_block_size=8)]
    producer = ApproxPrefixCacheProducer()
    assert producer.block_size_tokens(eps) == 32
    assert producer.block_size_tokens(eps[::-1]) == 8
    match = producer.lookup(request(b"z" * 128 * 5), eps)
    assert match.block_size_tokens == 32 and match.total == 5
    assert producer.lru_capacity(eps[0]) == 3 and producer.lru_capacity(eps[1]) == 31250
    req = request(b"z" * 128 * 5)
    producer.prepare(cycle(), req, eps)
    producer.pre_request(req, SchedulingResult("d", {"d": ProfileResult(targets=[eps[0]])}))
    assert producer.index.server_entries(eps[0].address) == 5  # in flight: its blocks are all in use
    producer.response_complete(req, eps[0], None)
    again = request(b"y" * 128 * 2)
    producer.prepare(cycle(), again, eps)
    producer.pre_request(again, SchedulingResult("d", {"d": ProfileResult(targets=[eps[0]])}))
    assert producer.index.server_entries(eps[0].address) == 3  # LRU sized from cache_num_blocks


def test_autotune_off_uses_configured_sizes() -> None:
    eps = [endpoint("10.0.0.1", cache_block_size=32, cache_num_blocks=3)]
    producer = ApproxPrefixCacheProducer(config=PrefixCacheConfig(auto_tune=False, block_size_tokens=4,
                                                                  lru_capacity_per_server=7))
    assert producer.block_size_tokens(eps) == 4 and producer.lru_capacity(eps[0]) == 7


def test_max_prefix_tokens_overrides_max_blocks() -> None:
    producer = ApproxPrefixCacheProducer(config=PrefixCacheConfig(max_prefix_tokens=64))
    assert producer.max_blocks(16) == 4
    assert producer.lookup(request(b"k" * 10_000), [endpoint("10.0.0.1")]).total == 4
    assert ApproxPrefixCacheProducer().lookup(request(b"k" * 100_000), []).total == 256


def test_removed_endpoints_leave_the_index() -> None:
    store = Datastore()
    a = store.upsert(EndpointSpec(name="a", ip="10.0.0.1", port=8000))
    b = store.upsert(EndpointSpec(name="b", ip="10.0.0.2", port=8000))
    producer = ApproxPrefixCacheProducer.from_config("p", Params(None, "x"), PluginContext(datastore=store))
    hashes = producer.lookup(request(SYSTEM), [a]).hashes
    producer.index.add(hashes, a.address, 100)
    producer.index.add(hashes, b.address, 100)
    store.remove(a.address)
    assert producer.index.match(hashes) == {b.address: len(hashes)}
    assert producer.index.servers() == [b.address]


def test_producer_parameters() -> None:
    ctx = PluginContext(datastore=Datastore())
    p = ApproxPrefixCacheProducer.from_config(
        "p",
        Params({"autoTune": False, "blockSizeTokens": 32, "maxPrefixBlocksToMatch": 8, "maxPrefixTokensToMatch": 0,
                "lruCapacityPerServer": 9}, "x"),
        ctx,
    )
    assert p.config == PrefixCacheConfig(False, 32, 8, 0, 9)
    assert ApproxPrefixCacheProducer.from_config("p", Params(None, "x"), ctx).config == PrefixCacheConfig()
    # the deprecated character size needs blockSizeTokens next to it
    with pytest.raises(ConfigError, match=r"^x\.blockSize: is deprecated"):
        ApproxPrefixCacheProducer.from_config("p", Params({"blockSize": 64}, "x"), ctx)
    both = ApproxPrefixCacheProducer.from_config("p", Params({"blockSize": 64, "blockSizeTokens": 8}, "x"), ctx)
    assert both.config.block_size_tokens == 8
    with pytest.raises(ConfigError, match=r"^x\.blockSizeTokens: must be >= 1"):
        ApproxPrefixCacheProducer.from_config("p", Params({"blockSizeTokens": 0}, "x"), ctx)
    with pytest.raises(ConfigError, match=r"^x\.autoTune: must be true or false"):
        ApproxPrefixCacheProducer.from_config("p", Params({"autoTune": "yes"}, "x"), ctx)
    with pytest.raises(ConfigError, match=r"^x\.hashBlockSize: unknown field"):
        ApproxPrefixCacheProducer.from_config("p", Params({"hashBlockSize": 5}, "x"), ctx)


def test_scorer_parameters_configure_its_own_producer() -> None:
    ctx = PluginContext(datastore=Datastore())
    scorer = PrefixCacheScorer.from_config("prefix", Params({"blockSizeTokens": 8, "lruCapacityPerServer": 5}, "x"), ctx)
    created = scorer.create_missing_producers(ctx)
    assert len(created) == 1 and scorer.producer is created[0]
    assert created[0].config.block_size_tokens == 8 and created[0].config.lru_capacity_per_server == 5
    assert created[0].name == "approx-prefix-cache-producer"
    assert scorer.create_missing_producers(ctx) == []


def test_scorer_without_parameters_binds_a_configured_producer() -> None:
    ctx = PluginContext(datastore=Datastore())
    mine = ApproxPrefixCacheProducer("mine")
    ctx.plugins["mine"] = mine
    scorer = PrefixCacheScorer.from_config("prefix", Params(None, "x"), ctx)
    assert scorer.create_missing_producers(ctx) == [] and scorer.producer is mine


def test_match_is_left_in_the_cycle_under_the_producer_name() -> None:
    producer = ApproxPrefixCacheProducer("custom")
    c = cycle()
    producer.prepare(c, request(SYSTEM), [endpoint("10.0.0.1")])
    assert isinstance(c.data["custom"], PrefixMatch)


def test_stale_metrics_dont_matter_to_hashing() -> None:
    ep = endpoint("10.0.0.1")
    ep.metrics = EndpointMetrics(cache_block_size=0)
    assert ApproxPrefixCacheProducer().block_size_tokens([ep]) == 16


def test_index_match_counts_runs_exactly_as_the_per_block_definition() -> None:
    """`match` narrows the set of matching endpoints only where holders change; it must equal
    walking block by block, each endpoint stopping at its first missing block (vLLM's prefix
    cache cannot use a block after one it lacks; the reference keeps counting, and over-credits)."""
    import random

    from epp.scheduling.plugins._prefix_index import PrefixIndex

    rng = random.Random(7)
    for _ in range(300):
        index = PrefixIndex()
        for s in range(6):
            index.add([rng.randint(0, 12) for _ in range(rng.randint(0, 20))], f"s{s}", rng.randint(1, 15))
        query = [rng.randint(0, 12) for _ in range(rng.randint(0, 15))]
        expected: dict[str, int] = {}
        stopped: set[str] = set()
        for key in query:
            holders = index._holders.get(key)
            if not holders:
                break
            for holder in set(expected) - holders:
                stopped.add(holder)
            for holder in holders:
                if holder not in stopped and (holder in expected or key == query[0] or not expected):
                    expected[holder] = expected.get(holder, 0) + 1
            if not set(expected) - stopped:
                break
        assert index.match(query) == expected


def test_pins_whose_ends_were_lost_are_cleared_by_the_ledger() -> None:
    """Another writer's ends can be lost (a ring or a replica's stream overflowed): pins of
    requests the ledger no longer has in flight would otherwise hold their prefixes forever on a
    pod that never idles. When more requests pin a pod than twice the ledger's in flight (plus a
    little slack for the writers' lag), its pins are cleared, and the reset is counted."""
    store = Datastore()
    a = store.upsert(EndpointSpec(name="a", ip="10.0.0.1", port=8000))
    producer = ApproxPrefixCacheProducer.from_config("p", Params(None, "x"), PluginContext(datastore=store))
    lost = [request(f"lost {i} " + SYSTEM) for i in range(12)]
    for req in lost:  # picked here, their ends never reported
        producer.pre_request(req, SchedulingResult("d", {"d": ProfileResult(targets=[a])}))
    a.load.requests = 3  # what the ledger has in flight there
    live = request("live " + SYSTEM)
    producer.pre_request(live, SchedulingResult("d", {"d": ProfileResult(targets=[a])}))
    assert producer.index.pinning(a.address) == 13
    producer.response_complete(live, a, None)  # 12 pinning > 2 × 3 + 4: stale
    assert producer.index.pinned(a.address) == 0 and producer.index.pinning(a.address) == 0
    assert producer.stale_pin_resets == 1
    keep = [request(f"keep {i} " + SYSTEM) for i in range(4)]
    for req in keep:
        producer.pre_request(req, SchedulingResult("d", {"d": ProfileResult(targets=[a])}))
    producer.response_complete(keep[0], a, None)  # 3 pinning, 3 in flight: kept
    assert producer.index.pinning(a.address) == 3 and producer.index.pinned(a.address) > 0
    assert producer.stale_pin_resets == 1


def test_a_prefix_pinned_past_the_cache_is_expected_partly_computed_again() -> None:
    """When the requests in flight on a pod pin more blocks than its KV cache holds, the index
    keeps them all, but the engine cannot: the match says what share of the prefix the pod is
    expected to compute again — `1 - capacity / weight`, shared by the requests of that prefix in
    flight there (the first to run after it is lost computes it again for them all). A pod within
    its capacity has no share."""
    store = Datastore()
    small = store.upsert(EndpointSpec(name="small", ip="10.0.0.1", port=8000))
    roomy = store.upsert(EndpointSpec(name="roomy", ip="10.0.0.2", port=8000))
    small.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=100, update_time=1.0))
    roomy.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=100_000, update_time=1.0))
    producer = ApproxPrefixCacheProducer.from_config("p", Params(None, "x"), PluginContext(datastore=store))
    for ep in (small, roomy):
        for i in range(10):  # ten documents in flight on each: ~4x the small cache
            picked = SchedulingResult("d", {"d": ProfileResult(targets=[ep])})
            producer.pre_request(request(f"doc {i} " + SYSTEM * 3), picked)

    def share(address: str) -> float | None:
        c = cycle()
        producer.prepare(c, request("doc 0 " + SYSTEM * 3 + " next question"), [small, roomy])
        match = c.data["p"]
        assert isinstance(match, PrefixMatch) and match.matched[address] > 0
        return match.recompute_share.get(address)

    alone = share(small.address)
    assert alone is not None and 0.5 < alone < 1.0
    assert share(roomy.address) is None
    for _ in range(2):  # two more requests of document 0 in flight on the small pod
        picked = SchedulingResult("d", {"d": ProfileResult(targets=[small])})
        producer.pre_request(request("doc 0 " + SYSTEM * 3 + " more"), picked)
    shared = share(small.address)
    assert shared is not None and shared < alone / 2


def test_a_huge_max_tokens_pushes_nothing_out_where_the_pods_say_their_longest_sequence() -> None:
    """A client's `max_tokens` of 2^20 is an expected output larger than the pod's whole cache
    (64 blocks of 16 tokens here); vLLM stops it at `max_model_len` (cache_config_info's
    `kv_cache_size_tokens / kv_cache_max_concurrency`), and so does its footprint in the index:
    the four prompts served before it stay in the EPP's view of the pod. A pod that does not say
    its longest sequence is charged the whole limit, as before."""
    prompts = [bytes([65 + i]) * 512 for i in range(4)]  # 8 blocks each: 16 tokens x 4 characters
    for longest, kept in ((256, 8), (0, 0)):
        ep = endpoint("10.0.0.1", cache_block_size=16, cache_num_blocks=64, max_model_len=longest)
        scheduler, producer = build()
        for prompt in prompts:
            req = request(prompt)
            serve(scheduler, producer, req, [ep])
            producer.response_complete(req, ep, None)
        huge = request(b"q" * 64)
        huge.max_tokens = 1 << 20
        serve(scheduler, producer, huge, [ep])
        for prompt in prompts:
            assert producer.lookup(request(prompt), [ep]).matched.get(ep.address, 0) == kept, longest
