"""The scraper against real aiohttp servers on 127.0.0.1 ephemeral ports.

No test asserts a duration: each waits (with a generous bound) for a state to be reached.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import logging
import socket
import ssl
import time
import warnings
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from epp.datalayer import CoreMetricsExtractor, MetricsDataSource, MetricsScraper
from epp.datalayer.engines import BUILTIN_ENGINES
from epp.datalayer.scraper import TRANSITION_LOGS
from epp.datastore import Datastore, Endpoint, EndpointSpec

from .helpers import fixture_body, wait_until

BUSY = fixture_body("busy")
IDLE = fixture_body("idle")
INTERVAL = 0.02


class FakeModelServer:
    """A `/metrics` server whose behaviour a test switches at will."""

    def __init__(self) -> None:
        self.mode = "ok"  # ok | flap | hang | slow | garbage | binary | truncated | error | chunked | no-query
        self.body = BUSY
        self.requests = 0
        self.served_at: list[float] = []
        self.queries: list[str] = []  # the query string of each request
        self.release = asyncio.Event()  # ends every hanging request (so shutdown is quick)
        app = web.Application()
        app.router.add_get("/metrics", self.handle)
        self.server = TestServer(app, host="127.0.0.1")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.queries.append(request.query_string)
        if self.mode == "no-query" and request.query_string:
            return web.Response(status=400, text="unknown parameter")
        if self.mode == "flap":  # every other page an error
            if self.requests % 2:
                return web.Response(status=500, text="boom")
            return web.Response(body=self.body, content_type="text/plain")
        if self.mode == "hang":
            await self.release.wait()
            return web.Response(status=503)
        if self.mode == "slow":
            self.served_at.append(time.monotonic())  # the page describes this moment
            await asyncio.sleep(0.2)
        if self.mode == "garbage":
            return web.Response(body=b"<html>it works!</html>\n", content_type="text/html")
        if self.mode == "binary":
            return web.Response(body=bytes(range(256)) * 8, content_type="application/octet-stream")
        if self.mode == "truncated":
            return web.Response(body=BUSY[:BUSY.index(b"vllm:num_requests_running{") + 40])
        if self.mode == "error":
            return web.Response(status=500, text="boom")
        if self.mode == "chunked":
            resp = web.StreamResponse()
            await resp.prepare(request)
            for i in range(0, len(self.body), 4096):
                await resp.write(self.body[i:i + 4096])
            await resp.write_eof()
            return resp
        return web.Response(body=self.body, content_type="text/plain")

    async def start(self) -> FakeModelServer:
        await self.server.start_server()
        return self

    async def close(self) -> None:
        self.release.set()
        await self.server.close()

    @property
    def port(self) -> int:
        assert self.server.port is not None
        return self.server.port

    def spec(self, name: str, **kw: object) -> EndpointSpec:
        return EndpointSpec(name, "127.0.0.1", self.port, **kw)  # type: ignore[arg-type]


Servers = list[FakeModelServer]
Scraper = tuple[Datastore, MetricsScraper]


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    made: list[FakeModelServer] = []

    yield made
    for server in made:
        await server.close()


async def new_server(servers: Servers, mode: str = "ok") -> FakeModelServer:
    server = await FakeModelServer().start()
    server.mode = mode
    servers.append(server)
    return server


def free_port() -> int:
    """A port nothing listens on (bound then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def newer_than(ep: Endpoint, since: float) -> Callable[[], bool]:
    return lambda: ep.metrics.update_time > since


@pytest.fixture
async def scraper() -> AsyncIterator[Scraper]:
    datastore = Datastore()
    scraper = MetricsScraper(datastore, interval=INTERVAL, timeout=0.5)
    await scraper.start()
    yield datastore, scraper
    await scraper.stop()


async def test_scrapes_a_fixture_into_the_datastore(servers: Servers, scraper: Scraper) -> None:
    datastore, sc = scraper
    server = await new_server(servers)
    ep = datastore.upsert(server.spec("pod-a"))
    await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
    m = ep.metrics
    assert (m.waiting_queue_size, m.running_requests, m.cache_block_size, m.cache_num_blocks) == (8, 4, 128, 64)
    assert m.kv_cache_usage == pytest.approx(14 / 63)
    assert ep.scrape_error == ""
    assert m.update_time <= datastore.clock()
    # new values show up as a new object on a later scrape
    server.body = IDLE
    await wait_until(lambda: ep.metrics.running_requests == 0, "idle values")
    assert m.running_requests == 4  # the old snapshot was never mutated
    stats = sc.stats(ep.address)
    assert stats is not None and stats.scrapes >= 2 and stats.errors == 0
    assert stats.last_duration > 0 and stats.last_success == ep.metrics.update_time


async def test_a_page_is_known_by_when_it_was_asked_for_as_well_as_when_it_arrived(
        servers: Servers, scraper: Scraper) -> None:
    """The ledger tells its own requests on a page from other traffic by what it held when the
    page was written: a request that ended while the page was on its way is still on it. Its age
    (staleness) still counts from its arrival, as the reference's does."""
    datastore, _ = scraper
    server = await new_server(servers, "slow")
    ep = datastore.upsert(server.spec("pod-a"))
    await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
    asked, arrived = ep.metrics_asked, ep.metrics.update_time
    assert asked <= server.served_at[0]  # the first poll's page (one poll at a time per pod)
    assert arrived >= server.served_at[0] + 0.2  # after the server's pause


async def test_endpoints_present_before_start_are_scraped(servers: Servers) -> None:
    server = await new_server(servers)
    datastore = Datastore()
    ep = datastore.upsert(server.spec("pod-a"))
    sc = MetricsScraper(datastore, interval=INTERVAL)
    await sc.start()
    try:
        await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
    finally:
        await sc.stop()


async def test_a_hanging_server_stalls_only_itself(servers: Servers, scraper: Scraper) -> None:
    datastore, _ = scraper
    good_server = await new_server(servers)
    hang_server = await new_server(servers)
    good = datastore.upsert(good_server.spec("good"))
    slow = datastore.upsert(hang_server.spec("slow"))
    await wait_until(lambda: good.metrics.update_time > 0 and slow.metrics.update_time > 0, "first scrapes")

    hang_server.mode = "hang"
    hung_requests = hang_server.requests
    await wait_until(lambda: hang_server.requests > hung_requests, "a request to hang")
    slow_time = slow.metrics.update_time
    # while that request hangs, the other endpoint keeps getting fresh metrics, many times over
    for _ in range(5):
        before = good.metrics.update_time
        await wait_until(newer_than(good, before), "fresh metrics on the good endpoint")
    assert slow.metrics.update_time == slow_time  # stale, old values kept
    assert slow.metrics.running_requests == 4
    await wait_until(lambda: "timed out" in slow.scrape_error, "timeout error")
    assert slow.metrics.update_time == slow_time
    assert good.scrape_error == ""

    hang_server.mode = "ok"
    await wait_until(lambda: slow.metrics.update_time > slow_time and not slow.scrape_error, "recovery")


@pytest.mark.parametrize(
    "mode, error",
    [
        ("garbage", "no metrics found"),
        ("binary", "bad metrics: not Prometheus text"),
        ("truncated", "bad metrics: vllm:num_requests_running at line"),
        ("error", "HTTP 500 Internal Server Error"),
    ],
)
async def test_bad_responses_keep_old_metrics_and_set_an_error(
    servers: Servers, scraper: Scraper, mode: str, error: str,
) -> None:
    datastore, sc = scraper
    server = await new_server(servers)
    other = await new_server(servers)
    ep = datastore.upsert(server.spec("pod-a"))
    ok = datastore.upsert(other.spec("pod-b"))
    await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
    server.mode = mode
    await wait_until(lambda: ep.scrape_error != "", "an error")
    assert ep.scrape_error.startswith(error), ep.scrape_error
    assert len(ep.scrape_error) <= 200
    stale = ep.metrics
    assert stale.running_requests == 4
    before = ok.metrics.update_time
    await wait_until(lambda: ok.metrics.update_time > before, "the other endpoint still scraped")
    stats = sc.stats(ep.address)
    assert stats is not None
    await wait_until(lambda: stats.consecutive_errors >= 3, "repeated errors")
    assert ep.metrics is stale
    server.mode = "ok"
    await wait_until(lambda: ep.scrape_error == "" and ep.metrics is not stale, "recovery")
    assert stats.consecutive_errors == 0 and stats.errors >= 3


async def test_out_of_bounds_values_mark_the_endpoint_invalid_and_are_counted(
    servers: Servers, scraper: Scraper, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="epp.datalayer")
    datastore, sc = scraper
    server = await new_server(servers)
    ep = datastore.upsert(server.spec("pod-a"))
    await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
    good = ep.metrics
    assert ep.metrics_valid
    server.body = BUSY.replace(b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.2222222222222222',
                               b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 1e308')
    assert server.body != BUSY
    await wait_until(lambda: not ep.metrics_valid, "the endpoint marked invalid")
    assert ep.scrape_error.startswith("invalid metrics: vllm:kv_cache_usage_perc: 1e+308 is not a valid fraction")
    assert ep.metrics is good  # the last valid scrape is kept, ageing; nothing clamped
    stats = sc.stats(ep.address)
    assert stats is not None
    await wait_until(lambda: stats.invalid.get("vllm:kv_cache_usage_perc", 0) >= 3, "invalid scrapes counted")
    server.body = BUSY.replace(b'vllm:num_requests_waiting{engine="0",model_name="tiny"} 8.0',
                               b'vllm:num_requests_waiting{engine="0",model_name="tiny"} -5e300')
    await wait_until(lambda: "vllm:num_requests_waiting" in stats.invalid, "the next kind of garbage")
    server.body = BUSY
    await wait_until(lambda: ep.metrics_valid and ep.scrape_error == "", "recovery")
    assert ep.metrics is not good
    messages = [r.getMessage() for r in caplog.records if r.name == "epp.datalayer"]
    failing = [m for m in messages if "failing" in m]
    assert len(failing) == 2  # once per kind of garbage, never per poll
    assert "kv_cache_usage_perc" in failing[0] and "num_requests_waiting" in failing[1]


async def test_a_server_that_is_down(scraper: Scraper) -> None:
    datastore, _ = scraper
    ep = datastore.upsert(EndpointSpec("gone", "127.0.0.1", free_port()))
    await wait_until(lambda: ep.scrape_error != "", "an error")
    assert ep.scrape_error.startswith("cannot connect"), ep.scrape_error
    assert ep.metrics.update_time == 0.0


async def test_errors_are_logged_once_when_they_start_and_once_when_they_clear(
    servers: Servers, scraper: Scraper, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="epp.datalayer")
    datastore, sc = scraper
    server = await new_server(servers, mode="error")
    ep = datastore.upsert(server.spec("pod-a"))
    stats = sc.stats(ep.address)
    assert stats is not None
    await wait_until(lambda: stats.errors >= 5, "several failed polls")
    server.mode = "ok"
    await wait_until(lambda: ep.scrape_error == "", "recovery")
    server.mode = "error"
    await wait_until(lambda: ep.scrape_error != "", "second failure")
    messages = [r.getMessage() for r in caplog.records if r.name == "epp.datalayer"]
    assert len([m for m in messages if "failing" in m]) == 2
    assert len([m for m in messages if "recovered" in m]) == 1
    assert all("pod-a" in m for m in messages)


async def test_a_flapping_pod_does_not_write_a_line_per_poll(
    servers: Servers, scraper: Scraper, caplog: pytest.LogCaptureFixture,
) -> None:
    """A page good and bad in turn: every failure counted, a few transitions logged per window."""
    caplog.set_level(logging.INFO, logger="epp.datalayer")
    datastore, sc = scraper
    server = await new_server(servers, mode="flap")
    ep = datastore.upsert(server.spec("pod-a"))
    stats = sc.stats(ep.address)
    assert stats is not None
    await wait_until(lambda: stats.errors >= 20 and stats.scrapes >= 20, "twenty flips each way")
    messages = [r.getMessage() for r in caplog.records if r.name == "epp.datalayer"]
    transitions = [m for m in messages if "failing" in m or "recovered" in m]
    assert len(transitions) <= TRANSITION_LOGS, transitions


async def test_partly_missing_metrics_warn_once(
    servers: Servers, scraper: Scraper, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="epp.datalayer")
    datastore, sc = scraper
    server = await new_server(servers)
    server.body = b"vllm:num_requests_running 3\nvllm:num_requests_waiting 1\n"
    ep = datastore.upsert(server.spec("pod-a"))
    stats = sc.stats(ep.address)
    assert stats is not None
    await wait_until(lambda: stats.scrapes >= 5, "several scrapes")
    assert ep.scrape_error == "" and ep.metrics.running_requests == 3
    assert any("kv_cache_usage_perc" in p for p in stats.problems)
    warned = [r for r in caplog.records if "some metrics unavailable" in r.getMessage()]
    assert len(warned) == 1


async def test_chunked_bodies_and_the_size_limit(servers: Servers) -> None:
    server = await new_server(servers, mode="chunked")
    datastore = Datastore()
    sc = MetricsScraper(datastore, interval=INTERVAL, max_body_bytes=len(BUSY))
    await sc.start()
    try:
        ep = datastore.upsert(server.spec("pod-a"))
        await wait_until(lambda: ep.metrics.update_time > 0, "chunked body read")
        server.body = BUSY + b"# padding\n" * 10
        await wait_until(lambda: "too large" in ep.scrape_error, "size limit (chunked)")
        server.mode = "ok"
        await wait_until(lambda: ep.scrape_error.startswith("response too large ("), "size limit (content-length)")
    finally:
        await sc.stop()


async def test_removed_endpoint_stops_promptly(servers: Servers, scraper: Scraper) -> None:
    datastore, sc = scraper
    server = await new_server(servers)
    keep_server = await new_server(servers)
    ep = datastore.upsert(server.spec("pod-a"))
    kept = datastore.upsert(keep_server.spec("pod-b"))
    await wait_until(lambda: ep.metrics.update_time > 0 and kept.metrics.update_time > 0, "first scrapes")
    assert ep.address in sc.polling()
    datastore.remove(ep.address)
    assert ep.address not in sc.polling()
    assert sc.stats(ep.address) is None
    count = server.requests
    before = kept.metrics.update_time
    for _ in range(3):  # several intervals of the surviving endpoint, none for the removed one
        t = kept.metrics.update_time
        await wait_until(newer_than(kept, t), "the other endpoint")
    assert kept.metrics.update_time > before
    assert server.requests <= count + 1  # at most the one already in flight
    assert sc.polling() == [kept.address]


async def test_removal_while_hanging_stops_promptly(servers: Servers, scraper: Scraper) -> None:
    datastore, sc = scraper
    server = await new_server(servers, mode="hang")
    ep = datastore.upsert(server.spec("pod-a"))
    await wait_until(lambda: server.requests > 0, "a hanging request")
    assert sc.polling() == [ep.address]
    datastore.remove(ep.address)
    assert sc.polling() == []
    count = server.requests
    await asyncio.sleep(INTERVAL * 5)
    assert server.requests == count  # no new poll of the removed endpoint


async def test_a_changed_scrape_target_restarts_the_loop(servers: Servers, scraper: Scraper) -> None:
    datastore, sc = scraper
    first = await new_server(servers)
    second = await new_server(servers)
    ep = datastore.upsert(first.spec("pod-a"))
    await wait_until(lambda: first.requests > 0, "scrapes of the first port")
    # same address, metrics now on another port: the datastore replaces the endpoint
    new_ep = datastore.upsert(first.spec("pod-a", metrics_port=second.port))
    assert new_ep is not ep
    await wait_until(lambda: new_ep.metrics.update_time > 0 and second.requests > 0, "scrapes of the new port")
    count = first.requests
    await wait_until(lambda: second.requests > 3, "more scrapes")
    assert first.requests <= count + 1  # at most one request that was already in flight
    assert sc.polling() == [new_ep.address]


async def test_engine_label_selects_the_mapping(servers: Servers) -> None:
    server = await new_server(servers)
    server.body = b"sglang:num_running_reqs 7\nsglang:num_queue_reqs 2\nsglang:token_usage 0.5\n"
    datastore = Datastore()
    sc = MetricsScraper(datastore, MetricsDataSource(), CoreMetricsExtractor(), interval=INTERVAL)
    await sc.start()
    try:
        ep = datastore.upsert(server.spec("pod-a", engine="sglang"))
        await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
        assert (ep.metrics.running_requests, ep.metrics.waiting_queue_size) == (7, 2)
    finally:
        await sc.stop()


async def test_unknown_engine_uses_the_default_mapping_and_warns_once(
    servers: Servers, scraper: Scraper, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="epp.datalayer")
    datastore, sc = scraper
    server = await new_server(servers)
    ep = datastore.upsert(server.spec("pod-a", engine="llamacpp"))
    stats = sc.stats(ep.address)
    assert stats is not None
    await wait_until(lambda: stats.scrapes >= 3, "several scrapes")
    assert ep.metrics.running_requests == 4 and ep.scrape_error == ""
    warned = [r.getMessage() for r in caplog.records if "unknown engine" in r.getMessage()]
    assert warned == ["endpoint pod-a: unknown engine 'llamacpp', using 'vllm' metrics"]


def test_defaults_match_the_reference_flags() -> None:
    sc = MetricsScraper(Datastore())
    assert (sc.interval, sc.timeout) == (0.05, 1.0)  # --refresh-metrics-interval, per-poll timeout
    assert (sc.source.scheme, sc.source.path, sc.extractor.default_engine) == ("http", "/metrics", "vllm")
    with pytest.raises(ValueError):
        MetricsScraper(Datastore(), interval=0)


async def test_stop_leaves_no_tasks_and_no_unclosed_session(servers: Servers) -> None:
    good = await new_server(servers)
    hang = await new_server(servers, mode="hang")
    datastore = Datastore()
    sc = MetricsScraper(datastore, interval=INTERVAL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await sc.start()
        a = datastore.upsert(good.spec("a"))
        datastore.upsert(hang.spec("b"))
        datastore.upsert(EndpointSpec("c", "127.0.0.1", free_port()))
        await wait_until(lambda: a.metrics.update_time > 0 and hang.requests > 0, "scrapes in progress")
        datastore.remove(a.address)  # one poller stopped while the others run
        clients = [w.client for w in sc._workers.values()]
        await sc.stop()
        assert all(c._protocol is None and not c.busy for c in clients)
        assert sc.polling() == [] and sc.all_stats() == {}
        assert not sc.running
        assert not [t for t in asyncio.all_tasks() if "PageClient" in repr(t.get_coro())]  # no connect left
        # a datastore change after the stop starts nothing
        datastore.upsert(good.spec("d"))
        assert sc.polling() == []
        del sc, datastore, clients
        gc.collect()
    leaks = [w for w in caught if issubclass(w.category, ResourceWarning) or "Unclosed" in str(w.message)]
    assert leaks == []


async def test_restart_after_stop(servers: Servers) -> None:
    server = await new_server(servers)
    datastore = Datastore()
    ep = datastore.upsert(server.spec("a"))
    sc = MetricsScraper(datastore, interval=INTERVAL)
    await sc.start()
    await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
    await sc.stop()
    stopped_at = ep.metrics.update_time
    await sc.start()
    try:
        await wait_until(lambda: ep.metrics.update_time > stopped_at, "scrapes after restart")
        assert sc.polling() == [ep.address]
    finally:
        await sc.stop()


# -- https --


def _self_signed(tmp: Path) -> ssl.SSLContext:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "model-server")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (tmp / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tmp / "tls.crt", tmp / "tls.key")
    return ctx


@pytest.mark.parametrize("skip_verify", [True, False])
async def test_https_with_and_without_verification(tmp_path: Path, skip_verify: bool) -> None:
    app = web.Application()

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=BUSY)

    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=_self_signed(tmp_path))
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    datastore = Datastore()
    source = MetricsDataSource(scheme="https", insecure_skip_verify=skip_verify)
    sc = MetricsScraper(datastore, source, interval=INTERVAL)
    await sc.start()
    try:
        ep = datastore.upsert(EndpointSpec("tls", "127.0.0.1", port))
        if skip_verify:
            await wait_until(lambda: ep.metrics.update_time > 0, "scrape over https")
            assert ep.metrics.running_requests == 4
        else:
            await wait_until(lambda: ep.scrape_error != "", "a certificate error")
            assert "certificate" in ep.scrape_error.lower() or "ssl" in ep.scrape_error.lower(), ep.scrape_error
    finally:
        await sc.stop()
        await runner.cleanup()


