"""Scraping off the request path: a scraper process, and the metrics board it fills.

`ScraperProcess` (in the EPP's main process) starts a child process that runs the ordinary
`MetricsScraper` on its own event loop and publishes every poll to a `MetricsBoard` in shared
memory. The main process keeps what it had: discovery writes the datastore, whose add/remove
events are sent to the child over a pipe (with the endpoint's current metrics, so a restarted
child carries on from them); `sync` copies whatever slots changed into the datastore's
`Endpoint`s (`update_metrics`, `metrics_valid`, `scrape_error`), so every reader of the
datastore — scheduling, flow control, the simulator's code — is unchanged. `sync` also marks on
the board the backed-off endpoints the EPP now has requests in flight on (`TrafficWatch`): the
child polls them at once and at the full rate again. `sync` runs when the
child says the board changed (a byte down a second pipe, at most one every 2 ms: the answers of
one step of the child's poll grid arrive together), before each pick (the ext_proc layer calls
it), and on a slow timer that also watches the child; when nothing changed it costs one
comparison of the slots' version words.

What the in-loop scraper did stays as it was, in the child: validation, staleness (the scrape
time comes from the same monotonic clock, which every process on the machine shares), the ITL
window, per-endpoint `ScrapeStats` (read from the board when the EPP's own metrics are
scraped), errors logged once, back-off of pods whose signals do not move.

The child is supervised: if it dies, the endpoints' metrics age (the staleness checks see it),
an error is logged, and a new child starts after a pause (1 s, doubling to 30 s) with every
endpoint. It exits by itself when the main process goes (its pipe closes). It is a fresh interpreter
(`python -m epp.datalayer.scrape_process`), never a fork of a process that runs gRPC threads,
and needs nothing of the main module (unlike `multiprocessing`'s spawn, which re-imports it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from epp.datalayer.board import MetricsBoard, TrafficWatch
from epp.datalayer.core_metrics_extractor import CoreMetricsExtractor
from epp.datalayer.engines import EngineMapping
from epp.datalayer.metrics_data_source import MetricsDataSource
from epp.datalayer.scraper import MetricsScraper, ScrapeStats
from epp.datastore import Datastore, Endpoint, EndpointMetrics, EndpointSpec

log = logging.getLogger("epp.datalayer")

_RESTART_FIRST = 1.0
_RESTART_MAX = 30.0
_STOP_GRACE = 5.0


@dataclass(slots=True, frozen=True)
class ScrapeSettings:
    """Everything the child needs to scrape as the main process would (picklable)."""

    scheme: str = "http"
    path: str = "/metrics"
    insecure_skip_verify: bool = True
    default_engine: str = "vllm"
    engine_label_key: str = ""
    engines: tuple[EngineMapping, ...] = ()
    interval: float = 0.05
    max_interval: float = 0.05
    timeout: float = 1.0
    max_body_bytes: int = 16 << 20
    quantum: float = 0.0
    log_level: int = 2

    @classmethod
    def of(cls, source: MetricsDataSource, extractor: CoreMetricsExtractor, **kwargs: object) -> ScrapeSettings:
        return cls(scheme=source.scheme, path=source.path, insecure_skip_verify=source.insecure_skip_verify,
                   default_engine=extractor.default_engine, engine_label_key=extractor.engine_label_key,
                   engines=tuple(extractor.engines.values()), **kwargs)  # type: ignore[arg-type]

    def scraper(self, datastore: Datastore, on_polled: object, traffic: object = None) -> MetricsScraper:
        source = MetricsDataSource(scheme=self.scheme, path=self.path, insecure_skip_verify=self.insecure_skip_verify)
        extractor = CoreMetricsExtractor(default_engine=self.default_engine, engine_label_key=self.engine_label_key,
                                         engines={m.name: m for m in self.engines})
        return MetricsScraper(datastore, source, extractor, interval=self.interval, timeout=self.timeout,
                              max_body_bytes=self.max_body_bytes, max_interval=self.max_interval,
                              quantum=self.quantum, on_polled=on_polled, traffic=traffic)  # type: ignore[arg-type]


@dataclass(slots=True, eq=False)
class _Owner:
    token: int
    endpoint: Endpoint


class ScraperProcess:
    """The main process's side: the child, the board, and the copy of the board into the
    datastore. Same introspection as `MetricsScraper` (`running`, `stats`, `all_stats`)."""

    def __init__(self, datastore: Datastore, source: MetricsDataSource | None = None,
                 extractor: CoreMetricsExtractor | None = None, *, interval: float = 0.05, timeout: float = 1.0,
                 max_body_bytes: int = 16 << 20, max_interval: float | None = None, quantum: float | None = None,
                 slots: int = 1024, sync_interval: float | None = None, log_level: int = 2) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be > 0")
        if datastore.clock is not time.monotonic:
            raise ValueError("the scraper process needs the datastore on time.monotonic (the clock it stamps with)")
        self.datastore = datastore
        # The child's poll grid (`quantum`): the polls due in one step start in one turn of its
        # loop and their answers come back together, one wake-up and one note for many pods. Half
        # an interval makes two cohorts, each polled every interval (the metrics' age is that of
        # a finer grid); at 100 pods it costs about a fifth less CPU than a fifth of an interval.
        self.settings = ScrapeSettings.of(
            source or MetricsDataSource(), extractor or CoreMetricsExtractor(), interval=interval,
            max_interval=max(interval, max_interval or interval), timeout=timeout, max_body_bytes=max_body_bytes,
            quantum=interval / 2 if quantum is None else quantum, log_level=log_level)
        self.interval = interval
        # The board is copied into the datastore when the child says it changed (within about 2
        # milliseconds of a publish: what this adds to the metrics' age) and before every pick;
        # this timer only backs those up (and watches the child).
        self.sync_interval = sync_interval if sync_interval is not None else max(0.05, interval)
        self.slots = slots
        self.board: MetricsBoard | None = None
        self.restarts = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._pipe: Connection | None = None
        self._notes = -1  # the read end of the child's "board changed" pipe
        self._owners: dict[int, _Owner] = {}
        self._by_address: dict[str, int] = {}
        self._free: list[int] = []
        self._high = 0  # slots [0, _high) have been used
        self._seen: list[int] = []
        self._watch = TrafficWatch()
        self._tokens = 0
        self._timer: asyncio.TimerHandle | None = None
        self._restart_timer: asyncio.TimerHandle | None = None
        self._restart_delay = _RESTART_FIRST
        self._running = False

    # -- lifecycle --

    @property
    def running(self) -> bool:
        return self._running

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self.board = MetricsBoard.create(self.slots, self.interval)
        self._spawn()
        self.datastore.subscribe(self._on_add, self._on_remove)
        await self._first_round()
        self._timer = asyncio.get_running_loop().call_later(self.sync_interval, self._tick)

    async def _first_round(self) -> None:
        """Wait (bounded) until every endpoint known now was polled once, so the EPP starts with
        metrics as the in-loop scraper did (its first polls land within one interval)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.timeout + 2 * self.interval + 5.0  # the child's start too
        while loop.time() < deadline and self._process is not None and self._process.poll() is None:
            if len(self.all_stats()) >= len(self._owners):
                break
            await asyncio.sleep(0.01)
        self.sync()

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        self.datastore.unsubscribe(self._on_add, self._on_remove)
        for timer in (self._timer, self._restart_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._restart_timer = None
        await self._end_child()
        self._owners.clear()
        self._by_address.clear()
        self._free.clear()
        self._high = 0
        self._seen = []
        self._watch = TrafficWatch()
        if self.board is not None:
            self.board.close()
            self.board = None

    def _spawn(self) -> None:
        assert self.board is not None
        read_fd, write_fd = os.pipe()
        notes, note_fd = os.pipe()
        os.set_blocking(notes, False)
        os.set_blocking(note_fd, False)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "epp.datalayer.scrape_process", str(read_fd), str(note_fd)],
                pass_fds=(read_fd, note_fd), stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            os.close(notes)
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
            os.close(note_fd)
        pipe = Connection(write_fd, readable=False)
        self._process, self._pipe = process, pipe
        self._notes = notes
        asyncio.get_running_loop().add_reader(notes, self._on_note)
        self._send(("start", self.settings, self.board.name))
        log.info("scraper process started", extra={"pid": process.pid, "board": self.board.name,
                                                   "endpoints": len(self._owners)})
        for slot, owner in self._owners.items():
            self._send_add(slot, owner)

    async def _end_child(self) -> None:
        process, pipe = self._process, self._pipe
        self._process = self._pipe = None
        self._close_notes()
        if process is None:
            return
        if pipe is not None:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
            pipe.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _STOP_GRACE
        while process.poll() is None and loop.time() < deadline:
            await asyncio.sleep(0.01)
        if process.poll() is None:
            log.warning("scraper process did not stop in time; killing it", extra={"pid": process.pid})
            process.kill()
            await asyncio.to_thread(process.wait, 5.0)

    def _check_child(self) -> None:
        """The child ended without being asked: restart it after a pause."""
        process = self._process
        if process is None or process.poll() is None:
            return
        loop = asyncio.get_running_loop()
        code = process.returncode
        # A SIGINT or SIGTERM is most often the whole process group's (Ctrl-C in a terminal, an
        # init that signals the group): the EPP itself is stopping and will not restart it.
        report = log.warning if code in (-signal.SIGINT, -signal.SIGTERM) else log.error
        report("scraper process exited unexpectedly (code %s); endpoints' metrics age until it is back, "
               "restart in %.0f s (unless the EPP is stopping)", code, self._restart_delay, extra={"pid": process.pid})
        if self._pipe is not None:
            self._pipe.close()
        self._process = self._pipe = None
        self._close_notes()
        self._restart_timer = loop.call_later(self._restart_delay, self._restart)
        self._restart_delay = min(_RESTART_MAX, self._restart_delay * 2)

    def _restart(self) -> None:
        self._restart_timer = None
        if self._running and self._process is None:
            self.restarts += 1
            self._spawn()

    # -- endpoints --

    def _on_add(self, endpoint: Endpoint) -> None:
        if not self._running:
            return
        slot = self._by_address.get(endpoint.address)
        if slot is not None:
            if self._owners[slot].endpoint is endpoint:
                return
            self._release(slot)
        if not self._free and self._high >= self.slots:
            log.error("metrics board full (%d endpoints): %s is not scraped; restart with more slots",
                      self.slots, endpoint.name)
            return
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._high
            self._high += 1
            self._seen.append(self.board.versions(self._high)[slot] if self.board else 0)
        self._tokens += 1
        owner = self._owners[slot] = _Owner(self._tokens, endpoint)
        self._by_address[endpoint.address] = slot
        self._send_add(slot, owner)

    def _on_remove(self, endpoint: Endpoint) -> None:
        slot = self._by_address.get(endpoint.address)
        if slot is not None and self._owners[slot].endpoint is endpoint:
            self._release(slot)

    def _release(self, slot: int) -> None:
        owner = self._owners.pop(slot)
        del self._by_address[owner.endpoint.address]
        self._watch.forget(slot)
        self._free.append(slot)
        self._send(("remove", slot, owner.token, owner.endpoint.address))

    def _send_add(self, slot: int, owner: _Owner) -> None:
        ep = owner.endpoint
        self._send(("add", slot, owner.token, ep.spec, ep.metrics, ep.metrics_valid, ep.scrape_error))

    def _send(self, message: tuple[object, ...]) -> None:
        if self._pipe is None:
            return  # the child is being restarted; it gets every endpoint when it starts
        try:
            self._pipe.send(message)
        except OSError:
            pass  # the child is gone; the next tick restarts it with the current endpoints

    # -- the board into the datastore --

    def _on_note(self) -> None:
        """The child published: copy the board now."""
        try:
            if not os.read(self._notes, 4096):
                self._close_notes()  # the child is gone: the timer sees it
                return
        except BlockingIOError:
            return
        except OSError:
            self._close_notes()
            return
        self.sync()

    def _close_notes(self) -> None:
        if self._notes >= 0:
            asyncio.get_running_loop().remove_reader(self._notes)
            os.close(self._notes)
            self._notes = -1

    def _tick(self) -> None:
        self._timer = None
        if not self._running:
            return
        try:
            self.sync()
            self._check_child()
        finally:
            self._timer = asyncio.get_running_loop().call_later(self.sync_interval, self._tick)

    def sync(self) -> int:
        """Copy every slot that changed since the last call into its endpoint; returns how many.
        Cheap when nothing changed (one read of the version words and one list comparison)."""
        board = self.board
        if board is None or not self._high:
            return 0
        self._watch.check(board)
        versions = board.versions(self._high)
        seen = self._seen
        if versions == seen:
            return 0
        applied = 0
        owners = self._owners
        for slot in [i for i, (now, before) in enumerate(zip(versions, seen)) if now != before]:
            owner = owners.get(slot)
            if owner is None:
                seen[slot] = versions[slot]
                continue
            state = board.read_state(slot)
            if state is None:
                continue  # being written: the next sync gets it
            seen[slot] = state.version
            if state.token != owner.token:
                continue  # left by the slot's previous endpoint
            endpoint = owner.endpoint
            if state.metrics.update_time != endpoint.metrics.update_time:
                endpoint.update_metrics(state.metrics, state.asked)
            endpoint.metrics_valid = state.valid
            endpoint.scrape_error = state.error
            self._watch.saw(board, slot, state, endpoint)
            applied += 1
        return applied

    # -- introspection --

    def stats(self, address: str) -> ScrapeStats | None:
        slot = self._by_address.get(address)
        owner = self._owners.get(slot) if slot is not None else None
        board = self.board
        if owner is None or board is None:
            return None
        got = board.read_stats(slot)  # type: ignore[arg-type]
        return got[1] if got is not None and got[0] == owner.token else None

    def all_stats(self) -> dict[str, ScrapeStats]:
        """By endpoint address, as last published. Safe from another thread (the exposition's)."""
        board = self.board
        if board is None:
            return {}
        out: dict[str, ScrapeStats] = {}
        for slot, owner in self._owners.copy().items():
            got = board.read_stats(slot)
            if got is not None and got[0] == owner.token:
                out[owner.endpoint.address] = got[1]
        return out


