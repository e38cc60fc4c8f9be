"""End to end through a real Envoy, with flow control on, in front of simulated vLLM pods: a flood
from one user does not make another user wait behind all of it; batch traffic is shed with 429
when the pool is saturated while interactive traffic waits its turn; clients that leave (queued
or running) leave nothing behind. Assertions are on order, status and counts, never durations."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from epp.flowcontrol.flow_admission import FlowControlAdmission
from epp.local.stack import LocalStack, StackConfig
from epp.sim.config import EngineConfig, SimConfig

pytestmark = pytest.mark.e2e

# Each pod runs two sequences at a time, and flow control sends a pod at most two requests.
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
  priorityBands:
  - {priority: -1, shedWhenSaturated: true}
"""


@pytest.fixture
async def stack():  # type: ignore[no-untyped-def]
    async with LocalStack(StackConfig(pods=2, sim=SIM, epp_config_text=CONFIG)) as s:
        assert s.picker is not None
        s.picker.datastore.set_objective("batch", -1)
        yield s


def queued(stack: LocalStack) -> int:
    assert stack.picker is not None and isinstance(stack.picker.admission, FlowControlAdmission)
    return len(stack.picker.admission.controller)


async def post(session: aiohttp.ClientSession, url: str, user: str, max_tokens: int,
               objective: str = "") -> tuple[int, bytes]:
    headers = {"content-type": "application/json", "x-gateway-inference-fairness-id": user}
    if objective:
        headers["x-gateway-inference-objective"] = objective
    body = {"model": SIM.model, "prompt": f"{user} asks something", "max_tokens": max_tokens, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", data=orjson.dumps(body), headers=headers) as r:
        return r.status, await r.read()


async def until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_flood_from_one_user_does_not_delay_another_behind_all_of_it(stack: LocalStack) -> None:
    finished: list[str] = []

    async def one(session: aiohttp.ClientSession, user: str) -> None:
        status, body = await post(session, stack.url, user, max_tokens=400)
        assert status == 200, body
        finished.append(user)

    async with aiohttp.ClientSession() as session:
        flood = [asyncio.create_task(one(session, "a")) for _ in range(24)]
        await until(lambda: queued(stack) >= 16, "the flood to queue in the EPP")
        waiting = queued(stack)  # a's requests held here, not in the engines' FIFO queues
        await one(session, "b")
        await asyncio.gather(*flood)
    behind = len(finished) - 1 - finished.index("b")
    # Round robin gives a at most one turn before b, and b's wave has four slots; allow one more
    # wave to start between counting `waiting` and b's arrival. Everything else finishes after b.
    # Without flow control all of a's requests would sit in the engines' queues ahead of b.
    assert behind >= waiting - 8, (waiting, finished)
    assert queued(stack) == 0


async def test_batch_is_shed_with_429_while_saturated_and_leavers_leave_nothing(stack: LocalStack) -> None:
    assert stack.picker is not None
    async with aiohttp.ClientSession() as session:
        # Long requests: the four slots stay taken for the whole test, two more wait in the EPP.
        flood = [asyncio.create_task(post(session, stack.url, "a", max_tokens=5000)) for _ in range(6)]
        await until(lambda: queued(stack) == 2, "all four slots taken, two queued")
        status, body = await post(session, stack.url, "nightly-job", max_tokens=5, objective="batch")
        assert status == 429, body
        assert body.startswith(b"inference error: ResourceExhausted - system saturated, sheddable request dropped")
        chat = asyncio.create_task(post(session, stack.url, "c", max_tokens=5))  # interactive waits instead
        await until(lambda: queued(stack) == 3, "the interactive request to queue")
        for task in flood:  # a's clients give up: queued and running requests alike
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
        assert (await chat)[0] == 200
        status, _ = await post(session, stack.url, "nightly-job", max_tokens=5, objective="batch")
        assert status == 200  # an idle pool takes batch work
    admission = stack.picker.admission
    assert isinstance(admission, FlowControlAdmission)
    # (a plain response's usage comes in Envoy's access-log batch after its end: its flow is
    # released when it comes)
    await until(lambda: admission.controller.inflight == 0
                and sum(ep.inflight_requests for ep in stack.picker.datastore.endpoints()) == 0
                and all(band.flows == {} for band in admission.controller.bands()),
                "every in-flight count and flow back to zero")
    assert len(admission.controller) == 0 and admission.controller.queued_bytes == 0


LIMITS = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: active-request-scorer
- {type: concurrency-detector, parameters: {maxConcurrency: 1}}
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins: [{pluginRef: active-request-scorer}]
saturationDetector: {pluginRef: concurrency-detector}
flowControl:
  vllmPriority: {enabled: true, bandStride: 1000}
  priorityBands:
  - {priority: 0, maxRequests: 2}
  - {priority: 5}
  - {priority: 7, defaultRequestTTL: 300ms}
"""


async def test_limits_ttl_and_vllm_priority_through_envoy() -> None:
    sim = SimConfig(time_scale=0.05, engine=EngineConfig(max_num_seqs=1, num_gpu_blocks=4096,
                                                         scheduling_policy="priority"))
    async with LocalStack(StackConfig(pods=1, sim=sim, epp_config_text=LIMITS)) as stack:
        assert stack.picker is not None
        stack.picker.datastore.set_objective("chat", 5)
        stack.picker.datastore.set_objective("urgent", 7)
        async with aiohttp.ClientSession() as session:
            running = asyncio.create_task(post(session, stack.url, "a", max_tokens=5000, objective="chat"))
            await until(lambda: stack.picker.datastore.endpoints()[0].inflight_requests == 1, "the pod to be busy")
            # The forwarded body carries vLLM's priority: band 5 (x stride 1000), the user's first request.
            engine = stack.pods[0].engine
            await until(lambda: bool(engine.running), "the request to reach the engine")
            assert [r.priority for r in engine.running] == [-5000]
            # Band 0 holds at most two queued requests; the third is turned away with 429.
            held = [asyncio.create_task(post(session, stack.url, "a", max_tokens=5)) for _ in range(2)]
            await until(lambda: queued(stack) == 2, "two requests queued")
            status, body = await post(session, stack.url, "b", max_tokens=5)
            assert status == 429, body
            # Band 7 has a 300 ms TTL: with the pod busy for much longer, the request ends with 503.
            headers = {"content-type": "application/json", "x-gateway-inference-objective": "urgent"}
            async with session.post(f"{stack.url}/v1/completions", headers=headers, data=orjson.dumps(
                    {"model": sim.model, "prompt": "chat", "max_tokens": 5})) as r:
                assert r.status == 503
                assert (await r.text()).startswith("inference error: ServiceUnavailable - request timed out in queue")
            for task in [running, *held]:
                task.cancel()
            await asyncio.gather(running, *held, return_exceptions=True)
        await until(lambda: queued(stack) == 0 and stack.picker.datastore.endpoints()[0].inflight_requests == 0,
                    "nothing left behind")
