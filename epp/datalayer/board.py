"""The metrics board: every endpoint's latest scrape in shared memory, for the request path.

The scraper process writes one slot per endpoint (`epp.shm.SlotArray`, a seqlock with a
checksum); any process that attaches reads it without locks, and finds what changed since its
last look by comparing the slots' versions in one call. Two arrays of slots:

- *state*: what decisions read — the endpoint's `EndpointMetrics`, whether they are valid, its
  scrape error, and which endpoint the slot holds (`token`, `address`): a slot is reused when an
  endpoint goes, and a reader ignores a slot whose token is not the one it was told;
- *stats*: `ScrapeStats` for the EPP's own metrics, read only when Prometheus scrapes.

And one word per slot written the other way: *traffic*, the last time (monotonic nanoseconds) a
reader saw the EPP send requests to the slot's endpoint while the scraper polled it less often
(its state's `interval` above the board's base `interval`: its metrics did not move). The scraper
looks at these words every few milliseconds and polls such an endpoint at the full rate again
(`TrafficWatch` is the readers' side). Several readers (request-path workers) may write one
word: each write is one aligned 8-byte store of a time, so a reader sees a newer time or an older
one, never a torn one, and any change is news.

Encoding: a fixed `struct` of numbers, then the address, the error and the three name sets
(served models, running and waiting LoRA adapters) as UTF-8, each set its names sorted and
joined by NUL (a Prometheus text page cannot contain one). Names are bounded before they get
here (`validate.MAX_NAME_BYTES`), so a state always fits its slot. Readers cache the decoded
sets by their bytes: an adapter list that does not change is decoded once.

Layout: a 64-byte header (magic, version, slot count, capacities, base interval), then the
state slots, then the stats slots, then the traffic words. `MetricsBoard.attach(name)` needs nothing else, so a request-path worker
process can read the board of a scraper process it did not start.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import orjson

from epp.datalayer.scraper import ScrapeStats
from epp.datalayer.validate import MAX_NAME_BYTES
from epp.datastore import Endpoint, EndpointMetrics
from epp.shm import Int64Array, Segment, SlotArray, align

_MAGIC = b"EPPBOARD"
_VERSION = 4
_HEADER = struct.Struct("=8sIIIId")  # magic, version, slots, state capacity, stats capacity, base interval
_STATE = struct.Struct("=QdddddddIIIIQIBHHHHH")
_STATS = struct.Struct("=QQQQdddH")
MAX_ADDRESS_BYTES = 256
MAX_ERROR_BYTES = 1024  # scrape errors are cut to 200 characters
STATE_CAPACITY = _STATE.size + MAX_ADDRESS_BYTES + MAX_ERROR_BYTES + MAX_NAME_BYTES + 8
STATS_CAPACITY = 4096
_SET_CACHE_LIMIT = 4096


@dataclass(slots=True)
class BoardState:
    """One endpoint's slot as last published (a reader's copy: not frozen, which would cost a
    microsecond per read, on every poll of every endpoint)."""

    version: int
    token: int
    address: str
    metrics: EndpointMetrics
    valid: bool
    error: str
    interval: float  # seconds between the endpoint's polls now (above the board's `interval`: backed off)
    asked: float  # when the page behind `metrics` was asked for (`Endpoint.metrics_asked`)


class MetricsBoard:
    """The board over one shared-memory segment (`create` in the scraper's owner, `attach`
    elsewhere). One process writes (the scraper process); every process may read."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        magic, version, slots, state_capacity, stats_capacity, interval = _HEADER.unpack_from(segment.buf, 0)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(f"shared-memory segment {segment.name!r} is not a metrics board (version {_VERSION})")
        self.slots = slots
        self.interval = interval  # the scraper's base interval: a slot polled less often is backed off
        offset = align(_HEADER.size)
        self._state = SlotArray(segment.buf, slots, state_capacity, offset)
        offset += SlotArray.size(slots, state_capacity)
        self._stats = SlotArray(segment.buf, slots, stats_capacity, offset)
        offset += SlotArray.size(slots, stats_capacity)
        self._traffic = Int64Array(segment.buf, slots, offset)
        self._sets: dict[bytes, frozenset[str]] = {b"": frozenset()}
        self._encoded: dict[frozenset[str], bytes] = {}  # writer side: name sets as stored
        self._tails: dict[int, tuple[bytes, str, str, frozenset[str], frozenset[str], frozenset[str]]] = {}

    @staticmethod
    def size(slots: int) -> int:
        return align(_HEADER.size) + SlotArray.size(slots, STATE_CAPACITY) + SlotArray.size(slots, STATS_CAPACITY) \
            + Int64Array.size(slots)

    @classmethod
    def create(cls, slots: int, interval: float = 0.05) -> MetricsBoard:
        """A new board for `slots` endpoints polled every `interval` seconds (when not backed off)."""
        segment = Segment.create(cls.size(slots), prefix="epp-board")
        _HEADER.pack_into(segment.buf, 0, _MAGIC, _VERSION, slots, STATE_CAPACITY, STATS_CAPACITY, interval)
        return cls(segment)

    @classmethod
    def attach(cls, name: str) -> MetricsBoard:
        return cls(Segment.attach(name))

    @property
    def name(self) -> str:
        return self.segment.name

    def close(self) -> None:
        self._state.release()
        self._stats.release()
        self._traffic.release()
        self.segment.close()

    # -- writer (the scraper process) --

    def publish_state(self, slot: int, token: int, endpoint: Endpoint, interval: float = 0.0) -> int:
        """The endpoint's metrics, validity and error, and `interval`: the seconds between its polls."""
        m = endpoint.metrics
        address = endpoint.address.encode()[:MAX_ADDRESS_BYTES]
        error = _cut(endpoint.scrape_error, MAX_ERROR_BYTES)
        models, active, waiting = self._names(m.models), self._names(m.active_models), self._names(m.waiting_models)
        head = _STATE.pack(token, m.update_time, endpoint.metrics_asked, interval, m.kv_cache_usage,
                           m.inter_token_latency, m.itl_sum, m.itl_count, m.waiting_queue_size, m.running_requests, m.max_active_models, m.cache_block_size,
                           m.cache_num_blocks, m.max_model_len, 1 if endpoint.metrics_valid else 0, len(address), len(error),
                           len(models), len(active), len(waiting))
        return self._state.write(slot, b"".join((head, address, error, models, active, waiting)))

    def publish_stats(self, slot: int, token: int, stats: ScrapeStats) -> int:
        problems = list(stats.problems)
        while True:
            text = orjson.dumps([stats.last_error, problems, stats.invalid])
            if len(text) + _STATS.size <= STATS_CAPACITY or not problems:
                break
            problems.pop()  # informational only: fit what fits
        text = text[:STATS_CAPACITY - _STATS.size]
        head = _STATS.pack(token, stats.scrapes, stats.errors, stats.consecutive_errors, stats.last_duration,
                           stats.last_success, stats.interval, len(text))
        return self._stats.write(slot, head + text)

    # -- readers --

    def versions(self, upto: int) -> list[int]:
        """State versions of slots [0, upto): compare with the last look to find what changed."""
        return self._state.versions(upto)

    def read_state(self, slot: int) -> BoardState | None:
        got = self._state.read(slot)
        if got is None:
            return None
        version, payload = got
        (token, update_time, asked, interval, kv, itl, itl_sum, itl_count, waiting_queue, running, max_active,
         block_size, num_blocks, max_model_len, valid, n_address, n_error, n_models, n_active, n_waiting) = _STATE.unpack_from(payload)
        tail = payload[_STATE.size:]
        known = self._tails.get(slot)
        if known is not None and known[0] == tail:  # address, error and names as last time: the usual case
            _, address, error, models, active, waiting = known
        else:
            at = 0
            address = tail[at:at + n_address].decode()
            at += n_address
            error = tail[at:at + n_error].decode()
            at += n_error
            models = self._set(tail[at:at + n_models])
            at += n_models
            active = self._set(tail[at:at + n_active])
            at += n_active
            waiting = self._set(tail[at:at + n_waiting])
            self._tails[slot] = (tail, address, error, models, active, waiting)
        # positional (the field order of EndpointMetrics; test_the_board_round_trips_a_state_and_stats
        # holds it): this runs for every poll of every endpoint
        metrics = EndpointMetrics(waiting_queue, running, kv, models, active, waiting, max_active, block_size,
                                  num_blocks, max_model_len, update_time, itl, itl_sum, itl_count)
        return BoardState(version, token, address, metrics, bool(valid), error, interval, asked)

    def read_stats(self, slot: int) -> tuple[int, ScrapeStats] | None:
        """(token, stats) as last published, or None."""
        got = self._stats.read(slot)
        if got is None:
            return None
        payload = got[1]
        token, scrapes, errors, consecutive, duration, success, interval, n_text = _STATS.unpack_from(payload)
        last_error, problems, invalid = orjson.loads(payload[_STATS.size:_STATS.size + n_text])
        return token, ScrapeStats(scrapes=scrapes, errors=errors, consecutive_errors=consecutive,
                                  last_duration=duration, last_success=success, last_error=last_error,
                                  problems=tuple(problems), invalid=dict(invalid), interval=interval)

    def mark_traffic(self, slot: int, when_ns: int) -> None:
        """A reader: the EPP sent requests to the slot's endpoint (at `when_ns`, monotonic)."""
        self._traffic.values[slot] = when_ns

    def traffic(self) -> list[int]:
        """The scraper: every slot's traffic word, to compare with the last look."""
        return self._traffic.tolist()

    def _names(self, names: frozenset[str]) -> bytes:
        encoded = self._encoded.get(names)
        if encoded is None:
            if len(self._encoded) >= _SET_CACHE_LIMIT:
                self._encoded.clear()
            encoded = self._encoded[names] = _names(names)
        return encoded

    def _set(self, raw: bytes) -> frozenset[str]:
        names = self._sets.get(raw)
        if names is None:
            if len(self._sets) >= _SET_CACHE_LIMIT:
                self._sets = {b"": frozenset()}
            names = self._sets[raw] = frozenset(raw.decode().split("\0"))
        return names


