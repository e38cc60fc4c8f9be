"""`precise-prefix-cache-producer` + `prefix-cache-scorer` through the real core: config, routing
from events, the approximate fallback and what the decision trace says."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from epp.api.request import parse_request
from epp.core import build_core
from epp.datastore import Datastore, EndpointSpec
from epp.observability.metrics import EppMetrics
from epp.observability.trace import DecisionTrace
from epp.params import ConfigError
from epp.scheduling.plugins.precise_prefix_cache_producer import PrecisePrefixCacheProducer
from epp.scheduling.prefix_match import PrefixMatch
from tests.precise.helpers import MODEL_DIR, kvreq_prompt
from epp.datalayer.kv_events import BlockRemoved as Removed
from epp.datalayer.kv_events import BlockStored as Stored

ISSUE_CONFIG = f"""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters: {{modelName: tiny, local: {{path: '{MODEL_DIR}'}}}}
- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig: {{zmqEndpoint: "tcp://*:5557", topicFilter: "kv@"}}
- type: prefix-cache-scorer
  parameters: {{prefixMatchInfoProducerName: precise-prefix-cache-producer}}
dataLayer: {{sources: []}}
"""
PODS = ("127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.1:8002")


def core(text: str = ISSUE_CONFIG, **kw):  # type: ignore[no-untyped-def]
    ds = Datastore()
    for a in PODS:
        ip, port = a.rsplit(":", 1)
        ds.upsert(EndpointSpec(f"pod-{port}", ip, int(port)))
    return build_core(ds, text, tick=0.05, **kw)


def producer(c) -> PrecisePrefixCacheProducer:  # type: ignore[no-untyped-def]
    (p,) = c.precise_producers
    return p


async def pick(c, prompt: str) -> tuple[str, PrefixMatch]:  # type: ignore[no-untyped-def]
    request = parse_request(json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1}).encode(),
                            path="/v1/completions", request_id="r")
    decision, record = await c.director.handle_request(request)
    c.director.release(record)
    return decision.targets[0].address, decision.result.cycle.data["precise-prefix-cache-producer"]


def engine_stores(c, address: str, prompt: str) -> None:  # type: ignore[no-untyped-def]
    """What a vLLM pod publishes after caching `prompt` (128-token blocks, its own hashes)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(prompt).ids
    n = len(ids) // 128
    producer(c).index.apply(address, [Stored([1000 + i for i in range(n)], None, ids[:n * 128], 128, medium="GPU")], 1.0)


def test_the_issue_config_loads() -> None:
    c = core()
    p = producer(c)
    assert p.config.events.central and p.config.events.zmq_endpoint == "tcp://*:5557"
    scorer = c.config.plugins["prefix-cache-scorer"]
    assert scorer.producer is p
    assert not any(type(x).__name__ == "ApproxPrefixCacheProducer" for x in c.config.plugins.values())
    assert len(c.director.preparers) == 1
    assert not c.config.warnings  # the token-producer is used: it prepares every request


async def test_routes_to_the_pod_whose_events_hold_the_prefix() -> None:
    c = core()
    for a in PODS:
        producer(c).index.apply(a, [], 0.5)  # every pod publishes (an empty batch)
    engine_stores(c, PODS[2], kvreq_prompt(0))
    for _ in range(3):
        target, match = await pick(c, kvreq_prompt(1))  # shares 256 tokens = 4 router blocks
        assert target == PODS[2]
        assert match.matched == {PODS[2]: 4} and match.total == 6
        assert set(match.sources.values()) == {"precise"} and not match.note


@pytest.mark.parametrize("foresight", [True, False])
async def test_a_full_pod_is_not_credited_with_the_blocks_its_next_allocation_evicts(foresight: bool) -> None:
    text = ISSUE_CONFIG.replace('topicFilter: "kv@"}', 'topicFilter: "kv@"}\n    evictionForesight: '
                                + ("true" if foresight else "false"))
    c = core(text)
    p = producer(c)
    for a in PODS:
        p.index.apply(a, [], 0.5)
        endpoint = c.datastore.get(a)
        endpoint.metrics = replace(endpoint.metrics, cache_num_blocks=4, cache_block_size=128)  # null + 3
    engine_stores(c, PODS[2], kvreq_prompt(0))  # 3 blocks of 128 tokens: the cache is full
    p.index.apply(PODS[2], [Removed([999])], 1.0)  # and it has evicted before
    target, match = await pick(c, kvreq_prompt(1))  # shares 256 tokens: 2 engine blocks, 4 router blocks
    assert target == PODS[2] and match.matched == {PODS[2]: 4}
    # Its last block will take the least recently used one: prompt 0's third, which nobody used since.
    _, match = await pick(c, kvreq_prompt(0))
    if foresight:
        assert match.matched[PODS[2]] == 4
        assert "1 endpoint(s) expected to evict part of the prefix before admitting it" in match.note
        assert p.index.stats.foreseen_blocks == 2
    else:
        assert match.matched[PODS[2]] == 6 and not match.note


