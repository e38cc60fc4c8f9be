"""Scrape every endpoint's `/metrics` into the datastore: one poller per endpoint.

One poller per endpoint (as the reference's one goroutine per endpoint) means a slow, hanging
or broken server only ever delays its own polls; every poll is bounded by `timeout`. Each endpoint
keeps one HTTP/1.1 connection alive between polls (`http_client`: a scrape every 50 ms per pod
would otherwise be a TCP handshake every 50 ms) and a `PageMemory` of its last page, so a poll
parses only the lines that changed. Where the engine's exporter filters by name (vLLM's:
`EngineMapping.names_query`) a poll asks for the series it reads only, a page twenty times
smaller; a server that refuses such a request is asked for its whole page from then on. The
pollers share one timer (`wheel.TimerWheel`) for their polls and their timeouts.

On success the endpoint gets a *new* immutable `EndpointMetrics` (readers never see half an
update); on failure its old metrics stay, so they age and the staleness checks downstream see it.
A scrape with a value out of bounds (`validate`) is a failure too, and also marks the endpoint
`metrics_valid = False` until a valid scrape arrives; `ScrapeStats.invalid` counts such scrapes
per metric for the EPP's own metrics. Errors are logged once when they start, once when they
change kind and once when they clear, never per poll.

Back-off: an endpoint whose signals (every field but the scrape time) came back the same for
`QUIET_POLLS` polls in a row (an idle pod) is polled half as often, and so on up to
`max_interval`; the first poll that sees a change (or fails) returns it to `interval`, and so
does traffic: as soon as the EPP has requests in flight on it (the request path's endpoint, or
what `traffic` reports: the scraper process's readers mark it on the board), it is polled at
once and at the full rate again, since a pod that just got requests is one whose metrics
routing needs fresh. Its metrics age up to `max_interval` between polls while backed off, which
`ScrapeStats.interval` (and so the EPP's own `inference_pool_endpoint_scrape_interval_seconds`)
shows next to `inference_pool_endpoint_metrics_age_seconds`; the first back-off of each endpoint
is logged.

This runs on whatever loop starts it: the request path's in-process mode (tests, the
simulator's live pods), or the scraper process (`scrape_process`), which publishes each poll
through shared memory (`on_polled`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial

from epp.datalayer.core_metrics_extractor import CoreMetricsExtractor
from epp.datalayer.http_client import FetchFailed, PageClient, client_ssl_context
from epp.datalayer.metrics_data_source import MetricsDataSource
from epp.datalayer.promparse import MetricsParseError, PageMemory
from epp.datalayer.validate import Invalid
from epp.datalayer.wheel import TimerWheel
from epp.datastore import Datastore, Endpoint, EndpointMetrics

log = logging.getLogger("epp.datalayer")

MAX_ERROR_LEN = 200
# A pod whose page flips between good and bad (or between kinds of bad) at every poll would log a
# line per poll: at most this many of its transitions are logged per window, then one line with
# how many were not (its stats count them all).
TRANSITION_LOGS, TRANSITION_WINDOW = 4, 30.0
QUIET_POLLS = 3  # polls with unchanged signals before an endpoint's interval doubles

PollHook = Callable[[Endpoint, "ScrapeStats"], None]
Traffic = Callable[[], Iterable[str]]  # addresses the EPP sent requests to since the last call


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
    interval: float = 0.0  # seconds until the next poll: the base interval, or more while backed off


@dataclass(slots=True, eq=False)
class _Worker:
    """One endpoint's polling: a deadline on the scraper's timer wheel, a GET in flight (with its
    timeout on the wheel too), then the next deadline (callbacks on the loop, no task and no
    timer of its own: at 2,000 polls a second those would cost more than the poll itself)."""

    endpoint: Endpoint
    client: PageClient
    stats: ScrapeStats
    scheduled: bool = False  # the next poll is on the wheel
    due: int = 0  # which of its wheel entries is that poll (an earlier one supersedes it: `hurry`)
    polls: int = 0  # polls started: the one a timeout on the wheel is for
    done: Callable[[bytes | None, BaseException | None], None] | None = None  # the GET's callback
    next_at: float = 0.0  # loop time the current or next poll is due
    started: float = 0.0  # perf_counter at the start of the poll in flight
    asked_at: float = 0.0  # the datastore's clock then (`Endpoint.metrics_asked`)
    stopped: bool = False
    failing: bool = False
    failure_kind: str = ""  # what the current failure is, to log again when it changes kind
    engine: str = ""  # last engine resolved, to warn once about unknown ones
    memory: PageMemory = field(default_factory=PageMemory)
    quiet: int = 0  # successful polls in a row whose signals did not move
    backed_off_once: bool = False  # its first back-off was logged
    whole_page: bool = False  # the server refused a request for some series only: ask for all
    logs_since: float = -TRANSITION_WINDOW  # monotonic start of the window its transition logs count in
    logs_in_window: int = 0
    unlogged: int = 0  # transitions not logged in the window

    def may_log(self) -> bool:
        """Whether this transition is logged (`TRANSITION_LOGS` per window; the first line of a new
        window says how many were not)."""
        now = time.monotonic()
        if now - self.logs_since >= TRANSITION_WINDOW:
            if self.unlogged:
                log.warning("scraping %s (%s): %d more changes between failing and recovered in %.0f s, not "
                            "logged one by one", self.endpoint.name, self.url, self.unlogged, TRANSITION_WINDOW)
            self.logs_since, self.logs_in_window, self.unlogged = now, 0, 0
        if self.logs_in_window < TRANSITION_LOGS:
            self.logs_in_window += 1
            return True
        self.unlogged += 1
        return False

    @property
    def url(self) -> str:
        return self.client.target.url

    @property
    def polling(self) -> bool:
        """A poll is due or in flight (False once stopped)."""
        return not self.stopped and (self.scheduled or self.client.busy)


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
    body), so a hanging server makes its own metrics stale and nothing else. `max_interval`
    (default: `interval`, no back-off) is the longest an endpoint whose signals do not move
    waits between polls. `on_polled` runs after every poll with the endpoint and its stats;
    `traffic`, every `interval / 5` while an endpoint is backed off, says which got requests.
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
        max_interval: float | None = None,
        on_polled: PollHook | None = None,
        quantum: float = 0.0,
        traffic: Traffic | None = None,
    ) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be > 0")
        self.datastore = datastore
        self.source = source or MetricsDataSource()
        self.extractor = extractor or CoreMetricsExtractor()
        self.interval = interval
        self.max_interval = max(interval, max_interval if max_interval is not None else interval)
        self.timeout = timeout
        self.max_body_bytes = max_body_bytes
        self.on_polled = on_polled
        self.quantum = quantum
        self.traffic = traffic
        self._workers: dict[str, _Worker] = {}
        self._backed_off: set[_Worker] = set()  # polled less often than `interval`
        self._traffic_timer: asyncio.TimerHandle | None = None
        # Every poll and every poll's timeout: (worker, -n) its n-th scheduled poll, (worker, n) poll n's timeout.
        self._wheel: TimerWheel[tuple[_Worker, int]] = TimerWheel(quantum, self._due)
        self._connecting: set[asyncio.Task[None]] = set()  # connection attempts cancelled by a stop
        self._running = False
        self._ssl = client_ssl_context(verify=not self.source.insecure_skip_verify) \
            if self.source.scheme == "https" else None
        self._random = random.Random()

    # -- lifecycle --

    @property
    def running(self) -> bool:
        return self._running

    async def start(self) -> None:
        """Scrape every endpoint, present and future."""
        if self._running:
            return
        self._running = True
        self.datastore.subscribe(self._on_add, self._on_remove)

    async def stop(self) -> None:
        """Stop every endpoint's polling and close its connection."""
        self._running = False
        self.datastore.unsubscribe(self._on_add, self._on_remove)
        workers = list(self._workers.values())
        self._workers.clear()
        self._wheel.clear()
        self._backed_off.clear()
        if self._traffic_timer is not None:
            self._traffic_timer.cancel()
            self._traffic_timer = None
        for worker in workers:
            self._stop(worker)
        pending = [t for t in self._connecting if not t.done()]
        self._connecting.clear()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.sleep(0)  # let the transports' close callbacks run

    # -- introspection --

    def stats(self, address: str) -> ScrapeStats | None:
        worker = self._workers.get(address)
        return worker.stats if worker else None

    def all_stats(self) -> dict[str, ScrapeStats]:
        """By endpoint address. Safe to call from another thread (the metrics exposition's): the
        worker table is copied in one step before it is read."""
        return {address: w.stats for address, w in self._workers.copy().items()}

    def polling(self) -> list[str]:
        """Addresses of the endpoints being polled (a poll due or in flight)."""
        return [address for address, w in self._workers.items() if w.polling]

    # -- datastore listeners --

    def _on_add(self, endpoint: Endpoint) -> None:
        if not self._running:
            return  # stopped
        old = self._workers.get(endpoint.address)
        if old is not None:
            if old.endpoint is endpoint:
                return
            self._stop(old)
        query = self.extractor.mapping_for(self.extractor.engine_of(endpoint)).query
        client = PageClient(self.source.target(endpoint.spec, query), timeout=self.timeout,
                            max_body=self.max_body_bytes, ssl_context=self._ssl, timed=False)  # timeouts: the wheel
        worker = _Worker(endpoint, client, ScrapeStats(interval=self.interval))
        worker.done = partial(self._polled, worker)
        self._workers[endpoint.address] = worker
        # Spread first polls over one interval so a relist does not scrape every pod in lockstep.
        loop = asyncio.get_running_loop()
        self._schedule(worker, loop, loop.time() + self._random.random() * self.interval)

    def _on_remove(self, endpoint: Endpoint) -> None:
        worker = self._workers.get(endpoint.address)
        if worker is not None and worker.endpoint is endpoint:
            del self._workers[endpoint.address]
            self._stop(worker)

    def _stop(self, worker: _Worker) -> None:
        worker.stopped = True  # what it has on the wheel is ignored when it comes up
        worker.scheduled = False
        self._backed_off.discard(worker)
        connecting = worker.client.close()
        if connecting is not None:
            self._connecting.add(connecting)
            connecting.add_done_callback(self._connecting.discard)

    # -- the loop --

    def _schedule(self, worker: _Worker, loop: asyncio.AbstractEventLoop, at: float) -> None:
        """The next poll at `at`, rounded up to the `quantum` grid: the polls due in one step
        start in one turn of the loop and their answers come back together, far fewer wake-ups
        than polls spread evenly."""
        worker.due += 1
        worker.next_at = self._wheel.add(at, (worker, -worker.due))
        worker.scheduled = True

    def _due(self, entry: tuple[_Worker, int]) -> None:
        """From the wheel: a poll is due (-n: the worker's n-th scheduled one), or poll n's time is up."""
        worker, poll = entry
        if worker.stopped:
            return
        if poll > 0:
            if worker.polls == poll and worker.client.busy:
                worker.client.expire()
            return
        if -poll != worker.due or not worker.scheduled:
            return  # superseded by an earlier poll
        worker.scheduled = False
        worker.polls += 1
        worker.started = time.perf_counter()
        worker.asked_at = self.datastore.clock()
        worker.client.get(worker.done)  # type: ignore[arg-type]
        self._wheel.add(asyncio.get_running_loop().time() + self.timeout, (worker, worker.polls))

    def _polled(self, worker: _Worker, body: bytes | None, error: BaseException | None) -> None:
        """A poll's page (or failure) is in: read it, then schedule the next one."""
        if worker.stopped:
            return
        self._read(worker, body, error)
        loop = asyncio.get_running_loop()
        at = worker.next_at + worker.stats.interval
        now = loop.time()
        if at < now:
            at = now  # a slow poll: carry on at the normal rate, no burst to catch up
        self._schedule(worker, loop, at)

    def _read(self, worker: _Worker, body: bytes | None, error: BaseException | None) -> None:
        """One poll's outcome into the endpoint and its stats; never raises."""
        endpoint, stats = worker.endpoint, worker.stats
        try:
            if error is not None:
                raise error
            assert body is not None
            self._check_engine(worker)
            result = self.extractor.extract(endpoint, body, self.datastore.clock(), worker.memory)
            if result.invalid:
                raise InvalidMetrics(result.invalid)
            if result.metrics is None:
                raise ScrapeFailed("no metrics found: " + "; ".join(result.problems))
        except InvalidMetrics as exc:
            for item in exc.invalid:
                stats.invalid[item.metric] = stats.invalid.get(item.metric, 0) + 1
            endpoint.metrics_valid = False
            self._failed(worker, _describe(exc, self.timeout), exc)
        except Exception as exc:  # any failure is this endpoint's problem only
            if isinstance(exc, FetchFailed) and worker.client.target.query and str(exc).startswith("HTTP 4"):
                self._ask_whole_page(worker, str(exc))
            self._failed(worker, _describe(exc, self.timeout), exc)
        else:
            self._back_off(worker, endpoint.metrics, result.metrics)
            # (with when it was asked for: the ledger's requests that ended in between are still on it)
            endpoint.update_metrics(result.metrics, worker.asked_at)
            stats.last_success = result.metrics.update_time
            if result.problems != stats.problems:
                if result.problems and worker.may_log():
                    log.warning("scraping %s (%s): some metrics unavailable: %s",
                                endpoint.name, worker.url, "; ".join(result.problems))
                stats.problems = result.problems
            if worker.failing:
                if worker.may_log():
                    log.info("scraping %s (%s) recovered after %d failed polls",
                             endpoint.name, worker.url, stats.consecutive_errors)
                worker.failing = False
                worker.failure_kind = ""
            stats.consecutive_errors = 0
            endpoint.scrape_error = ""
        stats.scrapes += 1
        stats.last_duration = time.perf_counter() - worker.started
        if self.on_polled is not None:
            try:
                self.on_polled(endpoint, stats)
            except Exception:
                log.exception("publishing the scrape of %s failed", endpoint.name)

    def _back_off(self, worker: _Worker, old: EndpointMetrics, new: EndpointMetrics) -> None:
        """Double the interval of an endpoint whose signals stayed put for `QUIET_POLLS` polls."""
        stats = worker.stats
        if _moved(old, new):
            worker.quiet = 0
            self._full_rate(worker)
            return
        worker.quiet += 1
        if worker.quiet >= QUIET_POLLS and stats.interval < self.max_interval:
            stats.interval = min(self.max_interval, stats.interval * 2)
            worker.quiet = 0
            self._backed_off.add(worker)
            if self._traffic_timer is None:
                self._traffic_timer = asyncio.get_running_loop().call_later(self.interval / 5, self._check_traffic)
            if not worker.backed_off_once:
                worker.backed_off_once = True
                log.info("scraping %s (%s) less often: its metrics did not move for %d polls; every %.0f ms, "
                         "up to %.0f ms, until they move, a poll fails or the EPP sends it requests (its "
                         "metrics age shows it; logged once per endpoint)", worker.endpoint.name, worker.url,
                         QUIET_POLLS, stats.interval * 1e3, self.max_interval * 1e3)

    def _full_rate(self, worker: _Worker) -> None:
        worker.stats.interval = self.interval
        self._backed_off.discard(worker)

    def hurry(self, address: str) -> bool:
        """The EPP sent requests to this endpoint: if it is backed off, poll it now, and at the
        full rate from then on (until its metrics stay put again). True if it was backed off."""
        worker = self._workers.get(address)
        if worker is None or worker.stopped or worker not in self._backed_off:
            return False
        self._full_rate(worker)
        worker.quiet = 0
        log.debug("scraping %s at the full rate again: the EPP sent it requests", worker.endpoint.name)
        if worker.scheduled:  # now, off the grid (a poll in flight schedules the next one at the full rate)
            worker.due += 1  # what it has on the wheel is superseded
            worker.next_at = asyncio.get_running_loop().time()
            self._due((worker, -worker.due))
        return True

    def _check_traffic(self) -> None:
        """While endpoints are backed off: the ones the EPP has requests on, polled at once."""
        self._traffic_timer = None
        if not self._running:
            return
        try:
            for worker in [w for w in self._backed_off if w.endpoint.inflight_requests > 0]:
                self.hurry(worker.endpoint.address)
            if self.traffic is not None:
                for address in self.traffic():
                    self.hurry(address)
        except Exception:  # a failing hook must not stop the checks
            log.exception("checking the traffic of backed-off endpoints failed")
        if self._backed_off:
            self._traffic_timer = asyncio.get_running_loop().call_later(self.interval / 5, self._check_traffic)

    def _check_engine(self, worker: _Worker) -> None:
        engine = self.extractor.engine_of(worker.endpoint)
        if engine != worker.engine:
            worker.engine = engine
            if engine not in self.extractor.engines:
                log.warning("endpoint %s: unknown engine %r, using %r metrics",
                            worker.endpoint.name, engine, self.extractor.default_engine)
            mapping = self.extractor.mapping_for(engine)
            if mapping.caveat:
                log.info("endpoint %s: engine %r: %s", worker.endpoint.name, engine, mapping.caveat)
            query = "" if worker.whole_page else mapping.query
            if query != worker.client.target.query:  # the next poll asks for this engine's series
                worker.client.retarget(self.source.target(worker.endpoint.spec, query))

    def _ask_whole_page(self, worker: _Worker, why: str) -> None:
        """The server does not take `?name[]=`: its whole page from now on."""
        worker.whole_page = True
        worker.client.retarget(self.source.target(worker.endpoint.spec))
        log.warning("scraping %s (%s): the server refused a request for the wanted series only (%s); "
                    "asking for its whole page from now on", worker.endpoint.name, worker.url, why)

    def _failed(self, worker: _Worker, message: str, exc: BaseException) -> None:
        stats = worker.stats
        stats.errors += 1
        stats.consecutive_errors += 1
        stats.last_error = message
        self._full_rate(worker)
        worker.quiet = 0
        worker.endpoint.scrape_error = message
        kind = _kind(exc)
        if not worker.failing or kind != worker.failure_kind:
            worker.failing = True
            worker.failure_kind = kind
            unexpected = not isinstance(exc, (ScrapeFailed, MetricsParseError, FetchFailed, TimeoutError))
            if worker.may_log():
                log.warning("scraping %s (%s) failing: %s", worker.endpoint.name, worker.url, message,
                            exc_info=exc if unexpected else None)