# --------------------------------------------------------------------------- the child


def child_main(read_fd: int, note_fd: int = -1) -> None:
    """The scraper process: its settings come first on the pipe, then the endpoints to scrape.
    Its parent stops it (or it stops when the pipe closes): a Ctrl-C at a terminal, which reaches
    the whole process group, is for the parent to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pipe = Connection(read_fd, writable=False)
    try:
        message = pipe.recv()
    except (EOFError, OSError):
        return
    if message[0] != "start":
        raise SystemExit(f"scraper process: expected the settings first, got {message[0]!r}")
    _, settings, board_name = message
    from epp.observability.logging import setup_logging

    setup_logging(settings.log_level)
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(_child(settings, board_name, pipe, note_fd))
    else:
        uvloop.run(_child(settings, board_name, pipe, note_fd))


class _Publisher:
    """After each poll: the endpoint's state if it changed, and its stats when they tell something
    new (an error, a problem, an invalid value, a new interval) or a second has passed — only the
    EPP's own /metrics reads them, and the poll counts and durations may be that old."""

    def __init__(self, board: MetricsBoard, stats_every: float = 1.0,
                 changed: Callable[[], None] | None = None) -> None:
        self.board = board
        self.changed = changed  # told after a state is published
        self.stats_every = stats_every
        self.slots: dict[str, tuple[int, int]] = {}  # address -> (slot, token)
        self.addresses: dict[int, str] = {}  # slot -> address
        self.last: dict[str, tuple[EndpointMetrics, bool, str]] = {}
        self.last_stats: dict[str, tuple[float, tuple[object, ...]]] = {}  # address -> (when, what)

    def __call__(self, endpoint: Endpoint, stats: ScrapeStats) -> None:
        address = endpoint.address
        where = self.slots.get(address)
        if where is None:
            return
        slot, token = where
        state = (endpoint.metrics, endpoint.metrics_valid, endpoint.scrape_error)
        last = self.last.get(address)
        if last is None or last[0] is not state[0] or last[1] != state[1] or last[2] != state[2]:
            self.board.publish_state(slot, token, endpoint, stats.interval)
            self.last[address] = state
            if self.changed is not None:
                self.changed()
        now = time.monotonic()
        # (an error, and so a new last error or an invalid value, counts in `errors`)
        news = (stats.errors, stats.problems, stats.interval)
        published = self.last_stats.get(address)
        if published is None or published[1] != news or now - published[0] >= self.stats_every:
            self.board.publish_stats(slot, token, stats)
            self.last_stats[address] = (now, news)

    def forget(self, address: str) -> None:
        where = self.slots.pop(address, None)
        if where is not None and self.addresses.get(where[0]) == address:
            del self.addresses[where[0]]
        self.last.pop(address, None)
        self.last_stats.pop(address, None)