async def test_endpoints_without_events_use_the_approximate_index_and_the_trace_says_so() -> None:
    trace = DecisionTrace()
    c = core(trace=trace)
    producer(c).index.apply(PODS[0], [], 0.5)  # only pod 0 publishes
    first, _ = await pick(c, kvreq_prompt(0))
    second, match = await pick(c, kvreq_prompt(0))
    if first != PODS[0]:
        assert second == first  # the approximate index remembers where the first one went
        assert match.sources[first] == "approximate" and match.matched[first] > 0
    assert match.sources[PODS[0]] == "precise"
    assert "without KV events use the approximate index" in match.note
    record = trace.latest(1)[0]
    row = record.as_dict()["prefix"][0]
    assert row["producer"] == "precise-prefix-cache-producer"
    assert row["sources"][PODS[1]] == "approximate"
    assert "prefix=precise-prefix-cache-producer:precise=1,approximate=2" in record.compact()


async def test_cpu_tier_blocks_are_weighted_and_speculation_follows_the_pick() -> None:
    text = ISSUE_CONFIG.replace("topicFilter: \"kv@\"}", "topicFilter: \"kv@\"}\n    speculativeIndexing: true\n"
                                "    indexerConfig: {kvCacheBackendConfigs: [{name: gpu, weight: 1.0}, {name: cpu, weight: 0.5}]}")
    c = core(text)
    p = producer(c)
    for a in PODS:
        p.index.apply(a, [], 0.5)
    target, match = await pick(c, kvreq_prompt(0))
    assert match.matched == {}
    again, match = await pick(c, kvreq_prompt(0))
    assert again == target and match.matched == {target: 6}  # speculative, before any event
    p.index.apply(target, [Stored([1], None, [0] * 128, 128, medium="CPU")], 1.0)
    m = p.index.match(p.index.keys_for([0] * 128))
    assert m.off_gpu == {target: {"CPU": 2}}
    assert p.weights == {"GPU": 1.0, "CPU": 0.5, "STORAGE": 0.5}


async def test_metrics_are_exported() -> None:
    from prometheus_client import generate_latest

    ds = Datastore()
    ds.upsert(EndpointSpec("pod", "127.0.0.1", 8000))
    metrics = EppMetrics(ds)
    c = build_core(ds, ISSUE_CONFIG, tick=0.05, metrics=metrics)
    engine_stores(c, "127.0.0.1:8000", kvreq_prompt(0))
    await pick(c, kvreq_prompt(0))
    text = generate_latest(metrics.registry).decode()
    for name in ("kvcache_index_entries{backend=\"in_memory\"} 6.0", "kvcache_index_lookup_requests_total 1.0",
                 "llm_d_epp_precise_prefix_indexer_max_hit_ratio_bucket", "kvcache_index_endpoint_entries",
                 "kvcache_kvevents_messages_total", "kvcache_tokenization_requests_total",
                 "kvcache_index_foreseen_evictions_total{backend=\"in_memory\"} 0.0"):
        assert name in text, name


@pytest.mark.parametrize("params, message", [
    ("{kvEventsConfig: {zmqEndpoint: 'http://x'}}", "must be a ZMQ address"),
    ("{kvEventsConfig: {zmqEndpoint: 'tcp://*:1', discoverPods: true}}", "cannot be true with zmqEndpoint"),
    ("{kvEventsConfig: {discoverPods: false}}", "is required when discoverPods is false"),
    ("{kvEventsConfig: {podDiscoveryConfig: {podLabelSelector: a}}}", "EPP's own discovery"),
    ("{kvEventsConfig: {bogus: 1}}", "kvEventsConfig.bogus: unknown field"),
    ("{tokenProcessorConfig: {blockSize: 0}}", "blockSize: must be >= 1"),
    ("{indexerConfig: {tokenizersPoolConfig: {}}}", "token-producer"),
    ("{indexerConfig: {kvCacheBackendConfigs: [{name: tpu}]}}", "must be one of"),
])
def test_bad_config_is_a_clear_error(params: str, message: str) -> None:
    text = f"""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-producer
  parameters: {params}
dataLayer: {{sources: []}}
"""
    with pytest.raises(ConfigError, match=message):
        core(text)


def test_scorer_producer_name_must_name_a_prefix_producer() -> None:
    base = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: %s}
dataLayer: {sources: []}
"""
    with pytest.raises(ConfigError, match="no plugin named 'nope'"):
        core(base % "nope")
    with pytest.raises(ConfigError, match="does not produce prefix-match info"):
        core(base % "queue-scorer")


def test_llm_d_hash_seed_is_accepted_and_ignored() -> None:
    c = core(ISSUE_CONFIG.replace('topicFilter: "kv@"}', 'topicFilter: "kv@"}\n    tokenProcessorConfig: '
                                  '{blockSize: 16, hashSeed: "42"}'))
    assert producer(c).index.block_size == 16
