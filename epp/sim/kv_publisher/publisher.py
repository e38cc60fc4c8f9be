"""vLLM's ZMQ KV-event publisher for a simulated pod: PUB stream, replay ROUTER, replay ring.

Wire format (vLLM 0.32 `ZmqEventPublisher`): each engine step with events is one multipart
message `[topic, seq, payload]` — `seq` an 8-byte big-endian counter from 0 for the life of the
publisher (ZMQ reconnects do not reset it), `payload` the msgpack `EventBatch`. On the replay
ROUTER a client sends `[b"", start_seq]` (a DEALER, or the REQ envelope) and gets one message
`[b"", topic, seq, payload]` per buffered batch with seq >= start_seq, then the end marker
`[b"", b"", seq -1 (8 bytes 0xff), b""]`. A REQ client receives only the first of those (vLLM's
own tests use a DEALER for that reason).

Why a thread rather than zmq.asyncio on the pod's loop: it is vLLM's design (the engine hands a
batch to a queue, a thread encodes and sends), so encoding payloads of thousands of token ids,
and answering a replay of up to `buffer_steps` batches, never holds up the pods' aiohttp loop;
the thread owns its sockets from creation to close, so no socket crosses threads. Sockets live in
the process-wide `zmq.Context.instance()` (as in vLLM): one I/O thread for all pods, and an
`inproc://` endpoint is reachable by in-process subscribers. The context is never terminated.

Where we differ, on purpose: `publish` never blocks (vLLM's bounded queue blocks the engine
when full; here the batch is dropped, logged and its seq skipped, so subscribers see the gap); the
ring is kept only when a replay endpoint exists (nobody could read it otherwise); the replay
ROUTER's send HWM is sized to the ring, so one replay is never cut short by ZMQ's default of
1000 messages; a malformed replay request (not 8 bytes) is logged and ignored.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from epp.sim.kv_events import EventBatch
from epp.sim.kv_publisher.config import PodPublisherSettings

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8  # vLLM's end-of-replay marker: seq -1 as a signed 8-byte int
_BIND_RETRY = 1.0  # seconds a bind retries EADDRINUSE (a restarted pod's old socket closes async)
_REPLAY_POLL = 0.05  # with a replay socket, how often the idle thread looks for requests
_REPLAYS_PER_WAKE = 8  # replay requests answered before publishing resumes
_START_TIMEOUT = 5.0
_IDLE = object()  # the queue's wait timed out (time to look at the replay socket)


class ZmqEventPublisher:
    """Publishes one pod's event batches. Construct it off the event loop (it binds, and may wait
    up to a second for a port a previous incarnation is releasing); `publish` from one thread."""

    def __init__(self, settings: PodPublisherSettings, *, host: str = "127.0.0.1", data_parallel_rank: int = 0,
                 linger: float = 0.5, name: str = "kv-publisher") -> None:
        self.settings = settings
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = settings.endpoint
        self.replay_endpoint = settings.replay_endpoint
        self.published = 0  # batches handed to the thread
        self.dropped = 0  # batches dropped because the queue was full
        self._host = host
        self._linger_ms = int(linger * 1000)
        self._seq = 0
        self._closed = False
        self._queue: queue.Queue[tuple[int, EventBatch] | None] = queue.Queue(settings.max_queue_size)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT):
            raise RuntimeError(f"{name}: sockets not ready after {_START_TIMEOUT} s")
        if self._error is not None:
            self._thread.join(_START_TIMEOUT)
            raise self._error
        log.info("%s: KV events on %s (%s), topic %r, replay %s", name, self.endpoint,
                 "bind" if settings.bind else "connect", settings.topic, self.replay_endpoint or "off")

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, batch: EventBatch) -> None:
        """Queue one step's batch; never blocks. The seq is taken now, so a drop leaves a gap."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        seq = self._seq
        self._seq = seq + 1
        try:
            self._queue.put_nowait((seq, batch))
            self.published += 1
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("%s: KV-event queue full (%d batches); dropped seq %d (%d dropped so far)",
                            self._thread.name, self.settings.max_queue_size, seq, self.dropped)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets with `linger`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("%s: queue still full at close; %d batches unsent", self._thread.name,
                        self._queue.qsize())
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("%s: thread did not stop within %.1f s", self._thread.name, timeout)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub: zmq.Socket | None = None
        replay: zmq.Socket | None = None
        try:
            try:
                pub = ctx.socket(zmq.PUB)
                pub.set_hwm(self.settings.hwm)
                if self.settings.bind:
                    self.endpoint = _bind(pub, self.endpoint, self._host)
                else:  # resolves and retries in the background, as in vLLM: a typo shows as silence
                    try:
                        pub.connect(self.endpoint)
                    except zmq.ZMQError as exc:
                        raise OSError(exc.errno, f"cannot connect KV-event socket {self.endpoint}: "
                                                 f"{exc.strerror}") from None
                if self.replay_endpoint is not None:
                    replay = ctx.socket(zmq.ROUTER)
                    replay.setsockopt(zmq.SNDHWM, max(1000, 2 * (self.settings.buffer_steps + 1)))
                    self.replay_endpoint = _bind(replay, self.replay_endpoint, self._host)
            except BaseException as exc:  # reported to the constructor
                self._error = exc
                return
            finally:
                self._ready.set()
            self._loop(pub, replay)
        except Exception:
            log.exception("%s: publisher thread failed", self._thread.name)
        finally:
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=self._linger_ms)

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        encode = msgspec.msgpack.Encoder().encode
        topic = self.settings.topic.encode()
        ring: deque[tuple[int, bytes]] | None = None
        if replay is not None:
            ring = deque(maxlen=self.settings.buffer_steps)
        wait = _REPLAY_POLL if replay is not None else None
        get = self._queue.get
        while True:
            item: tuple[int, EventBatch] | object | None
            try:
                item = get(timeout=wait)
            except queue.Empty:
                item = _IDLE
            if replay is not None and ring is not None:
                self._serve_replays(replay, ring, topic)
            if item is _IDLE:
                continue
            if item is None:
                return
            assert isinstance(item, tuple)
            seq, batch = item
            payload = encode(batch)
            seq_bytes = seq.to_bytes(8, "big")
            try:
                pub.send_multipart((topic, seq_bytes, payload), copy=False)
            except zmq.ZMQError as exc:  # PUB drops at the HWM instead of raising; this is rarer
                log.warning("%s: send of seq %d failed: %s", self._thread.name, seq, exc)
            if ring is not None:
                ring.append((seq, payload))

    def _serve_replays(self, replay: zmq.Socket, ring: deque[tuple[int, bytes]], topic: bytes) -> None:
        for _ in range(_REPLAYS_PER_WAKE):
            if not replay.poll(0):
                return
            frames = replay.recv_multipart()
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                log.warning("%s: ignored a malformed replay request (%d frames; want [id, b'', 8-byte seq])",
                            self._thread.name, len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in ring:
                if seq >= start_seq:
                    replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload), copy=False)
            replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind(sock: zmq.Socket, endpoint: str, host: str) -> str:
    """Bind (retrying EADDRINUSE briefly) and return the endpoint subscribers can reach.

    As in vLLM, `tcp://*:0` means this node's address on a free port: here the pod's host.
    Any port-0 endpoint comes back with the port the OS chose.
    """
    if endpoint == "tcp://*:0":
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
            endpoint = f"tcp://[{host}]:0"
        else:
            endpoint = f"tcp://{host}:0"
    elif "::" in endpoint or "[" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    deadline = time.monotonic() + _BIND_RETRY
    while True:
        try:
            sock.bind(endpoint)
            break
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise OSError(exc.errno, f"cannot bind KV-event socket {endpoint}: {exc.strerror}") from None
            time.sleep(0.005)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return endpoint
