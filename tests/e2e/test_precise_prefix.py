"""End to end: precise prefix routing from KV events, behind a real Envoy, simulated vLLM pods.

The pods' events come from real ZMQ publishers speaking vLLM 0.32's protocol
(`tests/precise/publisher.py`), one per pod, publishing the blocks each pod caches: the test warms
a pod *directly* (not through the gateway, so only the events can tell the EPP) and publishes
what vLLM would (`BlockStored` with the prompt's token ids, 128-token blocks, hashes of its own),
then evicts (`BlockRemoved`). (The simulator's own publisher, `epp sim --kv-events-config`, is
on branch kv-publisher and not wired to its CLI yet.)

Active-active: two EPPs behind one Envoy (its ext_proc cluster load-balances streams between
them), each subscribing to every pod (discovery mode: the pods bind, every replica dials), build
the same index, so requests with one prefix land on the same pod whichever EPP picks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest
from tokenizers import Tokenizer

from epp.config.options import Options
from epp.discovery.static import StaticDiscovery, parse_endpoint_list
from epp.local.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.local.podstats import pod_stats
from epp.runner import EndpointPicker
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.server import SimPod, start_pods, stop_pods
from tests.precise.helpers import MODEL_DIR
from tests.precise.publisher import Publisher, Removed, Stored, batch

pytestmark = pytest.mark.e2e

SIM = SimConfig(model="tiny", time_scale=0.05, engine=EngineConfig(max_num_seqs=8, num_gpu_blocks=4096))
TOKENIZER = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
CONTEXT = " ".join(f"w{(i * 7) % 2000}" for i in range(1024))  # a customer's long shared context (1024 tokens)


def config(events: str) -> str:
    return f"""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters: {{modelName: tiny, local: {{path: '{MODEL_DIR}'}}}}
- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig: {events}
- type: prefix-cache-scorer
  parameters: {{prefixMatchInfoProducerName: precise-prefix-cache-producer}}
- type: active-request-scorer
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: prefix-cache-scorer, weight: 3}}
  - {{pluginRef: active-request-scorer, weight: 1}}
"""


@dataclass(slots=True)
class TwoEppEnvoy(EnvoyConfig):
    """Envoy's ext_proc cluster with two EPP endpoints, round-robin: the streams alternate."""

    second_epp_port: int = 0

    def render(self) -> str:
        text = EnvoyConfig.render(self)
        one = f"""        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {self.epp_port}}}}}"""
        two = one + f"""
        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {self.second_epp_port}}}}}"""
        assert one in text
        return text.replace(one, two).replace("    type: STATIC\n    connect_timeout: 5s\n    typed_extension",
                                              "    type: STATIC\n    lb_policy: ROUND_ROBIN\n    connect_timeout: 5s\n"
                                              "    typed_extension")


