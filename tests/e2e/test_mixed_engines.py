"""End to end through a real Envoy: one pool of two simulated vLLM pods and two simulated TGI pods
(`epp sim --engine tgi`: TGI's API and tgi_ metrics), the engine of each chosen by the static
endpoints file, flow control on with vLLM `priority` passthrough.

Every API the pool serves: OpenAI completions and chat (either engine), TGI's `/generate` and
`/generate_stream` (TGI pods only); routed by load and by prefix; TGI pods never get a `priority`
field while vLLM pods do; bad TGI bodies get the EPP's 400s; nothing stays in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from epp.config.options import Options
from epp.local.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.runner import EndpointPicker
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.protocol import ParsedRequest
from epp.sim.request import FINISH_LENGTH, FINISH_STOP
from epp.sim.server import SimPod, start_pods, stop_pods

pytestmark = pytest.mark.e2e

VLLM = SimConfig(time_scale=0.05, engine=EngineConfig(max_num_seqs=8, num_gpu_blocks=4096))
# TGI has no ignore_eos: its simulated outputs run to max_new_tokens, so a loaded pod stays loaded.
TGI = replace(VLLM, server="tgi", mean_output_tokens=1e6)

CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: prefix-cache-scorer
- type: active-request-scorer
- type: round-robin-fairness-policy
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: active-request-scorer, weight: 2}
flowControl:
  vllmPriority: {}
  defaultPriorityBand: {fairnessPolicyRef: round-robin-fairness-policy}
"""


@dataclass
class MixedPool:
    """Envoy → EPP (static endpoints file) → 2 vLLM + 2 TGI simulated pods, in this process."""

    vllm: list[SimPod]
    tgi: list[SimPod]
    picker: EndpointPicker
    envoy: EnvoyProcess
    priorities: dict[str, list[int]] = field(default_factory=dict)  # the `priority` each vLLM pod parsed

    @property
    def url(self) -> str:
        return self.envoy.url

    def inflight(self) -> int:
        return sum(ep.inflight_requests for ep in self.picker.datastore.endpoints())

    def kind(self, address: str) -> str:
        return "tgi" if any(p.address == address for p in self.tgi) else "vllm"


def endpoints_file(path: Path, vllm: list[SimPod], tgi: list[SimPod]) -> Path:
    # vllm-0 has no engine: the extractor's default, vLLM, as for an unlabelled pod.
    lines = [f"- {{address: {vllm[0].address}, name: vllm-0}}",
             f"- {{address: {vllm[1].address}, name: vllm-1, engine: vllm}}"]
    lines += [f"- {{address: {p.address}, name: tgi-{i}, engine: tgi}}" for i, p in enumerate(tgi)]
    path.write_text("\n".join(lines) + "\n")
    return path


def spy_priorities(pool: MixedPool) -> None:
    """Record the `priority` each vLLM pod parsed from the bodies it received."""
    for pod in pool.vllm:
        seen = pool.priorities.setdefault(pod.address, [])
        make = pod._make_request

        def recording(p: ParsedRequest, make=make, seen=seen):  # type: ignore[no-untyped-def]
            seen.append(p.priority)
            return make(p)

        pod._make_request = recording  # type: ignore[method-assign]


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[MixedPool]:
    vllm = await start_pods(2, config=VLLM)
    tgi = await start_pods(2, config=replace(TGI, seed=10))
    picker = envoy = None
    try:
        options = Options(grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=0, bind_address="127.0.0.1",
                          secure_serving=True, config_text=CONFIG, refresh_metrics_interval=0.05,
                          pool_name="mixed", static_endpoints_file=str(endpoints_file(tmp_path / "pool.yaml", vllm, tgi)))
        picker = EndpointPicker(options)
        await picker.start()
        picker.datastore.set_objective("interactive", 1)
        envoy = EnvoyProcess(EnvoyConfig(listen_port=free_port(), admin_port=free_port(), epp_port=picker.grpc_port,
                                         epp_tls=True, upstreams=tuple(p.address for p in vllm + tgi)))
        envoy.start()
        mixed = MixedPool(vllm, tgi, picker, envoy)
        spy_priorities(mixed)
        await until(lambda: all(ep.metrics.update_time > 0 for ep in picker.datastore.endpoints()), "first scrapes")
        yield mixed
    finally:
        if envoy is not None:
            envoy.close()
        if picker is not None:
            await picker.stop(grace=0)
        await stop_pods(vllm + tgi)


