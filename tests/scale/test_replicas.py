"""Active-active replicas over a real Redis server: two EPPs (single-process, in this test
process) share in-flight counts, ledgers and prefix picks through the replica link, in the
background; a replica that leaves — cleanly or silently — leaves nothing counted behind."""

from __future__ import annotations

import asyncio
import itertools
import socket
import uuid

import pytest

from epp.api.request import Api, InferenceRequest
from epp.local.envoy import free_port
from epp.runner import EndpointPicker
from epp.scheduling.plugins.approx_prefix_cache_producer import ApproxPrefixCacheProducer
from tests.conftest import running_picker

from .helpers import wait_for

ENDPOINTS = "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000,10.0.0.4:8000"
PREFIX_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- type: active-request-scorer
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: active-request-scorer, weight: 1}
dataLayer:
  sources: []
"""
_ids = itertools.count()


def request(prompt: str) -> InferenceRequest:
    return InferenceRequest(request_id=f"r{next(_ids)}", api=Api.COMPLETIONS, model="m", target_model="m",
                            body={"model": "m", "prompt": prompt}, prompt=prompt.encode(), max_tokens=16)


def inflight(picker: EndpointPicker) -> dict[str, int]:
    return {ep.address: ep.inflight_requests for ep in picker.datastore.endpoints()}


def replica(redis_url: str, channel: str, **overrides):  # type: ignore[no-untyped-def]
    return running_picker(static_endpoints=ENDPOINTS, replicas_url=redis_url, replicas_channel=channel,
                          replicas_peer_ttl=1.0, **overrides)


def subscribed(picker: EndpointPicker) -> bool:
    """Pub/sub keeps nothing for a replica not yet subscribed: it has heard another replica once."""
    return picker.replicas is not None and len(picker.replicas.peers) > 0


def refreshed(picker: EndpointPicker) -> EndpointPicker:
    assert picker.member is not None
    picker.member.drain()
    return picker


async def test_inflight_counts_and_ledgers_reach_the_other_replica(redis_url: str) -> None:
    channel = f"test:{uuid.uuid4().hex}"
    async with replica(redis_url, channel) as a, replica(redis_url, channel) as b:
        records = []
        for i in range(6):
            _, record = await a.director.handle_request(request(f"question {i} " + "x" * 200))
            records.append(record)
        await wait_for(lambda: sum(inflight(refreshed(b)).values()) == 6, what="B sees A's six picks")
        assert inflight(b) == inflight(a)
        assert sum(ep.load.requests for ep in b.datastore.endpoints()) == 6
        # B's own picks go around A's: the burst as a whole stays even.
        for i in range(6):
            await b.director.handle_request(request(f"other {i} " + "y" * 200))
        assert sorted(inflight(b).values()) == [3, 3, 3, 3]
        for record in records:
            a.director.release(record)
        await wait_for(lambda: sum(inflight(refreshed(b)).values()) == 6, what="B sees A's ends")
        assert picker_is_ready(b)


def picker_is_ready(picker: EndpointPicker) -> bool:
    return picker.ready()  # active-active: ready without leader election or leadership


async def test_prefix_picks_reach_the_other_replica(redis_url: str) -> None:
    channel = f"test:{uuid.uuid4().hex}"
    system = "You are a meticulous assistant for the ACME support desk. " * 40
    async with replica(redis_url, channel, config_text=PREFIX_CONFIG) as a, \
            replica(redis_url, channel, config_text=PREFIX_CONFIG) as b:
        await wait_for(lambda: subscribed(b), what="B subscribed (it heard A's heartbeat)")
        decision, record = await a.director.handle_request(request(system + "first question"))
        a.director.release(record)
        first = decision.targets[0].address

        producer = next(p for p in b.config.plugins.values() if isinstance(p, ApproxPrefixCacheProducer))
        later = request(system + "a later question")

        def b_knows() -> bool:
            refreshed(b)
            return producer.lookup(later, list(b.datastore.endpoints())).matched.get(first, 0) > 30

        await wait_for(b_knows, what="B's index holds the blocks A sent to its pod")
        decision, record = await b.director.handle_request(later)
        assert decision.targets[0].address == first  # B routes the shared prefix where A cached it
        b.director.release(record)


async def test_a_replica_that_leaves_takes_its_counts_with_it(redis_url: str) -> None:
    channel = f"test:{uuid.uuid4().hex}"
    async with replica(redis_url, channel) as b:
        async with replica(redis_url, channel) as a:
            for i in range(4):
                await a.director.handle_request(request(f"q{i}" + "z" * 100))
            await wait_for(lambda: sum(inflight(refreshed(b)).values()) == 4, what="B sees A's picks")
        # A stopped (its goodbye): B forgets its counts at once, before any TTL.
        await wait_for(lambda: sum(inflight(refreshed(b)).values()) == 0, timeout=5, what="A's counts gone")


async def test_a_silent_replica_is_forgotten_after_its_ttl(redis_url: str) -> None:
    channel = f"test:{uuid.uuid4().hex}"
    async with replica(redis_url, channel) as b, replica(redis_url, channel) as a:
        for i in range(4):
            await a.director.handle_request(request(f"q{i}" + "z" * 100))
        await wait_for(lambda: sum(inflight(refreshed(b)).values()) == 4, what="B sees A's picks")
        assert a.replicas is not None
        for task in a.replicas._tasks:  # A goes silent without a goodbye (as if killed)
            task.cancel()
        await asyncio.gather(*a.replicas._tasks, return_exceptions=True)
        await wait_for(lambda: sum(inflight(refreshed(b)).values()) == 0, timeout=10,
                       what="A's counts forgotten after the peer TTL")
        assert await b_metric(b, "inference_extension_replica_peers_expired_total") == 1


async def b_metric(picker: EndpointPicker, name: str) -> float:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(picker.metrics.registry).decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def test_without_redis_a_replica_serves_on_its_own_view() -> None:
    async with replica("redis://127.0.0.1:1/0", f"test:{uuid.uuid4().hex}") as a:
        decision, record = await a.director.handle_request(request("hello " * 50))
        assert decision.targets
        a.director.release(record)
        assert sum(inflight(a).values()) == 0


async def test_active_active_readiness_does_not_wait_for_leadership(redis_url: str) -> None:
    class Standby:
        is_leader = False

    async with replica(redis_url, f"test:{uuid.uuid4().hex}") as a:
        a.leader = Standby()  # type: ignore[assignment]  # elected, but not leading
        assert a.ready()
        a.leader = None
    async with running_picker() as alone:
        alone.leader = Standby()  # type: ignore[assignment]
        assert not alone.ready()  # without active-active, only the leader is ready
        alone.leader = None


async def test_a_replica_of_another_layout_is_ignored_and_said_once(redis_url: str, caplog) -> None:  # type: ignore[no-untyped-def]
    """A rolling upgrade runs two versions at once: rows of another table layout cannot be added
    field by field, so they are left out — and the log says so, once per replica."""
    import logging

    import msgspec

    from epp.scale.replicas import _SHARED, LoadMessage

    async with replica(redis_url, f"test:{uuid.uuid4().hex}") as a:
        link = a.replicas
        assert link is not None
        old = msgspec.msgpack.encode(LoadMessage("old-version", True, {"10.0.0.1:8000": [1.0] * (_SHARED - 1)}))
        with caplog.at_level(logging.WARNING, logger="epp.scale.replicas"):
            for _ in range(3):
                link._received(link._load_channel, old)
        said = [r for r in caplog.records if "fields per endpoint" in r.getMessage()]
        assert len(said) == 1
        assert "10.0.0.1:8000" not in link.peers["old-version"].endpoints
        assert sum(inflight(refreshed(a)).values()) == 0


def test_the_redis_server_started_on_a_port_taken_meanwhile_moves_to_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port chosen free can be taken before the server binds it: it starts again on another
    (as the local Envoy and `epp serve` in the tests do)."""
    from epp.local import redis_server

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(redis_server, "free_port", lambda: next(ports, 0) or free_port())
        server = redis_server.RedisServer()
        try:
            server.start()
            assert server.port != taken
            assert server.url.endswith(f":{server.port}/0")
        finally:
            server.stop()
