"""Scrape every endpoint's `/metrics` into the datastore: one asyncio task per endpoint.

One task per endpoint (as the reference's one goroutine per endpoint) means a slow, hanging or
broken server only ever delays its own loop; every poll is bounded by `timeout`. All tasks share
one aiohttp session so connections are kept alive between polls (a scrape every 50 ms per pod
would otherwise be a TCP handshake every 50 ms).

On success the endpoint gets a *new* immutable `EndpointMetrics` (readers never see half an
update); on failure its old metrics stay, so they age and the staleness checks downstream see it.
A scrape with a value out of bounds (`validate`) is a failure too, and also marks the endpoint
`metrics_valid = False` until a valid scrape arrives; `ScrapeStats.invalid` counts such scrapes
per metric for the EPP's own metrics. Errors are logged once when they start, once when they
change kind and once when they clear, never per poll.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

from epp.datalayer.core_metrics_extractor import CoreMetricsExtractor
from epp.datalayer.metrics_data_source import MetricsDataSource
from epp.datalayer.promparse import LineCache, MetricsParseError
from epp.datalayer.validate import Invalid
from epp.datastore import Datastore, Endpoint

log = logging.getLogger("epp.datalayer")

# Plain text only (no protobuf/OpenMetrics negotiation), and uncompressed: decompressing ~50 KB
# twenty times a second per pod costs more CPU here than the bytes cost on a pod network.
_HEADERS = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"}
_MAX_ERROR_LEN = 200


@dataclass(slots=True)
class ScrapeStats:
    """Per-endpoint counters for the observability layer (read as plain attributes)."""

    scrapes: int = 0  # polls finished, successful or not
    errors: int = 0
    consecutive_errors: int = 0
    last_duration: float = 0.0  # seconds of wall time the last poll took
    last_success: float = 0.0  # datastore clock when metrics were last updated
    last_error: str = ""
    problems: tuple[str, ...] = ()  # metrics missing or unreadable in the last good scrape
    # metric name -> scrapes it made invalid (the names come from the engine mapping: bounded)
    invalid: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Worker:
    endpoint: Endpoint
    url: URL
    stats: ScrapeStats
    task: asyncio.Task[None] | None = None
    failing: bool = False
    failure_kind: str = ""  # what the current failure is, to log again when it changes kind
    engine: str = ""  # last engine resolved, to warn once about unknown ones
    lines: LineCache = field(default_factory=dict)


class ScrapeFailed(Exception):
    """A poll that produced no metrics; the message becomes `Endpoint.scrape_error`."""


class InvalidMetrics(ScrapeFailed):
    """A poll whose values were out of bounds: the endpoint's metrics are not trusted."""

    def __init__(self, invalid: tuple[Invalid, ...]) -> None:
        super().__init__("invalid metrics: " + "; ".join(str(i) for i in invalid))
        self.invalid = invalid


