"""Scraping in a real child process, published through shared memory (`ScraperProcess`, the board).

The child is spawned as `epp serve` spawns it; the pods are real aiohttp servers on 127.0.0.1.
No test asserts a duration: each waits (with a generous bound) for a state to be reached.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

from epp.datalayer.board import MetricsBoard
from epp.datalayer.scrape_process import ScraperProcess
from epp.datalayer.scraper import ScrapeStats
from epp.datastore import Datastore, Endpoint, EndpointMetrics, EndpointSpec
from epp.shm import Segment

from .helpers import fixture_body, wait_until
from .test_scraper import BUSY, IDLE, FakeModelServer

INTERVAL = 0.02


@pytest.fixture
async def servers() -> AsyncIterator[list[FakeModelServer]]:
    made: list[FakeModelServer] = []
    yield made
    for server in made:
        await server.close()


async def new_server(servers: list[FakeModelServer], body: bytes = BUSY) -> FakeModelServer:
    server = await FakeModelServer().start()
    server.body = body
    servers.append(server)
    return server


@pytest.fixture
async def process() -> AsyncIterator[tuple[Datastore, ScraperProcess]]:
    datastore = Datastore()
    scraper = ScraperProcess(datastore, interval=INTERVAL, timeout=0.5, slots=8)
    await scraper.start()
    yield datastore, scraper
    await scraper.stop()


def test_the_board_round_trips_a_state_and_stats() -> None:
    board = MetricsBoard.create(4)
    reader = MetricsBoard.attach(board.name)
    try:
        ep = Endpoint(EndpointSpec("pod-a", "10.0.0.1", 8000))
        ep.metrics = EndpointMetrics(waiting_queue_size=3, running_requests=7, kv_cache_usage=0.25,
                                     models=frozenset({"base", "ünïcode"}), active_models=frozenset({"a1", "a2"}),
                                     waiting_models=frozenset(), max_active_models=4, cache_block_size=16,
                                     cache_num_blocks=1 << 33, max_model_len=131072, update_time=12.5,
                                     inter_token_latency=0.02, itl_sum=4.5, itl_count=300.0)
        ep.metrics_valid = False
        ep.metrics_asked = 12.25  # (the page was asked for before it arrived)
        ep.scrape_error = "invalid metrics: vllm:kv_cache_usage_perc: 85.0 is not a valid fraction"
        assert reader.versions(4) == [0, 0, 0, 0] and reader.read_state(2) is None
        version = board.publish_state(2, 77, ep)
        state = reader.read_state(2)
        assert state is not None and (state.version, state.token, state.address) == (version, 77, "10.0.0.1:8000")
        assert state.metrics == ep.metrics
        assert (state.metrics.itl_sum, state.metrics.itl_count) == (4.5, 300.0)
        assert (state.valid, state.error, state.asked) == (False, ep.scrape_error, 12.25)
        assert reader.versions(4)[2] == version
        stats = ScrapeStats(scrapes=9, errors=2, consecutive_errors=1, last_duration=0.001, last_success=12.5,
                            last_error="HTTP 500", problems=("vllm:lora_requests_info: not found",),
                            invalid={"vllm:kv_cache_usage_perc": 2}, interval=0.1)
        board.publish_stats(2, 77, stats)
        assert reader.read_stats(2) == (77, stats)
    finally:
        reader.close()
        board.close()


async def test_metrics_reach_the_datastore_from_the_child(servers: list[FakeModelServer],
                                                          process: tuple[Datastore, ScraperProcess]) -> None:
    datastore, scraper = process
    server = await new_server(servers)
    ep = datastore.upsert(server.spec("pod-a"))
    await wait_until(lambda: ep.metrics.update_time > 0, "first scrape through the board")
    m = ep.metrics
    assert (m.waiting_queue_size, m.running_requests, m.cache_block_size, m.cache_num_blocks) == (8, 4, 128, 64)
    assert m.update_time <= time.monotonic()  # the child stamps with the clock every process shares
    assert 0 < ep.metrics_asked <= m.update_time  # and says when it asked for the page (the ledger's snapshot)
    assert scraper.pid is not None and scraper.pid != os.getpid()
    server.body = IDLE
    await wait_until(lambda: ep.metrics.running_requests == 0, "new values")
    # stats are published when they tell something new, and at least once a second
    await wait_until(lambda: (scraper.stats(ep.address) or ScrapeStats()).scrapes >= 2, "the poll count")
    stats = scraper.stats(ep.address)
    assert stats is not None and stats.errors == 0
    assert scraper.all_stats().keys() == {ep.address}


async def test_invalid_values_and_errors_cross_the_board(servers: list[FakeModelServer],
                                                         process: tuple[Datastore, ScraperProcess]) -> None:
    datastore, scraper = process
    server = await new_server(servers)
    ep = datastore.upsert(server.spec("pod-a"))
    await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
    good = ep.metrics
    server.body = BUSY.replace(b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.2222222222222222',
                               b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 85')
    await wait_until(lambda: not ep.metrics_valid, "marked invalid")
    assert ep.scrape_error.startswith("invalid metrics: vllm:kv_cache_usage_perc")
    assert ep.metrics is good  # nothing new was taken
    await wait_until(lambda: (scraper.stats(ep.address) or ScrapeStats()).invalid.get("vllm:kv_cache_usage_perc", 0)
                     >= 2, "invalid scrapes counted")
    server.mode = "error"
    await wait_until(lambda: ep.scrape_error.startswith("HTTP 500"), "an HTTP error")
    server.mode = "ok"
    server.body = BUSY
    await wait_until(lambda: ep.metrics_valid and ep.scrape_error == "" and ep.metrics is not good, "recovery")


async def test_a_reused_slot_never_shows_the_previous_endpoints_metrics(
        servers: list[FakeModelServer], process: tuple[Datastore, ScraperProcess]) -> None:
    datastore, scraper = process
    busy, idle = await new_server(servers, BUSY), await new_server(servers, IDLE)
    first = datastore.upsert(busy.spec("pod-a"))
    await wait_until(lambda: first.metrics.running_requests == 4, "the first endpoint scraped")
    datastore.remove(first.address)
    second = datastore.upsert(idle.spec("pod-b"))
    assert scraper._by_address[second.address] == 0  # the same slot
    seen: list[int] = []
    deadline = time.monotonic() + 10
    while second.metrics.update_time == 0 and time.monotonic() < deadline:
        scraper.sync()
        seen.append(second.metrics.running_requests)
        await asyncio.sleep(0.001)
    assert second.metrics.update_time > 0 and second.metrics.running_requests == 0
    assert 4 not in seen and first.metrics.running_requests == 4


async def test_a_killed_child_is_restarted_and_carries_on(servers: list[FakeModelServer],
                                                          process: tuple[Datastore, ScraperProcess]) -> None:
    datastore, scraper = process
    server = await new_server(servers)
    ep = datastore.upsert(server.spec("pod-a"))
    await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
    first_pid = scraper.pid
    assert first_pid is not None
    os.kill(first_pid, signal.SIGKILL)
    await wait_until(lambda: scraper.restarts == 1 and scraper.pid not in (None, first_pid), "a new child", limit=20)
    before = ep.metrics.update_time
    await wait_until(lambda: ep.metrics.update_time > before, "scrapes from the new child", limit=20)
    assert ep.metrics.running_requests == 4


async def test_stop_ends_the_child_and_removes_the_board(servers: list[FakeModelServer]) -> None:
    server = await new_server(servers)
    datastore = Datastore()
    scraper = ScraperProcess(datastore, interval=INTERVAL, slots=4)
    await scraper.start()
    ep = datastore.upsert(server.spec("pod-a"))
    await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
    process = scraper._process
    assert process is not None and scraper.board is not None
    name = scraper.board.name
    await scraper.stop()
    assert not scraper.running and scraper.pid is None and scraper.all_stats() == {}
    with pytest.raises(FileNotFoundError):
        Segment.attach(name)
    count = server.requests
    await asyncio.sleep(INTERVAL * 5)
    assert server.requests == count  # nothing scrapes any more
    datastore.upsert(server.spec("pod-b"))  # a change after the stop starts nothing
    assert scraper.pid is None


def test_needs_the_monotonic_clock() -> None:
    with pytest.raises(ValueError, match="monotonic"):
        ScraperProcess(Datastore(clock=lambda: 0.0))


def test_fixture_pages_fit_a_board_slot() -> None:
    from epp.datalayer import CoreMetricsExtractor

    ep = Endpoint(EndpointSpec("a", "::1", 8000))
    for name in ("busy", "idle"):
        result = CoreMetricsExtractor().extract(ep, fixture_body(name), now=1.0)
        assert result.metrics is not None
        ep.metrics = result.metrics
        board = MetricsBoard.create(1)
        try:
            board.publish_state(0, 1, ep)
            state = board.read_state(0)
            assert state is not None and state.metrics == result.metrics and state.address == "[::1]:8000"
        finally:
            board.close()


async def test_the_child_says_when_the_board_changed(servers: list[FakeModelServer]) -> None:
    """With the backing timer out of the way (an hour), the metrics still reach the datastore
    poll after poll: the child's notes trigger the copies, and nothing else calls `sync` here."""
    datastore = Datastore()
    scraper = ScraperProcess(datastore, interval=INTERVAL, timeout=0.5, slots=8, sync_interval=3600.0)
    await scraper.start()
    try:
        server = await new_server(servers)
        ep = datastore.upsert(server.spec("pod-a"))
        await wait_until(lambda: ep.metrics.update_time > 0, "first scrape through the board")
        for body, running in ((IDLE, 0), (BUSY, 4), (IDLE, 0)):
            server.body = body
            await wait_until(lambda r=running: ep.metrics.running_requests == r, f"running {running}")
        before = ep.metrics.update_time
        await wait_until(lambda: ep.metrics.update_time > before, "a later scrape (the ITL counters moved)")
    finally:
        await scraper.stop()


