"""Leader election on a Lease in the fake apiserver: one leader, failover, readiness follows."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client

import grpc
from epp.config.options import Options
from epp.discovery.leader import LeaderElector, LeaseTiming, lease_name
from epp.runner import EndpointPicker
from tests.conftest import NO_SCRAPE
from tests.discovery.conftest import eventually
from tests.discovery.fakeapi import FakeApiServer, inference_pool, pod

QUICK = LeaseTiming(lease_duration=1.0, renew_deadline=0.5, retry_period=0.05)
LEASE = lease_name("default", "pool")


def elector(api: client.ApiClient, identity: str) -> LeaderElector:
    return LeaderElector(api, "default", LEASE, identity=identity, timing=QUICK)


def holder(fake: FakeApiServer) -> str | None:
    lease = fake.get("leases", LEASE)
    return lease["spec"].get("holderIdentity") if lease else None


async def only_one_leads(electors: list[LeaderElector], samples: int = 30) -> None:
    for _ in range(samples):
        assert sum(e.is_leader for e in electors) <= 1
        await asyncio.sleep(0.01)


def test_lease_name_and_timing_rules() -> None:
    assert lease_name("ns", "vllm") == "epp-ns-vllm.gateway-api-inference-extension.sigs.k8s.io"
    with pytest.raises(ValueError):
        LeaseTiming(lease_duration=10, renew_deadline=10, retry_period=2)


async def test_two_candidates_one_leader_and_release_hands_over(fake: FakeApiServer, api: client.ApiClient) -> None:
    a, b = elector(api, "a"), elector(api, "b")
    await a.start()
    await b.start()
    try:
        await eventually(lambda: a.is_leader or b.is_leader, what="a leader")
        await only_one_leads([a, b])
        leader, standby = (a, b) if a.is_leader else (b, a)
        assert holder(fake) == leader.identity
        await leader.stop()  # releases the lease
        assert not leader.is_leader
        await eventually(lambda: standby.is_leader, timeout=3.0, what="standby takes over")
        assert holder(fake) == standby.identity
        assert fake.get("leases", LEASE)["spec"]["leaseTransitions"] >= 1  # type: ignore[index]
    finally:
        await a.stop()
        await b.stop()
    assert holder(fake) is None  # the last leader released too
    # a LeaderElection event per new leader (sent in the background, best effort)
    await eventually(lambda: fake.count("events", method="POST") >= 2, what="leader election events")


async def test_crashed_leader_is_replaced_after_the_lease_expires(fake: FakeApiServer, api: client.ApiClient) -> None:
    a = elector(api, "a")
    await a.start()
    await eventually(lambda: a.is_leader)
    b = elector(api, "b")
    await b.start()
    try:
        await only_one_leads([a, b])
        assert not b.is_leader
        await a.stop(release=False)  # a crash: the lease stays, naming "a"
        assert holder(fake) == "a"
        await eventually(lambda: b.is_leader, timeout=5.0, what="takeover after expiry")
        assert holder(fake) == "b"
    finally:
        await b.stop()


async def test_leader_steps_down_when_it_cannot_renew(fake: FakeApiServer, api: client.ApiClient) -> None:
    changes: list[bool] = []
    a = LeaderElector(api, "default", LEASE, identity="a", timing=QUICK, on_change=changes.append)
    await a.start()
    try:
        await eventually(lambda: a.is_leader)
        fake.fail_next(10_000, lambda r: "/leases" in r.path)
        await eventually(lambda: not a.is_leader, timeout=3.0, what="step down")
        fake.heal()
        await eventually(lambda: a.is_leader, timeout=3.0, what="leads again once renewals work")
        assert changes[:3] == [True, False, True]
    finally:
        await a.stop()


@contextlib.asynccontextmanager
async def ha_picker(kubeconfig: str) -> AsyncIterator[EndpointPicker]:
    options = Options(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1",
                      secure_serving=False, config_text=NO_SCRAPE, pool_name="pool", pool_namespace="default",
                      kubeconfig=kubeconfig, ha_enable_leader_election=True, ha_lease_duration=1.0,
                      ha_renew_deadline=0.5, ha_retry_period=0.05)
    picker = EndpointPicker(options)
    await picker.start()
    try:
        yield picker
    finally:
        await picker.stop(grace=0)


async def health(picker: EndpointPicker, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.health_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
        return reply.status


async def test_readiness_is_serving_only_on_the_leader(fake: FakeApiServer, kubeconfig: str) -> None:
    fake.apply(inference_pool("pool", {"app": "vllm"}))
    fake.apply(pod("vllm-0", "127.0.1.1", {"app": "vllm"}))
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    async with ha_picker(kubeconfig) as one, ha_picker(kubeconfig) as two:
        pickers = [one, two]
        await eventually(lambda: any(p.ready() for p in pickers), what="a ready leader")
        assert all(p.datastore.synced for p in pickers)  # the standby keeps its datastore warm
        leader = one if one.ready() else two
        standby = two if leader is one else one
        assert await health(leader, "readiness") == serving
        assert await health(leader, "") == serving
        assert await health(standby, "readiness") == not_serving
        assert await health(standby, "envoy.service.ext_proc.v3.ExternalProcessor") == not_serving
        assert await health(standby, "liveness") == serving
        await leader.stop(grace=0)
        await eventually(standby.ready, timeout=3.0, what="standby ready after failover")
        assert await health(standby, "readiness") == serving
