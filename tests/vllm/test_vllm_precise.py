"""Precise prefix routing, and the default profile on the shipped Envoy config, against two real vLLM
0.32 CPU servers (see README.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from tokenizers import Tokenizer

from epp.config.options import Options
from epp.discovery.static import StaticDiscovery, parse_endpoint_list
from epp.local.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.runner import EndpointPicker
from tests.precise.helpers import MODEL_DIR

VLLM_PYTHON = os.environ.get("EPP_VLLM_PYTHON", "")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not VLLM_PYTHON, reason="EPP_VLLM_PYTHON not set (make test-vllm)"),
              pytest.mark.timeout(900)]

CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters: {{modelName: tiny, local: {{path: '{model}'}}}}
- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig: {{zmqEndpoint: "tcp://*:{port}", topicFilter: "kv@"}}
- type: prefix-cache-scorer
  parameters: {{prefixMatchInfoProducerName: precise-prefix-cache-producer}}
"""
PREFIX = " ".join(f"w{i}" for i in range(512))  # 512 tokens = 4 of the CPU backend's 128-token blocks


class Server:
    def __init__(self, model: Path, port: int, events_port: int, log: Path) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.url = f"http://{self.address}"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}",
                  "topic": f"kv@{self.address}@tiny"}
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
        self.log = log
        self.proc = subprocess.Popen(
            [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
             "--model", str(model), "--served-model-name", "tiny", "--load-format", "dummy", "--max-model-len", "1024",
             "--enable-prefix-caching", "--max-num-seqs", "4", "--num-gpu-blocks-override", "64",
             "--kv-events-config", json.dumps(events)],
            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)

    async def ready(self, session: aiohttp.ClientSession, timeout: float = 400.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            try:
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1.0)
        raise TimeoutError(f"vLLM on {self.port} not healthy: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.asynccontextmanager
async def cluster(work: Path) -> AsyncIterator[tuple[list[Server], EndpointPicker, EnvoyProcess]]:
    model = work / "model"
    shutil.copytree(MODEL_DIR, model)
    events_port = free_port()
    ports = [free_port(), free_port()]
    discovery = StaticDiscovery(parse_endpoint_list(",".join(f"127.0.0.1:{p}" for p in ports)))
    options = Options(grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=-1, bind_address="127.0.0.1",
                      secure_serving=False, config_text=CONFIG.format(model=model, port=events_port),
                      pool_name="vllm", debug_decision_header=True)
    picker = EndpointPicker(options, discovery=discovery)
    await picker.start()  # the SUB is bound before the servers connect
    servers = [Server(model, p, events_port, work / f"vllm-{p}.log") for p in ports]
    envoy = EnvoyProcess(EnvoyConfig(listen_port=free_port(), admin_port=free_port(), epp_port=picker.grpc_port,
                                     response_header_mode="SEND"))  # the decision header rides on it
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            await asyncio.gather(*(s.ready(session) for s in servers))
        envoy.start()
        yield servers, picker, envoy
    finally:
        envoy.close()
        for s in servers:
            s.stop()
        await picker.stop(grace=0)


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 2) -> str:
    async with session.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0}) as r:
        assert r.status == 200, await r.text()
        return r.headers.get("x-epp-decision", "")


async def until(cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


async def test_two_real_vllm_servers(tmp_path: Path) -> None:
    """One pair of servers (a minute to start) for every check."""
    async with cluster(tmp_path) as running:
        await check_tokenize_agrees_with_the_local_tokenizer(*running)
        await check_warmed_server_draws_the_prefix_then_loses_it_when_evicted(*running)
        await check_the_default_profile_learns_from_real_responses_on_the_shipped_config(running[0])


async def check_tokenize_agrees_with_the_local_tokenizer(servers: list[Server], picker: EndpointPicker,
                                                         envoy: EnvoyProcess) -> None:
    token = picker.config.plugins["token-producer"]
    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    async with aiohttp.ClientSession() as session:
        prompt = PREFIX + " the quick brown fox"
        async with session.post(servers[0].url + "/tokenize", json={"model": "tiny", "prompt": prompt}) as r:
            assert (await r.json())["tokens"] == tok.encode(prompt).ids
        messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "hello the quick brown fox"}]
        async with session.post(servers[0].url + "/tokenize", json={"model": "tiny", "messages": messages}) as r:
            remote = (await r.json())["tokens"]
        local = tok.encode(token.local.render(messages, {}), add_special_tokens=False).ids
        assert remote == local