async def test_a_backed_off_pod_is_polled_at_the_full_rate_once_the_epp_sends_it_requests() -> None:
    """An idle simulated vLLM pod (its `?name[]=` page does not move) backs off in the child, and
    the board says so; a request in flight on it — in this process, or in a request-path worker
    reading the board (`BoardReader`) — brings it back to the full rate."""
    from epp.scale.board_reader import BoardReader
    from epp.sim.server import start_pods, stop_pods

    pods = await start_pods(1)
    datastore = Datastore()
    scraper = ScraperProcess(datastore, interval=INTERVAL, max_interval=8 * INTERVAL, timeout=0.5, slots=8)
    await scraper.start()
    member = Datastore()
    reader = BoardReader(member, "")
    try:
        spec = EndpointSpec("pod-0", "127.0.0.1", pods[0].port)
        ep = datastore.upsert(spec)

        def interval() -> float:
            stats = scraper.stats(ep.address)
            return stats.interval if stats is not None else 0.0

        await wait_until(lambda: interval() == 8 * INTERVAL, "backed off in the child")
        assert ep.metrics.update_time > 0 and ep.metrics_valid and ep.scrape_error == ""
        assert ep.metrics.cache_num_blocks > 0  # read from the pod's page
        board = scraper.board
        assert board is not None and board.interval == INTERVAL
        state = board.read_state(0)
        assert state is not None and state.address == ep.address and state.interval == 8 * INTERVAL
        ep.inflight_requests = 1  # what the director books at a pick
        await wait_until(lambda: interval() == INTERVAL, "the full rate again")
        ep.inflight_requests = 0
        await wait_until(lambda: interval() == 8 * INTERVAL, "backed off again")

        reader.board_name = board.name
        await reader.start()
        theirs = member.upsert(spec)
        await wait_until(lambda: theirs.metrics.update_time > 0, "the member reads the board")
        theirs.inflight_requests = 1
        await wait_until(lambda: interval() == INTERVAL, "the full rate again, told by the member")
    finally:
        await reader.stop()
        await scraper.stop()
        await stop_pods(pods)