def _moved(old: EndpointMetrics, new: EndpointMetrics) -> bool:
    """Whether any signal differs (the scrape time aside; the ITL counters count: tokens flowed)."""
    return (old.waiting_queue_size != new.waiting_queue_size or old.running_requests != new.running_requests
            or old.kv_cache_usage != new.kv_cache_usage or old.inter_token_latency != new.inter_token_latency
            or old.itl_count != new.itl_count or old.itl_sum != new.itl_sum or old.models != new.models
            or old.active_models != new.active_models or old.waiting_models != new.waiting_models
            or old.max_active_models != new.max_active_models or old.cache_block_size != new.cache_block_size
            or old.cache_num_blocks != new.cache_num_blocks or old.update_time == 0.0)


def _kind(exc: BaseException) -> str:
    """A failure's kind, for logging: invalid values name their metrics, fetch failures their
    cause (the first words of the message: "HTTP 500", "cannot connect", ...), others their class."""
    if isinstance(exc, InvalidMetrics):
        return "invalid:" + ",".join(sorted({i.metric for i in exc.invalid}))
    if isinstance(exc, FetchFailed):
        return "fetch:" + " ".join(str(exc).split()[:2])
    return type(exc).__name__


def _describe(exc: BaseException, timeout: float) -> str:
    """A short, stable message for `Endpoint.scrape_error` (no tracebacks, no addresses twice)."""
    if isinstance(exc, TimeoutError):
        text = f"timed out after {timeout:g}s"
    elif isinstance(exc, MetricsParseError):
        text = f"bad metrics: {exc}"
    elif isinstance(exc, (ScrapeFailed, FetchFailed)):
        text = str(exc)
    else:
        text = f"internal error: {type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_LEN else text[:MAX_ERROR_LEN - 1] + "…"
