"""Flow control with `epp serve --workers 2` behind a real Envoy: the pod's workers hand their
requests to one dispatcher, so there is one set of queues — a flood from one user does not make
another wait behind all of it, and a higher priority goes first — whichever worker took each
stream. Assertions are on order and counts, never durations."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from epp.local.envoy import EnvoyProcess
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.server import start_pods, stop_pods

from .helpers import EppServe, wait_for
from .test_workers_e2e import envoy_for

pytestmark = pytest.mark.e2e

SIM = SimConfig(time_scale=0.05, engine=EngineConfig(max_num_seqs=2, num_gpu_blocks=4096))

CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: active-request-scorer
- {type: concurrency-detector, parameters: {maxConcurrency: 2}}
- type: round-robin-fairness-policy
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: active-request-scorer}]
saturationDetector: {pluginRef: concurrency-detector}
flowControl:
  defaultPriorityBand: {fairnessPolicyRef: round-robin-fairness-policy}
"""

OBJECTIVES = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: chat}
spec: {priority: 10}
"""


async def post(session: aiohttp.ClientSession, url: str, user: str, max_tokens: int, objective: str = "") -> int:
    headers = {"content-type": "application/json", "x-gateway-inference-fairness-id": user}
    if objective:
        headers["x-gateway-inference-objective"] = objective
    body = {"model": SIM.model, "prompt": f"{user} asks something", "max_tokens": max_tokens, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", data=orjson.dumps(body), headers=headers) as r:
        await r.read()
        return r.status


async def queued(epp: EppServe) -> float:
    return await epp.metric("inference_extension_flow_control_queue_size")


async def test_fairness_and_priority_hold_across_workers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text(OBJECTIVES)
    pods = await start_pods(2, config=SIM)
    epp = EppServe([p.address for p in pods], workers=2, config_text=CONFIG,
                   extra=["--objectives-file", str(objectives)])
    envoy: EnvoyProcess | None = None
    try:
        await epp.start()
        envoy = envoy_for(epp)
        finished: list[str] = []

        async def one(session: aiohttp.ClientSession, user: str, objective: str = "") -> None:
            assert await post(session, envoy.url, user, 400, objective) == 200
            finished.append(user)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            flood = [asyncio.create_task(one(session, "a")) for _ in range(24)]
            await wait_for(lambda: _at_least(epp, 16), what="the flood to queue in the pod's dispatcher")
            waiting = int(await queued(epp))
            await asyncio.gather(one(session, "b"), one(session, "chat", objective="chat"))
            await asyncio.gather(*flood)
        # Round robin gives a at most one turn before b, the higher band goes before every a; a
        # wave of four slots, plus one more that may start between counting and arriving.
        for late in ("b", "chat"):
            behind = len(finished) - 1 - finished.index(late)
            assert behind >= waiting - 8, (late, waiting, finished)
        handed = [await epp.metric("inference_extension_pod_member_picks", member=f"worker-{m}") for m in range(2)]
        assert min(handed) > 0, handed  # both workers took streams and handed them over
        await wait_for(lambda: _settled(epp), what="queues and in-flight counts back to zero")
        # Every response's usage reached the dispatcher (Envoy's access log lands on one worker,
        # which relays the other's entries): what token fairness charges.
        await wait_for(lambda: _output_tokens(epp, 26 * 400), what="every response's usage counted")
    finally:
        if envoy is not None:
            envoy.close()
        epp.stop()
        await stop_pods(pods)


async def _output_tokens(epp: EppServe, n: int) -> bool:
    return await epp.metric("inference_objective_output_tokens_sum") == n


async def _at_least(epp: EppServe, n: int) -> bool:
    return await queued(epp) >= n


async def _settled(epp: EppServe) -> bool:
    return (await queued(epp) == 0 and await epp.metric("inference_pool_endpoint_inflight_requests") == 0
            and await epp.metric("inference_objective_running_requests") == 0)


async def test_a_killed_worker_leaves_nothing_queued_or_counted_in_the_dispatcher() -> None:
    from .test_workers_e2e import _busiest_worker_pid

    pods = await start_pods(2, config=SIM)
    epp = EppServe([p.address for p in pods], workers=2, config_text=CONFIG)
    envoy: EnvoyProcess | None = None
    try:
        await epp.start()
        envoy = envoy_for(epp)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            held = [asyncio.create_task(post(session, envoy.url, "a", 20000)) for _ in range(12)]
            await wait_for(lambda: _at_least(epp, 8), what="four running, eight queued")
            import os
            import signal

            os.kill(await _busiest_worker_pid(epp), signal.SIGKILL)
            await wait_for(lambda: _below(epp, 8), what="the dead worker's queued requests gone")
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        await wait_for(lambda: _settled(epp), timeout=30, what="queues and in-flight counts back to zero")
        await wait_for(epp.ready, timeout=60, what="the pod ready again")
    finally:
        if envoy is not None:
            envoy.close()
        epp.stop()
        await stop_pods(pods)


async def _below(epp: EppServe, n: int) -> bool:
    return await queued(epp) < n
