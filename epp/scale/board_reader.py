"""A pod's one scraper, read by every member: the metrics board attached by name.

With `epp serve --workers N` the supervisor runs the pod's scraper process (`ScraperProcess`,
over its own discovery of the pool) and every member reads its board instead of scraping the pods
itself: one scrape per pod per interval, whatever the number of workers. A member matches slots
to its own endpoints by address (the board names each slot's endpoint; a slot reused for another
endpoint names that one), and copies what changed into them — before each pick (the ext_proc
server's `refresh`) and on a short timer, as the scraper process's own owner does; and, as it
does, marks on the board the backed-off endpoints this member has requests in flight on, for the
scraper to poll them at the full rate again (`TrafficWatch`).
"""

from __future__ import annotations

import asyncio
import logging

from epp.datalayer.board import MetricsBoard, TrafficWatch
from epp.datalayer.scraper import ScrapeStats
from epp.datastore import Datastore, Endpoint

log = logging.getLogger("epp.scale")


class BoardReader:
    """The scraper's interface the runner uses (`start`, `stop`, `sync`, `all_stats`, `running`)."""

    def __init__(self, datastore: Datastore, board_name: str, *, sync_interval: float = 0.01) -> None:
        self.datastore = datastore
        self.board_name = board_name
        self.sync_interval = sync_interval
        self.board: MetricsBoard | None = None
        self._seen: list[int] = []
        self._addresses: dict[int, str] = {}  # slot -> the endpoint it last named
        self._watch = TrafficWatch()
        self._timer: asyncio.TimerHandle | None = None
        self.running = False

    async def start(self) -> None:
        self.board = MetricsBoard.attach(self.board_name)
        self.running = True
        self.datastore.subscribe(on_add=self._added)
        self.sync()
        self._timer = asyncio.get_running_loop().call_later(self.sync_interval, self._tick)

    async def stop(self) -> None:
        self.running = False
        self.datastore.unsubscribe(on_add=self._added)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.board is not None:
            self.board.close()
            self.board = None

    def _added(self, endpoint: Endpoint) -> None:
        self._seen = []  # its slot may not change again for a while: read every slot once more

    def _tick(self) -> None:
        self._timer = None
        if not self.running:
            return
        try:
            self.sync()
        except Exception:  # a bad slot must not stop the copies
            log.exception("reading the pod's metrics board failed")
        self._timer = asyncio.get_running_loop().call_later(self.sync_interval, self._tick)

    def sync(self) -> int:
        """Copy every slot that changed since the last call into the endpoint it names."""
        board = self.board
        if board is None:
            return 0
        self._watch.check(board)
        versions = board.versions(board.slots)
        seen = self._seen
        if versions == seen:
            return 0
        if len(seen) != len(versions):
            seen = self._seen = [0] * len(versions)
        applied = 0
        for slot, version in enumerate(versions):
            if version == seen[slot] or not version:
                continue
            state = board.read_state(slot)
            if state is None:
                continue  # being written: the next sync gets it
            seen[slot] = state.version
            self._addresses[slot] = state.address
            endpoint = self.datastore.get(state.address)
            if endpoint is None:
                self._watch.forget(slot)
                continue
            if state.metrics.update_time != endpoint.metrics.update_time:
                endpoint.update_metrics(state.metrics, state.asked)
            endpoint.metrics_valid = state.valid
            endpoint.scrape_error = state.error
            self._watch.saw(board, slot, state, endpoint)
            applied += 1
        return applied

    def all_stats(self) -> dict[str, ScrapeStats]:
        """Per endpoint of this member's pool, the scraper's counters (the EPP's own metrics)."""
        board = self.board
        if board is None:
            return {}
        out: dict[str, ScrapeStats] = {}
        for slot, address in list(self._addresses.items()):
            got = board.read_stats(slot)
            if got is not None and self.datastore.get(address) is not None:
                out[address] = got[1]
        return out