class MetricsScraper:
    """Keeps one polling task per datastore endpoint, started and stopped by datastore events.

    `interval` is `--refresh-metrics-interval`; `timeout` bounds each poll (connect, headers and
    body), so a hanging server makes its own metrics stale and nothing else.
    """

    def __init__(
        self,
        datastore: Datastore,
        source: MetricsDataSource | None = None,
        extractor: CoreMetricsExtractor | None = None,
        *,
        interval: float = 0.05,
        timeout: float = 1.0,
        max_body_bytes: int = 16 << 20,
    ) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be > 0")
        self.datastore = datastore
        self.source = source or MetricsDataSource()
        self.extractor = extractor or CoreMetricsExtractor()
        self.interval = interval
        self.timeout = timeout
        self.max_body_bytes = max_body_bytes
        self._workers: dict[str, _Worker] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._random = random.Random()

    # -- lifecycle --

    @property
    def running(self) -> bool:
        return self._session is not None

    async def start(self) -> None:
        """Open the shared session and scrape every endpoint, present and future."""
        if self._session is not None:
            return
        connector = aiohttp.TCPConnector(
            limit=0,  # one connection per endpoint; the per-endpoint loop is the limit
            ssl=not self.source.insecure_skip_verify,  # False: accept any certificate
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),  # each poll has its own deadline
            headers=_HEADERS,
        )
        self.datastore.subscribe(self._on_add, self._on_remove)

    async def stop(self) -> None:
        """Cancel every scrape task, wait for them, and close the session."""
        session, self._session = self._session, None
        self.datastore.unsubscribe(self._on_add, self._on_remove)
        tasks = [w.task for w in self._workers.values() if w.task is not None]
        tasks.extend(self._stopping)
        self._workers.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._stopping.clear()
        if session is not None:
            await session.close()
            await asyncio.sleep(0)  # let the transports' close callbacks run

    # -- introspection --

    def stats(self, address: str) -> ScrapeStats | None:
        worker = self._workers.get(address)
        return worker.stats if worker else None

    def all_stats(self) -> dict[str, ScrapeStats]:
        """By endpoint address. Safe to call from another thread (the metrics exposition's): the
        worker table is copied in one step before it is read."""
        return {address: w.stats for address, w in self._workers.copy().items()}

    def tasks(self) -> list[asyncio.Task[None]]:
        """Scrape tasks still alive, including ones cancelled but not yet finished."""
        live = [w.task for w in self._workers.values() if w.task is not None and not w.task.done()]
        return live + [t for t in self._stopping if not t.done()]

    # -- datastore listeners --

    def _on_add(self, endpoint: Endpoint) -> None:
        if self._session is None:
            return  # stopped
        old = self._workers.get(endpoint.address)
        if old is not None:
            if old.endpoint is endpoint:
                return
            self._cancel(old)
        worker = _Worker(endpoint, URL(self.source.url(endpoint.spec), encoded=True), ScrapeStats())
        worker.task = asyncio.get_running_loop().create_task(self._run(worker), name=f"scrape {endpoint.address}")
        self._workers[endpoint.address] = worker

    def _on_remove(self, endpoint: Endpoint) -> None:
        worker = self._workers.get(endpoint.address)
        if worker is not None and worker.endpoint is endpoint:
            del self._workers[endpoint.address]
            self._cancel(worker)

    def _cancel(self, worker: _Worker) -> None:
        task = worker.task
        if task is not None and not task.done():
            task.cancel()
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    # -- the loop --

    async def _run(self, worker: _Worker) -> None:
        loop = asyncio.get_running_loop()
        # Spread first polls over one interval so a relist does not scrape every pod in lockstep.
        await asyncio.sleep(self._random.random() * self.interval)
        next_at = loop.time()
        while True:
            await self._poll(worker)
            next_at += self.interval
            now = loop.time()
            if next_at < now:
                next_at = now  # a slow poll: carry on at the normal rate, no burst to catch up
            await asyncio.sleep(next_at - now)

    async def _poll(self, worker: _Worker) -> None:
        """One scrape of one endpoint; never raises except on cancellation."""
        endpoint, stats = worker.endpoint, worker.stats
        started = time.perf_counter()
        try:
            body = await self._fetch(worker.url)
            self._check_engine(worker)
            result = self.extractor.extract(endpoint, body, self.datastore.clock(), worker.lines)
            if result.invalid:
                raise InvalidMetrics(result.invalid)
            if result.metrics is None:
                raise ScrapeFailed("no metrics found: " + "; ".join(result.problems))
        except asyncio.CancelledError:
            raise
        except InvalidMetrics as exc:
            for item in exc.invalid:
                stats.invalid[item.metric] = stats.invalid.get(item.metric, 0) + 1
            endpoint.metrics_valid = False
            self._failed(worker, _describe(exc, self.timeout), exc)
        except Exception as exc:  # any failure is this endpoint's problem only
            self._failed(worker, _describe(exc, self.timeout), exc)
        else:
            endpoint.update_metrics(result.metrics)
            stats.last_success = result.metrics.update_time
            if result.problems != stats.problems:
                if result.problems:
                    log.warning("scraping %s (%s): some metrics unavailable: %s",
                                endpoint.name, worker.url, "; ".join(result.problems))
                stats.problems = result.problems
            if worker.failing:
                log.info("scraping %s (%s) recovered after %d failed polls",
                         endpoint.name, worker.url, stats.consecutive_errors)
                worker.failing = False
                worker.failure_kind = ""
            stats.consecutive_errors = 0
            endpoint.scrape_error = ""
        finally:
            stats.scrapes += 1
            stats.last_duration = time.perf_counter() - started

    async def _fetch(self, url: URL) -> bytes:
        session = self._session
        if session is None:
            raise ScrapeFailed("scraper stopped")
        async with asyncio.timeout(self.timeout):
            async with session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    raise ScrapeFailed(f"HTTP {resp.status} {resp.reason or ''}".rstrip())
                return await self._read(resp)

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes:
        """The body, refusing anything over `max_body_bytes` before it is all in memory."""
        limit = self.max_body_bytes
        length = resp.content_length
        if length is not None:
            if length > limit:
                raise ScrapeFailed(f"response too large ({length} bytes > {limit})")
            return await resp.read()
        chunks: list[bytes] = []
        total = 0
        async for chunk in resp.content.iter_any():
            total += len(chunk)
            if total > limit:
                raise ScrapeFailed(f"response too large (> {limit} bytes)")
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_engine(self, worker: _Worker) -> None:
        engine = self.extractor.engine_of(worker.endpoint)
        if engine != worker.engine:
            worker.engine = engine
            if engine not in self.extractor.engines:
                log.warning("endpoint %s: unknown engine %r, using %r metrics",
                            worker.endpoint.name, engine, self.extractor.default_engine)
            caveat = self.extractor.mapping_for(engine).caveat
            if caveat:
                log.info("endpoint %s: engine %r: %s", worker.endpoint.name, engine, caveat)

    def _failed(self, worker: _Worker, message: str, exc: BaseException) -> None:
        stats = worker.stats
        stats.errors += 1
        stats.consecutive_errors += 1
        stats.last_error = message
        worker.endpoint.scrape_error = message
        kind = _kind(exc)
        if not worker.failing or kind != worker.failure_kind:
            worker.failing = True
            worker.failure_kind = kind
            unexpected = not isinstance(exc, (ScrapeFailed, MetricsParseError, aiohttp.ClientError, TimeoutError))
            log.warning("scraping %s (%s) failing: %s", worker.endpoint.name, worker.url, message,
                        exc_info=exc if unexpected else None)


def _kind(exc: BaseException) -> str:
    """A failure's kind, for logging: invalid values name their metrics, others their class."""
    if isinstance(exc, InvalidMetrics):
        return "invalid:" + ",".join(sorted({i.metric for i in exc.invalid}))
    return type(exc).__name__


def _describe(exc: BaseException, timeout: float) -> str:
    """A short, stable message for `Endpoint.scrape_error` (no tracebacks, no addresses twice)."""
    if isinstance(exc, TimeoutError):
        text = f"timed out after {timeout:g}s"
    elif isinstance(exc, aiohttp.ClientConnectorError):
        text = f"cannot connect: {exc.os_error.strerror or exc.os_error}"
    elif isinstance(exc, MetricsParseError):
        text = f"bad metrics: {exc}"
    elif isinstance(exc, ScrapeFailed):
        text = str(exc)
    elif isinstance(exc, aiohttp.ClientError):
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    else:
        text = f"internal error: {type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR_LEN else text[:_MAX_ERROR_LEN - 1] + "…"