async def until(predicate, what: str, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def post(session: aiohttp.ClientSession, url: str, path: str, body: Any, **headers: str) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(url + path, data=data, headers={"content-type": "application/json", **headers}) as r:
        return r.status, await r.read()


def finished(pods: list[SimPod]) -> list[int]:
    """Requests each pod's engine completed (not aborted), whatever API it speaks."""
    return [p.engine.finished_by_reason[FINISH_STOP] + p.engine.finished_by_reason[FINISH_LENGTH] for p in pods]


async def test_every_api_is_served_by_a_pod_that_speaks_it(pool: MixedPool) -> None:
    async with aiohttp.ClientSession() as s:
        tgi_before = finished(pool.tgi)
        vllm_before = finished(pool.vllm)
        for i in range(6):  # TGI's native APIs: only the TGI pods can serve them
            status, body = await post(s, pool.url, "/generate", {"inputs": f"native {i}",
                                                                    "parameters": {"max_new_tokens": 3}})
            assert status == 200 and "generated_text" in orjson.loads(body)
            status, body = await post(s, pool.url, "/generate_stream", {"inputs": f"stream {i}",
                                                                           "parameters": {"max_new_tokens": 3}})
            assert status == 200 and body.startswith(b"data:{\"index\":1,") and b'"generated_text":"' in body
        assert sum(a - b for a, b in zip(finished(pool.tgi), tgi_before)) == 12
        assert finished(pool.vllm) == vllm_before
        # The OpenAI APIs: either engine answers them, given the served model's name (vLLM knows
        # no model "tgi"; TGI takes any name that is not one of its adapters for its base model).
        for i in range(8):
            status, body = await post(s, pool.url, "/v1/chat/completions", {
                "model": VLLM.model, "messages": [{"role": "user", "content": f"chat {i}"}], "max_tokens": 3})
            assert status == 200 and orjson.loads(body)["usage"]["completion_tokens"] >= 1, body
            status, body = await post(s, pool.url, "/v1/completions", {"model": VLLM.model, "prompt": f"c {i}",
                                                                          "max_tokens": 3})
            assert status == 200 and orjson.loads(body)["object"] == "text_completion"
    assert all(pod.tgi.ignored_fields["priority"] == 0 for pod in pool.tgi)
    assert any(pool.priorities.values())  # some OpenAI requests went to vLLM, with a priority
    await until(lambda: pool.inflight() == 0, "every request released")


async def test_tgi_pods_never_get_a_priority_field_and_vllm_pods_do(pool: MixedPool) -> None:
    async with aiohttp.ClientSession() as s:
        # Several requests of one user at once: flow control numbers them 0, 1, 2... within the band.
        replies = await asyncio.gather(*(
            post(s, pool.url, "/v1/chat/completions",
                 {"model": VLLM.model, "messages": [{"role": "user", "content": f"question {i} " + "x" * (40 * i)}],
                  "max_tokens": 8},
                 **{"x-gateway-inference-fairness-id": "alice", "x-gateway-inference-objective": "interactive"})
            for i in range(16)))
        assert [status for status, _ in replies] == [200] * 16
        tgi_served = sum(finished(pool.tgi))
    assert tgi_served > 0, "some chat requests should have gone to the TGI pods"
    vllm_seen = [p for seen in pool.priorities.values() for p in seen]
    assert vllm_seen and all(-1000 <= p < -900 for p in vllm_seen), vllm_seen  # band 1: -1 x stride 1000 + n
    assert all(pod.tgi.ignored_fields["priority"] == 0 for pod in pool.tgi)
    await until(lambda: pool.inflight() == 0, "every request released")


async def test_prefix_affinity_holds_for_tgis_native_api(pool: MixedPool) -> None:
    system = "You are the support assistant of the ACME corporation; answer briefly. " * 30
    async with aiohttp.ClientSession() as s:
        before = finished(pool.tgi)
        for i in range(10):
            status, _ = await post(s, pool.url, "/generate", {"inputs": system + f"Question {i}?",
                                                                 "parameters": {"max_new_tokens": 2}})
            assert status == 200
        routed = [a - b for a, b in zip(finished(pool.tgi), before)]
    assert sorted(routed)[-1] >= 9, routed  # all but at most one (a tie on the very first) on one pod


async def test_load_steers_tgi_traffic_away_from_a_busy_tgi_pod(pool: MixedPool) -> None:
    busy = pool.tgi[0]
    async with aiohttp.ClientSession() as s:
        # Load TGI pod 0 directly, behind the EPP's back: only its tgi_queue_size shows it.
        background = [asyncio.create_task(post(s, busy.url, "/generate", {
            "inputs": f"busy {i} " * 30, "parameters": {"max_new_tokens": 3000}})) for i in range(16)]
        endpoint = pool.picker.datastore.get(busy.address)
        assert endpoint is not None
        await until(lambda: endpoint.metrics.waiting_queue_size >= 4, "the busy pod's queue in its tgi_ metrics")
        before = finished(pool.tgi)
        for i in range(10):
            status, _ = await post(s, pool.url, "/generate", {"inputs": f"unrelated {i} {'z' * i}",
                                                                 "parameters": {"max_new_tokens": 2}})
            assert status == 200
        routed = [a - b for a, b in zip(finished(pool.tgi), before)]
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    assert routed == [0, 10], routed


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/generate", b'{"inputs": ""}', "invalid TGI generate request: must have a non-empty string inputs field"),
    ("/generate_stream", b'{"parameters": {"max_new_tokens": 3}}',
     "invalid TGI generate request: must have a non-empty string inputs field"),
    ("/generate", b'{"inputs": "x", "parameters": 3}', "invalid TGI generate request: parameters must be an object"),
    ("/generate", b"{}", "invalid generate request: must have inputs (TGI) or text, input_ids or input_embeds"),
    ("/generate", b'{"inputs": "x"', "error unmarshaling request body"),
    ("/generate", b'{"text": "an SGLang body, and no SGLang pod"}', None),
])
async def test_bad_tgi_bodies_get_the_same_clear_errors(pool: MixedPool, path: str, body: bytes,
                                                        message: str | None) -> None:
    async with aiohttp.ClientSession() as s:
        status, reply = await post(s, pool.url, path, body)
    if message is None:
        assert status == 503 and reply.decode() == ("inference error: ServiceUnavailable - no endpoint serves the "
                                                    "sglang/generate API (needs engine sglang)")
    else:
        assert status == 400 and reply.decode().startswith(f"inference error: BadRequest - {message}"), reply
    assert pool.inflight() == 0
    assert all(pod.tgi.in_flight == 0 for pod in pool.tgi)