async def check_warmed_server_draws_the_prefix_then_loses_it_when_evicted(servers: list[Server], picker: EndpointPicker,
                                                                         envoy: EnvoyProcess) -> None:
    index = picker.core.precise_producers[0].index
    warm, cold = servers[1], servers[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await complete(session, warm.url, PREFIX + " w1000 w1001")  # directly, not through the gateway
        await until(lambda: index.endpoint_size(warm.address) >= 8)  # 512 tokens = 8 router blocks of 64
        for i in range(4):
            decision = await complete(session, envoy.url, PREFIX + f" w{1500 + i} w{1600 + i}")
            assert f"pick={warm.address}" in decision, decision
        match = picker.trace.latest(1)[0].result.cycle.data["precise-prefix-cache-producer"]
        assert match.matched.get(warm.address, 0) >= 8 and match.sources[warm.address] == "precise"
        # Evict the prefix by direct traffic: 16 unrelated 700-token prompts (5 blocks each) overflow
        # the 63 usable blocks (vLLM also rejects prompts over 5 characters per allowed token).
        for k in range(16):
            await complete(session, warm.url, " ".join(f"w{(k * 97 + j) % 2000}" for j in range(700)),
                           max_tokens=1)
        keys = index.keys_for(Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(PREFIX).ids)
        await until(lambda: index.match(keys).matched.get(warm.address, 0) == 0)
        decision = await complete(session, envoy.url, PREFIX + " w1900")
        match = picker.trace.latest(1)[0].result.cycle.data["precise-prefix-cache-producer"]
        assert match.matched.get(warm.address, 0) == 0, decision
        assert picker.kv_subscribers[0].stats.gaps == 0
        assert picker.kv_subscribers[0].stats.unknown_topic_messages == 0


async def check_the_default_profile_learns_from_real_responses_on_the_shipped_config(servers: list[Server]) -> None:
    """A second EPP on the built-in default (the predicted-latency profile) behind the Envoy
    config this project ships (no response phase on the picking filter; an observer for a
    stream's first token; Envoy's access log for every response's usage): against real vLLM
    responses, every request's usage reaches the EPP (the token metrics sum what vLLM said it
    generated), every pick ends (nothing in flight, nothing reported late), the service model
    learns each stream's first token, and the scraped pages are real vLLM's (the KV cache's size
    from `cache_config_info`)."""
    discovery = StaticDiscovery(parse_endpoint_list(",".join(s.address for s in servers)))
    options = Options(grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=-1, bind_address="127.0.0.1",
                      secure_serving=False, pool_name="vllm-default")
    picker = EndpointPicker(options, discovery=discovery)
    await picker.start()
    envoy = EnvoyProcess(EnvoyConfig(listen_port=free_port(), admin_port=free_port(), epp_port=picker.grpc_port))
    try:
        envoy.start()
        assert envoy.config.observed
        endpoints = list(picker.datastore.endpoints())
        await until(lambda: all(ep.metrics.kv_capacity_tokens > 0 and ep.metrics_valid for ep in endpoints))
        # its --max-model-len, read from cache_config_info (kv_cache_size_tokens / kv_cache_max_concurrency)
        assert all(ep.metrics.max_model_len == 1024 for ep in endpoints)
        before = sum(ep.service.observations for ep in endpoints)
        generated = 0
        streamed = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for i in range(8):
                stream = i % 2 == 1
                chat = i % 4 >= 2
                body: dict = {"model": "tiny", "max_tokens": 3 + i, "temperature": 0, "ignore_eos": True}
                if chat:
                    body["messages"] = [{"role": "user", "content": f"w{i} w{i + 1} question {i}"}]
                else:
                    body["prompt"] = f"w{i} w{i + 1} question {i}"
                if stream:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                    streamed += 1
                path = "/v1/chat/completions" if chat else "/v1/completions"
                async with session.post(envoy.url + path, json=body) as r:
                    assert r.status == 200, await r.text()
                    raw = await r.read()
                if stream:
                    events = [line[len(b"data: "):] for line in raw.splitlines() if line.startswith(b"data: {")]
                    usage = json.loads(events[-1])["usage"]
                else:
                    usage = json.loads(raw)["usage"]
                generated += usage["completion_tokens"]
        assert generated == sum(3 + i for i in range(8))  # ignore_eos: each wrote its max_tokens
        registry = picker.metrics.registry
        await until(lambda: sum(ep.inflight_requests for ep in endpoints) == 0)
        await until(lambda: registry.get_sample_value("inference_objective_output_tokens_sum",
                                                      {"model_name": "tiny", "target_model_name": "tiny"}) == generated)
        access_log = picker.extproc.access_log
        assert (access_log.reported, access_log.unmatched, picker.extproc.handoff.late) == (8, 0, 0)
        assert all(ep.load.requests == 0 for ep in endpoints)
        learned = sum(ep.service.observations for ep in endpoints) - before
        assert learned >= streamed, learned  # each stream's first token at least
        assert registry.get_sample_value("inference_extension_ttft_prediction_error_ratio_count") == streamed
    finally:
        envoy.close()
        await picker.stop(grace=0)
