"""`epp serve --workers 2` behind a real Envoy, in front of simulated vLLM pods: the workers act as
one EPP (their picks spread as one process's would), and a killed worker's in-flight requests
leave the pod's accounting."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections import Counter

import aiohttp
import orjson
import pytest

from epp.local.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.local.podstats import pod_stats
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.server import start_pods, stop_pods

from .helpers import EppServe, wait_for

pytestmark = pytest.mark.e2e

# The pick follows only the EPP's own in-flight counts (scraped metrics are equal on idle pods and
# stale within a burst): one process spreads 64 requests 16 per pod, and so must a pod of workers.
LOAD_ONLY = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: active-request-scorer
- type: max-score-picker
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: active-request-scorer}
  - {pluginRef: max-score-picker}
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
"""

# Slow enough that a whole burst is in flight at once (each request decodes for seconds).
SLOW = SimConfig(time_scale=1.0, engine=EngineConfig(max_num_seqs=64, num_gpu_blocks=8192))


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> int:
    async with session.post(f"{url}/v1/completions", data=orjson.dumps(body),
                            headers={"content-type": "application/json"}) as r:
        await r.read()
        return r.status


@pytest.fixture
async def pods():  # type: ignore[no-untyped-def]
    started = await start_pods(4, config=SLOW)
    yield started
    await stop_pods(started)


def envoy_for(*epp: EppServe) -> EnvoyProcess:
    """Envoy with a cap of 2 streams per connection to the EPP: a burst opens many connections,
    which the kernel spreads over the workers (SO_REUSEPORT)."""
    envoy = EnvoyProcess(EnvoyConfig(free_port(), free_port(), epp[0].grpc_port,
                                     extra_epp_ports=tuple(e.grpc_port for e in epp[1:]),
                                     epp_max_concurrent_streams=2))
    envoy.start()
    return envoy