async def test_vllm_is_asked_for_the_wanted_series_only(servers: Servers, scraper: Scraper) -> None:
    """vLLM's /metrics (prometheus_client) serves only the series named by `name[]`: the scraper
    asks for the names it reads, every engine alternative included."""
    datastore, _ = scraper
    server = await new_server(servers)
    ep = datastore.upsert(server.spec("pod-a"))
    await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
    from urllib.parse import parse_qs

    asked = parse_qs(server.queries[0])["name[]"]
    mapping = BUILTIN_ENGINES["vllm"]
    assert sorted(asked) == sorted({*mapping.primary.names, *mapping.fallback.names})
    assert "vllm:inter_token_latency_seconds_count" in asked and "vllm:gpu_cache_usage_perc" in asked


async def test_a_server_that_refuses_the_series_query_is_asked_for_its_whole_page(
        servers: Servers, scraper: Scraper) -> None:
    datastore, sc = scraper
    server = await new_server(servers)
    server.mode = "no-query"
    ep = datastore.upsert(server.spec("pod-a"))
    await wait_until(lambda: ep.metrics.update_time > 0, "metrics from the whole page")
    assert server.queries[0] and server.queries[-1] == ""
    assert (m := ep.metrics).running_requests == 4 and m.cache_num_blocks == 64
    assert ep.scrape_error == ""