class Engine:
    """What a vLLM pod publishes for the prompts it cached (128-token blocks, its own hashes)."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.stored: list[int] = []

    def cache(self, prompt: str) -> None:
        ids = TOKENIZER.encode(prompt).ids
        n = len(ids) // 128
        hashes = [hash(("engine", tuple(ids[: (i + 1) * 128]))) & (2**64 - 1) for i in range(n)]
        self.stored += hashes
        self.publisher.send(batch(Stored(hashes, None, ids[: n * 128], 128)))

    def evict_all(self) -> None:
        self.publisher.send(batch(Removed(list(reversed(self.stored)))))
        self.stored = []


@dataclass
class Setup:
    pods: list[SimPod]
    pickers: list[EndpointPicker]
    envoy: EnvoyProcess
    engines: dict[str, Engine] = field(default_factory=dict)


async def send(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    async with session.post(f"{url}/v1/completions", data=orjson.dumps(body),
                            headers={"content-type": "application/json"}) as r:
        assert r.status == 200, await r.text()
        return r.headers.get("x-epp-decision", "")


async def finished(session: aiohttp.ClientSession, pods: list[SimPod]) -> list[float]:
    return [(await pod_stats(session, pod.url)).finished for pod in pods]


async def until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def picker(pods: list[SimPod], config_text: str) -> EndpointPicker:
    discovery = StaticDiscovery(parse_endpoint_list(",".join(p.address for p in pods)))
    options = Options(grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=-1, bind_address="127.0.0.1",
                      secure_serving=False, config_text=config_text, refresh_metrics_interval=0.05, pool_name="local",
                      debug_decision_header=True)
    p = EndpointPicker(options, discovery=discovery)
    await p.start()
    return p


@contextlib.asynccontextmanager
async def central_setup() -> AsyncIterator[Setup]:
    pods = await start_pods(3, config=SIM)
    port = free_port()
    p = await picker(pods, config(f'{{zmqEndpoint: "tcp://127.0.0.1:{port}", topicFilter: "kv@"}}'))
    envoy = EnvoyProcess(EnvoyConfig(listen_port=free_port(), admin_port=free_port(), epp_port=p.grpc_port,
                                     response_header_mode="SEND"))  # the decision header rides on it
    publishers = [Publisher(f"tcp://127.0.0.1:{port}", f"kv@{pod.address}@tiny") for pod in pods]  # connect mode
    try:
        envoy.start()
        yield Setup(pods, [p], envoy, {pod.address: Engine(pub) for pod, pub in zip(pods, publishers)})
    finally:
        envoy.close()
        for pub in publishers:
            pub.close()
        await p.stop(grace=0)
        await stop_pods(pods)


async def wait_subscribed(setup: Setup) -> None:
    """Every EPP has heard every pod (an empty batch, resent until it arrives: ZMQ's slow joiner)."""
    for address, engine in setup.engines.items():
        for p in setup.pickers:
            index = p.core.precise_producers[0].index
            while not index.has_events(address):
                engine.publisher.send(batch())
                await asyncio.sleep(0.05)


async def test_warmed_directly_then_routed_there_then_evicted() -> None:
    async with central_setup() as setup, aiohttp.ClientSession() as session:
        await wait_subscribed(setup)
        warm = setup.pods[1]
        # Warm pod 1 directly: the EPP never saw this request, only the pod's events tell it.
        async with session.post(f"{warm.url}/v1/completions", json={"model": "tiny", "prompt": CONTEXT + " w1",
                                                                     "max_tokens": 1}) as r:
            assert r.status == 200
        setup.engines[warm.address].cache(CONTEXT + " w1")
        index = setup.pickers[0].core.precise_producers[0].index
        await until(lambda: index.endpoint_size(warm.address) > 0)
        before = await finished(session, setup.pods)
        for i in range(6):
            decision = await send(session, setup.envoy.url, CONTEXT + f" w{i} w{i + 5}")
            assert f"pick={warm.address}" in decision, decision
        after = await finished(session, setup.pods)
        assert [a - b for a, b in zip(after, before)] == [0, 6, 0]
        # Evict it by direct traffic's events: the EPP stops claiming the prefix.
        setup.engines[warm.address].evict_all()
        await until(lambda: index.endpoint_size(warm.address) == 0)
        trace = setup.pickers[0].trace
        await send(session, setup.envoy.url, CONTEXT + " w9")
        match = trace.latest(1)[0].result.cycle.data["precise-prefix-cache-producer"]
        assert match.matched.get(warm.address, 0) == 0
        assert set(match.sources.values()) == {"precise"}


async def test_two_epps_behind_one_envoy_pick_the_same_pod() -> None:
    pods = await start_pods(3, config=SIM)
    publishers = [Publisher("tcp://127.0.0.1:0", f"kv@{pod.address}@tiny", replay_endpoint="tcp://127.0.0.1:0")
                  for pod in pods]  # vLLM's default: each pod binds its PUB (and a replay ROUTER)
    sockets = ", ".join(f'"{pod.address}": "{pub.endpoint}"' for pod, pub in zip(pods, publishers))
    replays = ", ".join(f'"{pod.address}": "{pub.replay_endpoint}"' for pod, pub in zip(pods, publishers))
    text = config(f'{{discoverPods: true, topicFilter: "kv@", podDiscoveryConfig: {{endpoints: {{{sockets}}}}}, '
                  f'replay: {{endpoints: {{{replays}}}}}}}')
    pickers = [await picker(pods, text), await picker(pods, text)]
    envoy = EnvoyProcess(TwoEppEnvoy(listen_port=free_port(), admin_port=free_port(), epp_port=pickers[0].grpc_port,
                                     second_epp_port=pickers[1].grpc_port, response_header_mode="SEND",
                                     # streams alternate between the EPPs: an observer stream would
                                     # always land on the other one (and this counts picks per EPP)
                                     observer=False))
    try:
        envoy.start()
        setup = Setup(pods, pickers, envoy, {pod.address: Engine(pub) for pod, pub in zip(pods, publishers)})
        async with aiohttp.ClientSession() as session:
            await wait_subscribed(setup)
            targets = {}
            for customer, pod in enumerate(pods):
                context = f"w{customer} " + CONTEXT
                setup.engines[pod.address].cache(context)
            for p in pickers:
                index = p.core.precise_producers[0].index
                await until(lambda index=index: all(index.endpoint_size(pod.address) > 0 for pod in pods))
            for customer, pod in enumerate(pods):
                context = f"w{customer} " + CONTEXT
                for i in range(6):
                    decision = await send(session, envoy.url, context + f" user{i} w{i}")
                    targets.setdefault(customer, set()).add(decision.split(";")[0])
                assert targets[customer] == {f"pick={pod.address}"}, targets
            # Both replicas served (Envoy alternated the ext_proc streams) and both indexes agree.
            assert all(p.trace.total >= 6 for p in pickers), [p.trace.total for p in pickers]
            sizes = [[p.core.precise_producers[0].index.endpoint_size(pod.address) for pod in pods] for p in pickers]
            assert sizes[0] == sizes[1]
    finally:
        envoy.close()
        for pub in publishers:
            pub.close()
        for p in pickers:
            await p.stop(grace=0)
        await stop_pods(pods)