class _Notes:
    """Tells the main process the board changed: one byte down a pipe, at most one per `delay`
    (the answers to one grid step's polls arrive within a millisecond or two: one note for them)."""

    def __init__(self, fd: int, delay: float = 0.002) -> None:
        self.fd = fd
        self.delay = delay
        self.pending = False

    def __call__(self) -> None:
        if not self.pending:
            self.pending = True
            asyncio.get_running_loop().call_later(self.delay, self._send)

    def _send(self) -> None:
        self.pending = False
        try:
            os.write(self.fd, b"\0")
        except OSError:
            pass  # full: the main process has notes unread (it copies every change when it reads
            # them); closed: it is gone, and the command pipe's end stops this process


class _TrafficMarks:
    """The child's side of the board's traffic words: the endpoints whose word changed since the
    last look (the scraper asks while some endpoint is backed off)."""

    def __init__(self, board: MetricsBoard, publisher: _Publisher) -> None:
        self.board = board
        self.publisher = publisher
        self.seen = board.traffic()

    def __call__(self) -> list[str]:
        now = self.board.traffic()
        if now == self.seen:
            return []
        changed = [slot for slot, (word, before) in enumerate(zip(now, self.seen)) if word != before]
        self.seen = now
        addresses = self.publisher.addresses
        return [addresses[slot] for slot in changed if slot in addresses]


