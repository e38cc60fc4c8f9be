"""The KV-event subscriber: vLLM's ZMQ event stream → the precise prefix index (`KVBlockIndex`).

Two modes (`KVEventsConfig`):
- *central*: one SUB socket binds `zmqEndpoint` (e.g. `tcp://*:5557`); every pod's publisher
  connects to it (vLLM connects when its endpoint names a host) and the topic
  `kv@<ip>:<port>@<model>` names the endpoint;
- *discovery*: one SUB socket per endpoint, connected to `tcp://<pod ip>:<socketPort>` (vLLM's
  default bind), added and removed as discovery adds and removes endpoints.

Messages are decoded with msgspec and applied in order per publisher (one endpoint and one
data-parallel rank): everything runs on the event loop, one message at a time, so the index never
needs a lock and scheduling always reads a consistent index. Sequence numbers are checked: a gap
is replayed through the publisher's ROUTER socket when one is configured (vLLM's protocol: send
`[b"", start_seq]`, receive `[b"", topic, seq, payload]` until seq -1), otherwise the endpoint's
entries are dropped (they may hold blocks whose removal was lost); numbers going back mean the
engine restarted with an empty cache, and reset the endpoint too. Connections are re-dialled by
libzmq with exponential back-off (100 ms up to 5 s); a central socket that cannot bind retries
likewise. Misconfiguration is loud: topics that name no known endpoint, endpoints that never sent
an event, and a precise index that has matched nothing for a while each log a warning and count.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from epp.datalayer.kv_events import DecodeError, StreamState, decode_payload, decode_seq, parse_topic
from epp.datastore import Datastore, Endpoint
from epp.datastore.kv_block_index import KVBlockIndex
from epp.datastore.kv_events_config import KVEventsConfig

log = logging.getLogger("epp.datalayer.kvevents")

MAX_MESSAGE_BYTES = 64 << 20  # a pod controls the payload: bounded before it reaches memory
MAX_REMEMBERED_TOPICS = 32
MAX_DP_RANKS = 1024  # distinct unknown topics warned about individually
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)
MAX_LAG = 3600.0  # seconds: a stamp further back is a broken clock; counted at this, in the top bucket
STREAM_WARNING_INTERVAL = 30.0  # seconds: one gap / restart warning per endpoint per this, with a count
MAX_WARNED_STREAMS = 4096
RECONNECT_MIN, RECONNECT_MAX = 0.1, 5.0


@dataclass(slots=True)
class SubscriberStats:
    """Counters the metrics collector reads at scrape time."""

    messages: int = 0
    events: dict[str, int] = field(default_factory=dict)  # event type -> count
    decode_errors: int = 0
    skipped_events: int = 0
    unknown_topic_messages: int = 0
    gaps: int = 0
    restarts: int = 0
    replays: dict[str, int] = field(default_factory=dict)  # outcome -> count
    warnings: dict[str, int] = field(default_factory=dict)  # kind -> warnings logged
    silent_endpoints: int = 0
    lag_buckets: list[int] = field(default_factory=lambda: [0] * (len(LAG_BUCKETS) + 1))
    lag_sum: float = 0.0
    lag_count: int = 0
    sockets: int = 0

    def observe_lag(self, seconds: float) -> None:
        """One batch's lag (our clock less the pod's timestamp): a pod controls that stamp, so a
        non-finite one is not counted (an infinite lag would hold the sum at infinity for good) and
        one beyond `MAX_LAG` counts as `MAX_LAG` (two stamps of -1e308 summed to infinity too)."""
        if not math.isfinite(seconds):
            return
        seconds = min(max(0.0, seconds), MAX_LAG)
        i = 0
        while i < len(LAG_BUCKETS) and seconds > LAG_BUCKETS[i]:
            i += 1
        self.lag_buckets[i] += 1
        self.lag_sum += seconds
        self.lag_count += 1


class KVEventSubscriber:
    def __init__(self, index: KVBlockIndex, datastore: Datastore, config: KVEventsConfig, *,
                 clock: Callable[[], float] | None = None, wall: Callable[[], float] = time.time,
                 watchdog_interval: float | None = None) -> None:
        self.index = index
        self.datastore = datastore
        self.config = config
        self.clock = clock or datastore.clock
        self.wall = wall
        self.stats = SubscriberStats()
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}  # "central" or endpoint address -> receive loop
        self._streams: dict[tuple[str, int], StreamState] = {}
        self._added: dict[str, float] = {}  # endpoint -> when discovery added it
        self._warned_silent: set[str] = set()
        self._warned_topics: set[bytes] = set()
        self._stream_warned: dict[tuple[str, str], tuple[float, int]] = {}  # (kind, endpoint) -> (logged at, unlogged)
        self._watchdog: asyncio.Task[None] | None = None
        self._watchdog_interval = watchdog_interval or max(0.5, min(5.0, config.silent_after / 4))
        self._lookups_seen = 0
        self._no_match_warned = False
        self.bound_endpoint = ""  # central mode: the address actually bound (tcp://*:0 picks a port)

    # -- lifecycle --

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self.datastore.subscribe(on_add=self._endpoint_added, on_remove=self._endpoint_removed)
        if self.config.central:
            ready = asyncio.get_running_loop().create_future()
            self._tasks["central"] = asyncio.create_task(self._central(ready), name="kv-events-central")
            await asyncio.wait([ready, self._tasks["central"]], timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
        self._watchdog = asyncio.create_task(self._watch(), name="kv-events-watchdog")
        mode = f"central {self.bound_endpoint or self.config.zmq_endpoint}" if self.config.central else "discovery"
        log.info("kv-event subscriber started", extra={"mode": mode, "topic_filter": self.config.topic_filter,
                                                       "router_block_size": self.index.block_size})

    async def stop(self) -> None:
        self.datastore.unsubscribe(on_add=self._endpoint_added, on_remove=self._endpoint_removed)
        tasks = [*self._tasks.values(), *([self._watchdog] if self._watchdog else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # -- discovery --

    def _endpoint_added(self, endpoint: Endpoint) -> None:
        self._added[endpoint.address] = self.clock()
        if self.config.central or self._ctx is None:
            return
        url = self.config.sockets.url(endpoint.spec.ip, endpoint.spec.port, endpoint.address)
        if url is None:
            log.warning("no KV-event socket for endpoint", extra={"endpoint": endpoint.address})
            return
        old = self._tasks.pop(endpoint.address, None)
        if old is not None:
            old.cancel()
        self._tasks[endpoint.address] = asyncio.get_running_loop().create_task(
            self._per_endpoint(endpoint.address, url), name=f"kv-events-{endpoint.address}")

    def _endpoint_removed(self, endpoint: Endpoint) -> None:
        address = endpoint.address
        self._added.pop(address, None)
        self._warned_silent.discard(address)
        for key in [k for k in self._streams if k[0] == address]:
            del self._streams[key]
        task = self._tasks.pop(address, None)
        if task is not None:
            task.cancel()
        self.index.remove_endpoint(address)

    # -- receive loops --

    def _sub_socket(self) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RECONNECT_IVL, int(RECONNECT_MIN * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(RECONNECT_MAX * 1000))
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self.config.topic_filter.encode())
        return sock

    async def _central(self, ready: asyncio.Future[None]) -> None:
        delay = RECONNECT_MIN
        while True:
            sock = self._sub_socket()
            try:
                sock.bind(self.config.zmq_endpoint)
                self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            except zmq.ZMQError as exc:
                sock.close(0)
                log.warning("cannot bind the KV-event socket; retrying",
                            extra={"endpoint": self.config.zmq_endpoint, "error": str(exc), "retry_s": delay})
                await asyncio.sleep(delay)
                delay = min(RECONNECT_MAX, delay * 2)
                continue
            delay = RECONNECT_MIN
            self.stats.sockets += 1
            if not ready.done():
                ready.set_result(None)
            try:
                while True:
                    frames = await sock.recv_multipart(copy=True)
                    topic = parse_topic(frames[0]) if frames else None
                    if topic is None or self.datastore.get(topic.address) is None:
                        self._unknown_topic(frames[0] if frames else b"")
                        continue
                    await self._message(topic.address, frames)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                log.warning("KV-event socket failed; re-binding", extra={"error": str(exc)})
                await asyncio.sleep(delay)
            finally:
                self.stats.sockets -= 1
                sock.close(0)

    async def _per_endpoint(self, address: str, url: str) -> None:
        delay = RECONNECT_MIN
        while True:
            sock = self._sub_socket()
            try:
                sock.connect(url)  # libzmq re-dials with back-off while the pod is away
                self.stats.sockets += 1
                log.info("subscribed to KV events", extra={"endpoint": address, "socket": url})
                while True:
                    frames = await sock.recv_multipart(copy=True)
                    await self._message(address, frames)
                    delay = RECONNECT_MIN
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as exc:
                log.warning("KV-event socket failed; reconnecting",
                            extra={"endpoint": address, "error": str(exc), "retry_s": delay})
                await asyncio.sleep(delay)
                delay = min(RECONNECT_MAX, delay * 2)
            finally:
                self.stats.sockets -= 1
                sock.close(0)

    # -- one message --

    async def _message(self, address: str, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.stats.decode_errors += 1
            return
        try:
            seq = decode_seq(frames[1])
            batch, skipped = decode_payload(frames[2])
        except DecodeError:
            self.stats.decode_errors += 1
            return
        rank = batch.data_parallel_rank or 0
        if not 0 <= rank < MAX_DP_RANKS:  # a pod controls it: bounded before it keys our state
            self.stats.decode_errors += 1
            return
        self.stats.messages += 1
        self.stats.skipped_events += skipped
        stream = self._streams.setdefault((address, rank), StreamState())
        verdict = stream.verdict(seq)
        if verdict == "gap":
            self.stats.gaps += 1
            assert stream.expected is not None
            if not await self._replay(address, stream, stream.expected, seq):
                self._stream_warning("gap", address, "KV-event gap without replay: dropping the endpoint's entries",
                                     expected_seq=stream.expected, got_seq=seq)
                self.index.reset(address, "gap")
        elif verdict == "restart":
            self.stats.restarts += 1
            self._stream_warning("restart", address, "KV-event sequence went back: the engine restarted, its cache is "
                                 "empty", expected_seq=stream.expected, got_seq=seq)
            self.index.reset(address, "restart")
        elif verdict == "first" and seq > 0:
            await self._replay(address, stream, 0, seq, catch_up=True)
        if stream.expected is not None and seq < stream.expected and verdict != "restart":
            return  # already applied by the replay
        self._apply(address, batch)
        stream.advance(seq)

    def _apply(self, address: str, batch: object) -> None:
        events = batch.events  # type: ignore[attr-defined]
        counts = self.stats.events
        for event in events:
            name = type(event).__name__
            counts[name] = counts.get(name, 0) + 1
        self.index.apply(address, events, self.clock())
        ts = batch.ts  # type: ignore[attr-defined]
        if ts:
            self.stats.observe_lag(self.wall() - ts)

    async def _replay(self, address: str, stream: StreamState, start: int, until: int, *,
                      catch_up: bool = False) -> bool:
        """Fetch [start, until) from the publisher's ROUTER socket and apply it; True when the
        replay covered the whole range."""
        endpoint = self.datastore.get(address)
        url = (self.config.replay.url(endpoint.spec.ip, endpoint.spec.port, address)
               if endpoint is not None else None)
        if url is None or self._ctx is None:
            if not catch_up:
                self.stats.replays["unavailable"] = self.stats.replays.get("unavailable", 0) + 1
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        covered_from: int | None = None
        applied = 0
        try:
            sock.connect(url)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = asyncio.get_running_loop().time() + self.config.replay_timeout
            while True:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0 or not await sock.poll(int(remaining * 1000)):
                    raise TimeoutError
                frames = await sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = decode_seq(frames[2])
                if seq < 0:
                    break  # end of replay
                if seq < start or seq >= until:
                    continue
                batch, skipped = decode_payload(frames[3])
                self.stats.skipped_events += skipped
                if covered_from is None:
                    covered_from = seq
                self._apply(address, batch)
                stream.advance(seq)
                applied += 1
        except (TimeoutError, zmq.ZMQError, DecodeError) as exc:
            self.stats.replays["failed"] = self.stats.replays.get("failed", 0) + 1
            log.warning("KV-event replay failed", extra={"endpoint": address, "socket": url, "error": repr(exc)})
            return False
        finally:
            sock.close(0)
        complete = covered_from == start and applied == until - start
        outcome = "complete" if complete else "partial"
        self.stats.replays[outcome] = self.stats.replays.get(outcome, 0) + 1
        log.info("KV-event replay", extra={"endpoint": address, "from_seq": start, "to_seq": until,
                                           "applied": applied, "outcome": outcome})
        return complete

    # -- loud when misconfigured --

    def _unknown_topic(self, topic: bytes) -> None:
        self.stats.unknown_topic_messages += 1
        if topic in self._warned_topics or len(self._warned_topics) >= MAX_REMEMBERED_TOPICS:
            return
        self._warned_topics.add(topic)
        self._warn("unknown_topic", "KV events on a topic that names no known endpoint (want kv@<ip>:<port>@<model>, "
                   "the endpoint's address as discovery reports it)", topic=topic[:120].decode(errors="replace"),
                   known=", ".join(ep.address for ep in self.datastore.endpoints()[:8]))

    def _stream_warning(self, kind: str, address: str, message: str, **fields: object) -> None:
        """A gap or restart, logged at most once per endpoint per `STREAM_WARNING_INTERVAL` with
        how many went unlogged since: a pod whose numbers jump at every message (a broken or hostile
        publisher) would otherwise write a warning per message. The counters count them all."""
        now = self.clock()
        key = (kind, address)
        last = self._stream_warned.get(key)
        if last is not None and now - last[0] < STREAM_WARNING_INTERVAL:
            self._stream_warned[key] = (last[0], last[1] + 1)
            return
        if last is None and len(self._stream_warned) >= MAX_WARNED_STREAMS:
            self._stream_warned.clear()
        self._stream_warned[key] = (now, 0)
        log.warning(message, extra={"endpoint": address, "unlogged_since_last": last[1] if last else 0, **fields})

    def _warn(self, kind: str, message: str, **fields: object) -> None:
        self.stats.warnings[kind] = self.stats.warnings.get(kind, 0) + 1
        log.warning(message, extra={"kind": kind, **fields})

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._watchdog_interval)
            self.check()

    def check(self) -> None:
        """Warn about endpoints that never sent an event, and a precise index that matches nothing."""
        now = self.clock()
        silent = 0
        for ep in self.datastore.endpoints():
            added = self._added.get(ep.address, now)
            if self.index.has_events(ep.address):
                self._warned_silent.discard(ep.address)
                continue
            if now - added < self.config.silent_after:
                continue
            silent += 1
            if ep.address not in self._warned_silent:
                self._warned_silent.add(ep.address)
                hint = (f"its --kv-events-config should connect to {self.bound_endpoint or self.config.zmq_endpoint} "
                        f"with topic kv@{ep.address}@<model>" if self.config.central else
                        "its --kv-events-config should bind the socket this EPP dials, with a topic matching "
                        f"{self.config.topic_filter!r}")
                self._warn("silent_endpoint", f"endpoint has sent no KV event; routing to it uses the approximate "
                           f"index ({hint})", endpoint=ep.address, seconds=round(now - added, 1))
        self.stats.silent_endpoints = silent
        stats = self.index.stats
        new_lookups = stats.lookups - self._lookups_seen
        idle = now - stats.last_hit if stats.last_hit else now - min(self._added.values(), default=now)
        if new_lookups >= 10 and idle >= self.config.silent_after:
            self._lookups_seen = stats.lookups
            if not self._no_match_warned:
                self._no_match_warned = True
                self._warn("no_match", "the precise prefix index has matched no block for a while; check that "
                           "the engines publish KV events with token_ids and that the token-producer tokenizes "
                           "like the engine", lookups=new_lookups, seconds=round(idle, 1))
        elif stats.last_hit and now - stats.last_hit < self.config.silent_after:
            self._no_match_warned = False
            self._lookups_seen = stats.lookups
