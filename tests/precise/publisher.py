"""A real ZMQ publisher speaking vLLM 0.32's KV-event wire protocol, for the tests.

PUB frames `[topic, seq (8 bytes, big-endian), msgpack batch]`; an optional ROUTER socket serves
replays the way `ZmqEventPublisher._service_replay` does: a request `[identity, b"", start]`
is answered with `[identity, b"", topic, seq, payload]` for every buffered batch from `start`,
then `[identity, b"", b"", -1, b""]`. (The simulator's own publisher is on branch kv-publisher.)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"


class Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = 0


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = 0


def batch(*events: Any) -> bytes:
    return msgspec.msgpack.encode(Batch(time.time(), list(events)))


class Publisher:
    def __init__(self, endpoint: str, topic: str, replay_endpoint: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint or endpoint.endswith(":0"):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.lock = threading.Lock()
        self.replay_endpoint = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replays = 0
        if replay_endpoint is not None:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay_endpoint)
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    @property
    def replay_port(self) -> int:
        return int(self.replay_endpoint.rsplit(":", 1)[1])

    def send(self, payload: bytes, *, seq: int | None = None, record: bool = True, topic: bytes | None = None) -> int:
        with self.lock:
            n = self.seq if seq is None else seq
            self.seq = n + 1
            if record:
                self.buffer.append((n, payload))
            self.pub.send_multipart([self.topic if topic is None else topic, n.to_bytes(8, "big"), payload])
            return n

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            self.replays += 1
            with self.lock:
                items = [(s, p) for s, p in self.buffer if s >= first]
            for s, p in items:
                self.router.send_multipart([identity, b"", self.topic, s.to_bytes(8, "big"), p])
            self.router.send_multipart([identity, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
            self.router.close(0)
        self.pub.close(0)
        self.ctx.term()