async def _child(settings: ScrapeSettings, board_name: str, pipe: Connection, note_fd: int = -1) -> None:
    board = MetricsBoard.attach(board_name)
    datastore = Datastore()
    publisher = _Publisher(board, changed=_Notes(note_fd) if note_fd >= 0 else None)
    scraper = settings.scraper(datastore, publisher, _TrafficMarks(board, publisher))
    await scraper.start()
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_message() -> None:
        try:
            while pipe.poll():
                message = pipe.recv()
                if message[0] == "add":
                    _, slot, token, spec, metrics, valid, error = message
                    _add(datastore, publisher, slot, token, spec, metrics, valid, error)
                elif message[0] == "remove":
                    _, slot, token, address = message
                    if publisher.slots.get(address) == (slot, token):
                        publisher.forget(address)
                        datastore.remove(address)
                elif message[0] == "stop" and not done.done():
                    done.set_result(None)
                    return
        except (EOFError, OSError):  # the main process is gone
            if not done.done():
                done.set_result(None)

    loop.add_reader(pipe.fileno(), on_message)
    try:
        await done
    finally:
        loop.remove_reader(pipe.fileno())
        await scraper.stop()
        board.close()


def _add(datastore: Datastore, publisher: _Publisher, slot: int, token: int, spec: EndpointSpec,
         metrics: EndpointMetrics, valid: bool, error: str) -> None:
    publisher.forget(spec.address)
    publisher.slots[spec.address] = (slot, token)
    publisher.addresses[slot] = spec.address
    endpoint = datastore.get(spec.address)
    if endpoint is not None and endpoint.spec != spec:
        datastore.remove(spec.address)
    endpoint = datastore.upsert(spec)
    endpoint.metrics = metrics  # carry on from what the main process holds (ITL baseline, kept fields)
    endpoint.metrics_valid = valid
    endpoint.scrape_error = error


if __name__ == "__main__":
    child_main(*map(int, sys.argv[1:3]))