def _names(names: frozenset[str]) -> bytes:
    return "\0".join(sorted(names)).encode() if names else b""


def _cut(text: str, limit: int) -> bytes:
    raw = text.encode()
    return raw if len(raw) <= limit else raw[:limit].decode(errors="ignore").encode()


class TrafficWatch:
    """A reader's side of the traffic words: the endpoints the scraper polls less often, as their
    states say, and a mark for each once the EPP has requests in flight on it (`check`, cheap when
    no endpoint is backed off: a busy pool's case)."""

    __slots__ = ("backed_off",)

    def __init__(self) -> None:
        self.backed_off: dict[int, Endpoint] = {}  # slot -> its endpoint, while polled less often

    def saw(self, board: MetricsBoard, slot: int, state: BoardState, endpoint: Endpoint) -> None:
        """A state read from the board for `endpoint`."""
        if state.interval > board.interval:
            self.backed_off[slot] = endpoint
        else:
            self.backed_off.pop(slot, None)

    def forget(self, slot: int) -> None:
        self.backed_off.pop(slot, None)

    def check(self, board: MetricsBoard) -> None:
        """Mark the backed-off endpoints the EPP now has requests on (each once: a state that still
        says backed off after the scraper has seen the mark puts it back here)."""
        if not self.backed_off:
            return
        busy = [slot for slot, endpoint in self.backed_off.items() if endpoint.inflight_requests > 0]
        if busy:
            now = time.monotonic_ns()
            for slot in busy:
                board.mark_traffic(slot, now)
                del self.backed_off[slot]
