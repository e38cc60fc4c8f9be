"""The issue's check, end to end: an in-process EPP (`epp serve` options, Kubernetes discovery via a
kubeconfig) answers real ext_proc streams; a pod turning ready in the fake apiserver is routed to,
and a pod turning unready is not, each within one second.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson

import grpc
from epp.config.options import Options
from epp.discovery.kubernetes import KubernetesDiscovery
from epp.runner import EndpointPicker
from tests.conftest import NO_SCRAPE, channel_to
from tests.discovery.conftest import eventually
from tests.discovery.fakeapi import FakeApiServer, inference_pool, pod
from tests.extproc.client import ExtProcClient, body_msg, headers_msg, request_headers, set_headers

APP = {"app": "vllm"}
A, B = "127.0.1.1:8000", "127.0.1.2:8000"
BOUND = 1.0  # seconds: the bound for routing to follow a readiness change


@contextlib.asynccontextmanager
async def kube_picker(kubeconfig: str) -> AsyncIterator[EndpointPicker]:
    options = Options(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                      secure_serving=False, config_text=NO_SCRAPE, pool_name="pool", pool_namespace="default",
                      kubeconfig=kubeconfig)
    picker = EndpointPicker(options)
    assert isinstance(picker.discovery, KubernetesDiscovery)  # chosen from the flags, as `epp serve` does
    await picker.start()
    try:
        yield picker
    finally:
        await picker.stop(grace=0)


async def route(channel: grpc.aio.Channel, subset: list[str] | None = None) -> str:
    """One request through the ext_proc stream: the endpoint picked, or "status:<code>" if refused."""
    client = ExtProcClient(channel)
    body = orjson.dumps({"model": "m", "prompt": "hello", "max_tokens": 4})
    await client.send(headers_msg(request_headers(), subset=subset), body_msg(body))
    (reply,) = await client.recv(1)
    client.cancel()
    if reply.HasField("immediate_response"):
        return f"status:{reply.immediate_response.status.code}"
    return set_headers(reply)["x-gateway-destination-endpoint"]


async def within_bound(check_once: Callable[[], Awaitable[bool]], what: str) -> float:
    """Poll `check_once()` until true; fail past the issue's one-second bound."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not await check_once():
        if loop.time() - start > BOUND:
            raise AssertionError(f"{what}: not within {BOUND}s")
        await asyncio.sleep(0.005)
    return loop.time() - start


async def test_routing_follows_pod_readiness_within_one_second(fake: FakeApiServer, kubeconfig: str) -> None:
    fake.apply(inference_pool("pool", APP))
    fake.apply(pod("vllm-a", "127.0.1.1", APP))
    fake.apply(pod("vllm-b", "127.0.1.2", APP, ready=False))
    async with kube_picker(kubeconfig) as picker, channel_to(picker) as channel:
        assert picker.ready()
        assert {await route(channel) for _ in range(8)} == {A}  # the unready pod gets nothing
        assert await route(channel, subset=[B]) == "status:503"  # not even when the proxy asks for it

        # B turns ready: the proxy's subset hint lets us ask "would B be picked now?" on every try
        fake.apply(pod("vllm-b", "127.0.1.2", APP))

        async def b_routable() -> bool:
            return await route(channel, subset=[B]) == B

        await within_bound(b_routable, "a pod turning ready is routed to")

        # A turns unready: from the moment a request is refused for A, no request goes to A
        fake.apply(pod("vllm-a", "127.0.1.1", APP, ready=False))

        async def a_gone() -> bool:
            return await route(channel, subset=[A]) == "status:503"

        await within_bound(a_gone, "a pod turning unready is not routed to")
        assert {await route(channel) for _ in range(8)} == {B}

        # and deleted pods, and the pool itself, follow too
        fake.delete("pods", "vllm-b")
        await eventually(lambda: not picker.datastore.endpoints(), timeout=BOUND, what="deleted pod leaves")
        assert (await route(channel)).startswith("status:")
        fake.apply(pod("vllm-a", "127.0.1.1", APP))

        async def a_back() -> bool:
            return await route(channel) == A

        await within_bound(a_back, "a pod back to ready")
        fake.delete("inferencepools", "pool")
        await eventually(lambda: not picker.ready(), timeout=BOUND, what="pool deleted: not ready")
        assert (await route(channel)).startswith("status:")

