"""The KV-event publisher on real ZMQ sockets: vLLM 0.32's framing, seq, replay and endpoints.

Batches here are built by hand; `test_kv_events_http.py` checks the events real pods produce.
Every wait is bounded (`recv` with a timeout) so a failure never hangs the suite.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from epp.params import ConfigError
from epp.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from epp.sim.kv_publisher import END_SEQ, KVEventsConfig, ZmqEventPublisher, offset_endpoint

WAIT_MS = 5000


class Batch(msgspec.Struct, array_like=True):
    """A decoder's view of the payload (the subscriber side, not our encoder's struct)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(Batch).decode


def stored(first: int, n: int = 1, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=list(range(first, first + n)), parent_block_hash=parent,
                       token_ids=list(range(16 * n)), block_size=16, lora_id=None, medium="GPU",
                       lora_name=None, extra_keys=[None] * n, group_idx=0, kv_cache_spec_kind="full_attention")


def settings(endpoint: str, **kw: object) -> object:
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, **kw)  # type: ignore[arg-type]
    return cfg.for_pod(0, ip="127.0.0.1", port=8000, model="tiny")


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c = zmq.Context.instance()
    socks: list[zmq.Socket[bytes]] = []
    orig = c.socket

    def tracked(kind: int) -> zmq.Socket[bytes]:
        s = orig(kind)
        socks.append(s)
        return s

    c.socket = tracked  # type: ignore[method-assign]
    try:
        yield c
    finally:
        del c.socket  # type: ignore[attr-defined]
        for s in socks:
            s.close(linger=0)


def recv(sock: zmq.Socket[bytes], timeout_ms: int = WAIT_MS) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing received in time"
    return sock.recv_multipart()


