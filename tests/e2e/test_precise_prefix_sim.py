"""End to end with the simulator's own KV-event publisher (`epp sim --kv-events-config`, vLLM's
wire format): simulated pods publish what their block pools cache, a real Envoy asks the EPP.

Prompts are token ids (the simulator's text tokenizer is 4 characters a token, not a real
vocabulary; with ids, the engine's events and the EPP's router keys should see the same tokens).
The simulator's HTTP pods do not yet carry a token-id prompt's ids into their blocks
(`RequestFactory.from_token_ids` leaves `prompt_token_ids` unset, so `BlockStored.token_ids` are
synthetic), so the routing half is an expected failure until they do (strict: it will say when). Each
pod's publisher *connects* to the EPP's central socket (vLLM's rule for a host address), topic
`kv@{ip}:{port}@{model}`. The index's accuracy is checked against the pods' own prefix-cache
counters: for every request, the tokens the EPP predicted cached on the picked pod against the
hit tokens that pod reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from epp.config.options import Options
from epp.discovery.static import StaticDiscovery, parse_endpoint_list
from epp.local.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.local.podstats import pod_stats
from epp.runner import EndpointPicker
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.kv_publisher import KVEventsConfig
from epp.sim.server import SimPod, start_pods, stop_pods
from tests.precise.helpers import MODEL_DIR

pytestmark = pytest.mark.e2e

SIM = SimConfig(model="tiny", time_scale=0.05, engine=EngineConfig(max_num_seqs=8, num_gpu_blocks=600, max_model_len=4096))
CONFIG = f"""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters: {{modelName: tiny, local: {{path: '{MODEL_DIR}'}}}}
- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig: {{zmqEndpoint: "tcp://127.0.0.1:%d", topicFilter: "kv@"}}
    tokenProcessorConfig: {{blockSize: 16}}
- type: prefix-cache-scorer
  parameters: {{prefixMatchInfoProducerName: precise-prefix-cache-producer}}
- type: active-request-scorer
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: prefix-cache-scorer, weight: 3}}
  - {{pluginRef: active-request-scorer, weight: 1}}
"""


async def post(session: aiohttp.ClientSession, url: str, ids: list[int]) -> None:
    async with session.post(f"{url}/v1/completions", data=orjson.dumps({"model": "tiny", "prompt": ids,
                                                                        "max_tokens": 2}),
                            headers={"content-type": "application/json"}) as r:
        assert r.status == 200, await r.text()


async def until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running() -> AsyncIterator[tuple[list[SimPod], EndpointPicker, EnvoyProcess]]:
    port = free_port()
    kv = KVEventsConfig.from_json(f'{{"enable_kv_cache_events": true, "publisher": "zmq", '
                                  f'"endpoint": "tcp://127.0.0.1:{port}", "topic": "kv@{{ip}}:{{port}}@{{model}}"}}')
    pods = await start_pods(3, config=SIM, kv_events=kv, dev_mode=True)
    discovery = StaticDiscovery(parse_endpoint_list(",".join(p.address for p in pods)))
    picker = EndpointPicker(Options(grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=-1,
                                    bind_address="127.0.0.1", secure_serving=False, config_text=CONFIG % port,
                                    pool_name="local"), discovery=discovery)
    await picker.start()
    envoy = EnvoyProcess(EnvoyConfig(listen_port=free_port(), admin_port=free_port(), epp_port=picker.grpc_port))
    try:
        envoy.start()
        yield pods, picker, envoy
    finally:
        envoy.close()
        await picker.stop(grace=0)
        await stop_pods(pods)


async def subscribed(session: aiohttp.ClientSession, pods: list[SimPod], index) -> None:  # type: ignore[no-untyped-def]
    """Until every pod's events reach the index: a ZMQ PUB drops what it sends before the SUB's
    subscription has reached it (vLLM's publisher too), so warm each pod until one gets through."""
    deadline = asyncio.get_running_loop().time() + 20.0
    attempt = 0
    for pod in pods:
        while index.engine_blocks(pod.address) == 0:
            assert asyncio.get_running_loop().time() < deadline, "no event reached the index"
            attempt += 1  # a new prompt each time: a cached one would publish nothing
            await post(session, pod.url, list(range(1000 + attempt * 32, 1000 + attempt * 32 + 32)))
            await asyncio.sleep(0.05)


async def test_simulated_pods_events_reach_the_index_and_a_reset_clears_it() -> None:
    async with running() as (pods, picker, envoy), aiohttp.ClientSession() as session:
        index = picker.core.precise_producers[0].index
        await subscribed(session, pods, index)
        for pod in pods:
            await post(session, pod.url, list(range(100, 420)))  # 20 blocks each, directly
        await until(lambda: all(index.engine_blocks(p.address) >= 22 for p in pods))
        await post(session, envoy.url, list(range(100, 420)) + [7])
        match = picker.trace.latest(1)[0].result.cycle.data["precise-prefix-cache-producer"]
        assert set(match.sources.values()) == {"precise"}  # every pod is heard, by its topic
        async with session.post(f"{pods[0].url}/reset_prefix_cache") as r:
            assert r.status == 200
        await post(session, pods[0].url, [1, 2, 3])  # the clear is published with the next step
        await until(lambda: index.stats.resets.get("cleared", 0) >= 1)
        assert index.engine_blocks(pods[0].address) == 0 and index.engine_blocks(pods[1].address) >= 20
        sub = picker.kv_subscribers[0]
        assert sub.stats.gaps == 0 and sub.stats.unknown_topic_messages == 0 and sub.stats.decode_errors == 0


async def test_simulated_pods_publish_and_the_epp_follows() -> None:
    async with running() as (pods, picker, envoy):
        index = picker.core.precise_producers[0].index
        rng = random.Random(7)
        contexts = [[rng.randrange(2000) for _ in range(1600)] for _ in range(3)]
        async with aiohttp.ClientSession() as session:
            await subscribed(session, pods, index)
            warm = pods[2]
            await post(session, warm.url, contexts[0] + [5])  # directly: only its events tell the EPP
            await until(lambda: index.endpoint_size(warm.address) >= 100)
            predicted, real = [], []
            for i in range(24):
                customer = i % 3
                before = [await pod_stats(session, p.url) for p in pods]
                await post(session, envoy.url, contexts[customer] + [rng.randrange(2000) for _ in range(40)])
                record = picker.trace.latest(1)[0]
                target = record.targets[0]
                match = record.result.cycle.data["precise-prefix-cache-producer"]
                after = [await pod_stats(session, p.url) for p in pods]
                hits = [a.prefix_hits - b.prefix_hits for a, b in zip(after, before)]
                assert sum(1 for h in hits if h) <= 1
                if customer == 0:
                    assert target == warm.address, (match, record.compact())  # the directly warmed context is found there
                predicted.append(match.tokens(target))
                real.append(hits[[p.address for p in pods].index(target)])
                # the engine publishes after the step: wait until the index has caught up
                await until(lambda: index.match(index.keys_for(contexts[customer])).matched.get(target, 0) >= 100)
            exact = sum(1 for p, r in zip(predicted, real) if abs(p - r) < 16)
            assert exact / len(real) >= 0.99, list(zip(predicted, real))
            # The pod resets its cache: AllBlocksCleared, and the EPP stops claiming the context.
            async with session.post(f"{warm.url}/reset_prefix_cache") as r:
                assert r.status == 200
            await post(session, warm.url, [1, 2, 3])  # vLLM publishes the clear with the next step
            await until(lambda: index.match(index.keys_for(contexts[0])).matched.get(warm.address, 0) == 0)
