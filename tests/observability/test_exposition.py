"""Building `/metrics` never runs on the event loop that serves ext_proc and scrapes the pods.

No durations are asserted: a collector that can hold the build shows that a request is served
*while* the exposition is being built, and which thread builds it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import aiohttp
import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.observability.server import EXPOSITION_THREAD, Exposition
from epp.runner import EndpointPicker
from tests.conftest import channel_to, running_picker
from tests.extproc.client import ExtProcClient, body_msg, headers_msg, request_headers, set_headers


class Probe(Collector):
    """Records the thread each build runs on; while `holding`, blocks the build until released."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.holding = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def reset(self) -> None:
        """Forget the call `register` makes (the registry describes a collector by collecting)."""
        self.threads.clear()
        self.entered.clear()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.threads.append(threading.current_thread())
        self.entered.set()
        if self.holding:
            self.release.wait(5.0)  # a bound, so a build on the loop (the bug) cannot hang the test
        yield GaugeMetricFamily("test_probe", "A probe.", value=1.0)


async def get_metrics(picker: EndpointPicker) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{picker.metrics_port}/metrics") as r:
            assert r.status == 200
            return await r.text()


async def pick(channel) -> str:  # type: ignore[no-untyped-def]
    client = ExtProcClient(channel)
    await client.send(headers_msg(request_headers()), body_msg(orjson.dumps({"model": "m", "prompt": "hi"})))
    headers, _ = await client.recv(2)
    await client.close()
    return set_headers(headers)["x-gateway-destination-endpoint"]


async def test_the_exposition_is_built_off_the_event_loop() -> None:
    async with running_picker() as picker:
        probe = Probe()
        picker.metrics.registry.register(probe)
        probe.reset()
        text = await get_metrics(picker)
    assert "test_probe 1.0" in text
    assert probe.threads and all(t is not threading.current_thread() for t in probe.threads)
    assert all(t.name.startswith(EXPOSITION_THREAD) for t in probe.threads)


async def test_a_request_is_served_while_the_exposition_is_being_built() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        probe = Probe()
        picker.metrics.registry.register(probe)
        probe.reset()
        probe.holding = True
        scrape = asyncio.create_task(get_metrics(picker))
        try:
            assert await asyncio.to_thread(probe.entered.wait, 10.0), "the build never started"
            picked = await asyncio.wait_for(pick(channel), 10.0)
            assert picked.startswith("10.0.0.")
            assert not scrape.done()  # the request went through while the build was still held
        finally:
            probe.release.set()
        assert "test_probe 1.0" in await scrape


async def test_concurrent_scrapes_share_one_build() -> None:
    async with running_picker() as picker:
        probe = Probe()
        picker.metrics.registry.register(probe)
        probe.reset()
        probe.holding = True
        first = asyncio.create_task(get_metrics(picker))
        assert await asyncio.to_thread(probe.entered.wait, 10.0)
        others = [asyncio.create_task(get_metrics(picker)) for _ in range(4)]
        await asyncio.sleep(0.2)  # let them arrive while the first build is held
        probe.release.set()
        texts = await asyncio.gather(first, *others)
        assert all("test_probe 1.0" in t for t in texts)
        assert len(probe.threads) <= 2  # one build for the five (a straggler may start a second)


async def test_a_build_is_reused_for_scrapes_within_the_minimum_interval() -> None:
    """However fast clients fetch /metrics, builds are bounded: a recent one is served again."""
    registry = CollectorRegistry()
    probe = Probe()
    registry.register(probe)
    probe.reset()
    cached, fresh = Exposition(registry, min_interval=3600.0), Exposition(registry, min_interval=0.0)
    try:
        assert [await cached.render() for _ in range(5)] == [await cached.render()] * 5
        assert len(probe.threads) == 1
        for _ in range(3):
            await fresh.render()
        assert len(probe.threads) == 4
    finally:
        cached.close()
        fresh.close()