def subscribe_until_live(pub: ZmqEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish probes until the subscription is in place (ZMQ's slow joiner); returns the next seq."""
    for _ in range(100):
        pub.publish(EventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        if sub.poll(50):
            while sub.poll(50):
                sub.recv_multipart()
            return pub.next_seq
    raise AssertionError("subscription never became live")


# ------------------------------------------------------------------ the flag

def test_config_defaults_and_vllm_semantics() -> None:
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert cfg.publisher == "zmq" and cfg.enabled
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm, cfg.max_queue_size, cfg.topic) == \
        ("tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    off = KVEventsConfig.from_json('{"enable_kv_cache_events": false}')
    assert off.publisher == "null" and not off.enabled and off.warnings() == []
    null = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not null.enabled
    stray = KVEventsConfig.from_json('{"publisher": "zmq"}')
    assert not stray.enabled and "disabled" in stray.warnings()[0]


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "invalid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "--kv-events-config.endpont: unknown field"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events: must be true or false"),
    ('{"publisher": "kafka"}', "publisher: must be one of null, zmq"),
    ('{"hwm": "10"}', "hwm: must be an integer"),
    ('{"buffer_steps": -1}', "buffer_steps: must be >= 0"),
    ('{"max_queue_size": 0}', "max_queue_size: must be >= 1"),
    ('{"endpoint": "udp://x:1"}', "must start with tcp://, ipc:// or inproc://"),
    ('{"endpoint": "tcp://127.0.0.1"}', "must be tcp://HOST:PORT"),
    ('{"endpoint": "tcp://127.0.0.1:0"}', "a connect endpoint needs a port"),
    ('{"replay_endpoint": "tcp://*:99999"}', "must be tcp://HOST:PORT"),
    ('{"topic": 3}', "topic: must be a string"),
])
def test_config_errors_are_clear(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        KVEventsConfig.from_json(text)


def test_per_pod_endpoints_and_topic() -> None:
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", '
                                   '"replay_endpoint": "tcp://*:7000", "topic": "kv@{ip}:{port}@{model}"}')
    pod2 = cfg.for_pod(2, ip="10.0.0.3", port=8002, model="tiny")
    assert (pod2.endpoint, pod2.bind, pod2.replay_endpoint, pod2.topic) == \
        ("tcp://*:6002", True, "tcp://*:7002", "kv@10.0.0.3:8002@tiny")
    # A concrete host connects; separate servers all connect to the one subscriber (not offset).
    central = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:6000", '
                                       '"replay_endpoint": "tcp://127.0.0.1:7000"}').for_pod(3, ip="h", port=1, model="m")
    assert (central.endpoint, central.bind, central.replay_endpoint) == \
        ("tcp://127.0.0.1:6000", False, "tcp://127.0.0.1:7003")
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint("tcp://*:0", 5) == "tcp://*:0"
    assert offset_endpoint("ipc:///x", 0) == "ipc:///x"
    with pytest.raises(ValueError, match="ipc"):
        offset_endpoint("ipc:///x", 1)
    with pytest.raises(ValueError, match="65535"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:65535"}').check_pods(2)


# ------------------------------------------------------------------ the wire

def test_bind_mode_frames_seq_and_payload(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = ZmqEventPublisher(settings("tcp://*:0", topic="kv@t"))  # type: ignore[arg-type]
    try:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        sub = ctx.socket(zmq.SUB)
        sub.subscribe(b"kv@")
        sub.connect(pub.endpoint)
        first = subscribe_until_live(pub, sub)
        events = [stored(1, 2), stored(3, 1, parent=2)], [BlockRemoved(block_hashes=[3], medium="GPU", group_idx=0)]
        for evs in events:
            pub.publish(EventBatch(ts=123.5, events=list(evs)))
        for i, evs in enumerate(events):
            topic, seq, payload = recv(sub)
            assert topic == b"kv@t" and len(seq) == 8 and int.from_bytes(seq, "big") == first + i
            batch = DECODE(payload)
            assert batch.ts == 123.5 and batch.data_parallel_rank == 0 and batch.events == list(evs)
            assert payload == msgspec.msgpack.encode(EventBatch(123.5, list(evs), 0))
    finally:
        pub.close()


def test_replay_router_framing(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """vLLM 0.32: [b"", start] in; [b"", topic, seq, payload] per buffered batch; then [b"", b"", -1, b""]."""
    pub = ZmqEventPublisher(settings("tcp://*:0", replay_endpoint="tcp://*:0", buffer_steps=3, topic="t"))  # type: ignore[arg-type]
    try:
        for i in range(5):
            pub.publish(EventBatch(ts=float(i), events=[stored(10 * i)]))
        dealer = ctx.socket(zmq.DEALER)
        assert pub.replay_endpoint is not None
        dealer.connect(pub.replay_endpoint)
        got: list[int] = []
        for _ in range(20):  # the ring fills on the publisher thread: ask until all 5 were sent
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            got = []
            while True:
                frames = recv(dealer)
                if frames[2] == END_SEQ:
                    assert frames == [b"", b"", END_SEQ, b""]
                    break
                empty, topic, seq, payload = frames
                assert empty == b"" and topic == b"t"
                got.append(int.from_bytes(seq, "big"))
                assert DECODE(payload).events == [stored(10 * got[-1])]
            if got and got[-1] == 4:
                break
            time.sleep(0.02)
        assert got == [2, 3, 4]  # buffer_steps = 3: only the last three steps
        dealer.send_multipart([b"", (4).to_bytes(8, "big")])
        assert int.from_bytes(recv(dealer)[2], "big") == 4 and recv(dealer)[2] == END_SEQ
        # A REQ client (the REQ envelope is the same) gets the first reply.
        req = ctx.socket(zmq.REQ)
        req.connect(pub.replay_endpoint)
        req.send((3).to_bytes(8, "big"))
        assert int.from_bytes(recv(req)[1], "big") == 3
        # A malformed request is ignored; the socket keeps serving.
        dealer.send_multipart([b"", b"\x01"])
        dealer.send_multipart([b"", (4).to_bytes(8, "big")])
        assert int.from_bytes(recv(dealer)[2], "big") == 4
    finally:
        pub.close()


def test_connect_mode_backlog_reaches_a_rebound_subscriber(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """vLLM connects to a concrete host; a subscriber that comes back on the port gets what was sent meanwhile."""
    sub = ctx.socket(zmq.SUB)
    sub.subscribe(b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    pub = ZmqEventPublisher(settings(f"tcp://127.0.0.1:{port}"))  # type: ignore[arg-type]
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        nxt = subscribe_until_live(pub, sub)
        sub.close(linger=0)  # the router restarts ...
        # Batches sent before ZMQ notices the dropped connection die with it; after that they queue
        # (up to the HWM) for the reconnect. A restart takes longer than loopback's detection.
        time.sleep(0.5)
        for i in range(3):
            pub.publish(EventBatch(ts=0.0, events=[stored(i)]))
        sub2 = ctx.socket(zmq.SUB)
        sub2.subscribe(b"")
        sub2.bind(f"tcp://127.0.0.1:{port}")  # ... and binds again
        seqs = [int.from_bytes(recv(sub2)[1], "big") for _ in range(3)]
        assert seqs == [nxt, nxt + 1, nxt + 2]
    finally:
        pub.close()


def test_inproc_and_ipc_bind(ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: object) -> None:
    for endpoint in ("inproc://kv-test", f"ipc://{tmp_path}/kv.sock"):
        pub = ZmqEventPublisher(settings(endpoint))  # type: ignore[arg-type]
        try:
            sub = ctx.socket(zmq.SUB)
            sub.subscribe(b"")
            sub.connect(endpoint)
            subscribe_until_live(pub, sub)
        finally:
            pub.close()


def test_bind_conflict_is_a_clear_error(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    holder = ctx.socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    with pytest.raises(OSError, match=f"cannot bind KV-event socket tcp://127.0.0.1:{port}"):
        ZmqEventPublisher(settings("tcp://*:0", replay_endpoint=f"tcp://127.0.0.1:{port}"))  # type: ignore[arg-type]


def test_publish_never_blocks_and_a_drop_leaves_a_gap(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = ZmqEventPublisher(settings("tcp://*:0", max_queue_size=1))  # type: ignore[arg-type]
    pub._queue.put(None)  # stop the thread, as if it were stuck: nothing drains the queue now
    pub._thread.join(5)
    for _ in range(3):
        pub.publish(EventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert pub.next_seq == 3 and pub.published == 1 and pub.dropped == 2  # seqs 1 and 2 are a gap
    pub.close(timeout=0.1)  # a stuck thread never hangs close
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(EventBatch(ts=0.0, events=[]))


def test_close_is_prompt_and_idempotent(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Connect mode with nobody listening: close returns (linger only bounds background delivery)."""
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.close(linger=0)
    pub = ZmqEventPublisher(settings(f"tcp://127.0.0.1:{port}", replay_endpoint="tcp://127.0.0.1:0"))  # type: ignore[arg-type]
    for _ in range(100):
        pub.publish(EventBatch(ts=0.0, events=[stored(1, 8)]))
    pub.close()
    assert not pub._thread.is_alive()
    pub.close()