async def test_an_engine_without_the_series_query_asks_for_the_whole_page(servers: Servers) -> None:
    server = await new_server(servers)
    server.body = b"tgi_queue_size 2\ntgi_batch_current_size 3\n"
    datastore = Datastore()
    sc = MetricsScraper(datastore, MetricsDataSource(), CoreMetricsExtractor(default_engine="tgi"),
                        interval=INTERVAL)
    await sc.start()
    try:
        ep = datastore.upsert(server.spec("pod-a"))
        await wait_until(lambda: ep.metrics.update_time > 0, "first scrape")
        assert set(server.queries) == {""}
    finally:
        await sc.stop()


async def test_an_idle_pod_is_polled_less_often_until_the_epp_sends_it_requests(
        servers: Servers, caplog: pytest.LogCaptureFixture) -> None:
    """A pod whose page does not move backs off to `max_interval` (its stats say so; logged once);
    as soon as the EPP has a request in flight on it, it is polled at the full rate again, for as
    long as the request is there; then it backs off again (not logged again)."""
    caplog.set_level(logging.INFO, logger="epp.datalayer")
    server = await new_server(servers)
    server.body = IDLE
    datastore = Datastore()
    ep = datastore.upsert(server.spec("pod-a"))
    sc = MetricsScraper(datastore, interval=INTERVAL, max_interval=8 * INTERVAL)
    await sc.start()
    try:
        stats = sc.stats(ep.address)
        assert stats is not None
        await wait_until(lambda: stats.interval == 8 * INTERVAL, "backed off to max_interval")
        told = [r for r in caplog.records if "less often" in r.getMessage()]
        assert len(told) == 1 and "pod-a" in told[0].getMessage()
        ep.inflight_requests = 1  # what the director books at a pick
        await wait_until(lambda: stats.interval == INTERVAL, "the full rate again")
        polls = stats.scrapes
        await wait_until(lambda: stats.scrapes >= polls + 6, "polls while the request is in flight")
        assert stats.interval < 8 * INTERVAL  # never backed off far while it is there
        ep.inflight_requests = 0
        await wait_until(lambda: stats.interval == 8 * INTERVAL, "backed off again")
        assert len([r for r in caplog.records if "less often" in r.getMessage()]) == 1
        assert ep.scrape_error == "" and stats.errors == 0
    finally:
        await sc.stop()


async def test_a_backed_off_pod_that_moves_or_fails_is_polled_at_the_full_rate(servers: Servers) -> None:
    server = await new_server(servers)
    server.body = IDLE
    datastore = Datastore()
    ep = datastore.upsert(server.spec("pod-a"))
    sc = MetricsScraper(datastore, interval=INTERVAL, max_interval=8 * INTERVAL, timeout=0.5)
    await sc.start()
    try:
        stats = sc.stats(ep.address)
        assert stats is not None
        await wait_until(lambda: stats.interval == 8 * INTERVAL, "backed off")
        server.body = BUSY
        await wait_until(lambda: ep.metrics.running_requests == 4, "the new values")
        assert stats.interval == INTERVAL
        await wait_until(lambda: stats.interval == 8 * INTERVAL, "backed off on the busy page")
        server.mode = "error"
        await wait_until(lambda: ep.scrape_error.startswith("HTTP 500"), "the failure")
        assert stats.interval == INTERVAL
    finally:
        await sc.stop()