async def burst_counts(pods, envoy: EnvoyProcess, n: int, body: dict,  # type: ignore[no-untyped-def]
                       epps: tuple[EppServe, ...] = ()) -> Counter[int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        before = [(await pod_stats(session, p.url)).finished for p in pods]
        statuses = await asyncio.gather(*(post(session, envoy.url, body) for _ in range(n)))
        after = [(await pod_stats(session, p.url)).finished for p in pods]
    # (on failure, what each EPP logged and what Envoy counted of its ext_proc streams)
    assert statuses == [200] * n, (statuses, envoy.stats("http.inference.ext_proc"),
                                   [epp.log_text for epp in epps])
    return Counter({i: int(a - b) for i, (a, b) in enumerate(zip(after, before))})


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_burst_over_two_workers_lands_evenly(pods, workers) -> None:  # type: ignore[no-untyped-def]
    epp = EppServe([p.address for p in pods], workers=workers, config_text=LOAD_ONLY)
    await epp.start()
    envoy = envoy_for(epp)
    try:
        body = {"model": SLOW.model, "prompt": "Tell me a story about a lighthouse keeper. " * 4,
                "max_tokens": 400, "ignore_eos": True}
        counts = await burst_counts(pods, envoy, 64, body, (epp,))
        assert sum(counts.values()) == 64
        assert all(15 <= c <= 17 for c in counts.values()), counts
        if workers > 1:
            picks = [await epp.metric("inference_extension_pod_member_picks", member=f"worker-{m}")
                     for m in range(workers)]
            assert sum(picks) >= 64 and min(picks) > 0, picks  # every worker took part of the burst
        await wait_for(lambda: _inflight_zero(epp), what="in-flight back to zero")
    finally:
        envoy.close()
        epp.stop()


async def _inflight_zero(epp: EppServe) -> bool:
    return await epp.metric("inference_pool_endpoint_inflight_requests") == 0


async def test_a_killed_worker_leaves_no_inflight_behind(pods) -> None:  # type: ignore[no-untyped-def]
    epp = EppServe([p.address for p in pods], workers=2)
    await epp.start()
    envoy = envoy_for(epp)
    try:
        body = {"model": SLOW.model, "prompt": "A long answer, please. " * 4, "max_tokens": 4000,
                "ignore_eos": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            tasks = [asyncio.create_task(post(session, envoy.url, body)) for _ in range(16)]
            await wait_for(lambda: _inflight_at_least(epp, 16), what="16 requests in flight")
            victim = await _busiest_worker_pid(epp)
            os.kill(victim, signal.SIGKILL)
            # Its requests end (Envoy answers them with an error); the survivor's stay in flight.
            await wait_for(lambda: _inflight_below(epp, 16), what="the dead worker's requests released")
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await wait_for(lambda: _inflight_zero(epp), timeout=30, what="in-flight back to zero")
        await wait_for(epp.ready, timeout=60, what="the pod ready again with a new worker")
        assert await epp.metric("inference_extension_pod_member_restarts_total") >= 1
    finally:
        envoy.close()
        epp.stop()


async def _inflight_at_least(epp: EppServe, n: int) -> bool:
    return await epp.metric("inference_pool_endpoint_inflight_requests") >= n


async def _inflight_below(epp: EppServe, n: int) -> bool:
    return await epp.metric("inference_pool_endpoint_inflight_requests") < n


async def _busiest_worker_pid(epp: EppServe) -> int:
    """The pid of the worker that made the most picks (so it holds some of the burst)."""
    picks = {m: await epp.metric("inference_extension_pod_member_picks", member=f"worker-{m}") for m in range(2)}
    busiest = max(picks, key=lambda m: picks[m])
    return int(await epp.metric("inference_extension_pod_member_pid", member=f"worker-{busiest}"))


async def test_the_pod_exposes_one_set_of_the_reference_metrics_and_one_status(pods) -> None:  # type: ignore[no-untyped-def]
    """Same families as one process, counters summed over the workers; one admin status."""
    import grpc

    from epp.admin.v1 import admin_pb2, admin_pb2_grpc

    single = EppServe([p.address for p in pods], workers=1)
    pod = EppServe([p.address for p in pods], workers=2)
    await asyncio.gather(single.start(), pod.start())
    envoys = [envoy_for(single), envoy_for(pod)]
    try:
        body = {"model": SLOW.model, "prompt": "Short question? " * 8, "max_tokens": 2}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            for envoy in envoys:
                assert await asyncio.gather(*(post(session, envoy.url, body) for _ in range(24))) == [200] * 24
        # Families, not series: which labelled series exist depends on the picks each made (one
        # made a prefix copy, the other not). A labelled counter's `_created` family exists only
        # once one of its series does, so those say which picks were made, not what is exposed.
        names_one, names_pod = [{n for n in await e.families() if not n.endswith("_created")}
                                for e in (single, pod)]
        assert names_one <= names_pod, sorted(names_one - names_pod)
        assert "inference_objective_request" in names_one and len(names_one) > 30
        assert await pod.metric("inference_objective_request_total") == 24
        assert await pod.metric("inference_extension_scheduler_e2e_duration_seconds_count") == 24
        assert await pod.metric("inference_pool_ready_pods") == 4  # a pool view: not added up
        async with grpc.aio.insecure_channel(f"127.0.0.1:{pod.admin_port}") as channel:
            status = await admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(decisions=50))
        assert status.ready and len(status.endpoints) == 4 and status.requests_total == 24
        assert len(status.decisions) == 24
        assert scrapers(pod) == 1  # one scraper process for the pod, whose board both workers read
    finally:
        for envoy in envoys:
            envoy.close()
        single.stop()
        pod.stop()


def scrapers(epp: EppServe) -> int:
    """Scraper processes in the pod's process tree."""
    assert epp.proc is not None

    def tree(pid: int) -> list[int]:
        try:
            children = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
        except OSError:
            return []
        return children + [g for c in children for g in tree(c)]

    count = 0
    for pid in tree(epp.proc.pid):
        try:
            count += b"epp.datalayer.scrape_process" in open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            pass
    return count


async def test_the_harness_retries_a_start_whose_port_was_taken(pods) -> None:  # type: ignore[no-untyped-def]
    """`free_port` hands out ephemeral ports another process may take before `epp serve` binds
    them (a flake seen in a clean-clone run); the harness starts again on fresh ports."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    epp = EppServe([p.address for p in pods], workers=1, grpc_port=taken.getsockname()[1])
    try:
        await epp.start()
        assert epp.grpc_port != taken.getsockname()[1]
        assert await epp.ready()
    finally:
        epp.stop()
        taken.close()
