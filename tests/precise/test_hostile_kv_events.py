"""A broken or hostile pod's KV events, through a real ZMQ socket: the subscriber survives them.

A pod controls everything on its event stream: the frames, the topic, the sequence numbers, the
batch's timestamp and every field of every event. Seeded random messages of every shape wrong
(not msgpack, wrong frame counts, topics naming nothing or a pod not in the pool, sequence numbers
jumping both ways, events of unknown types, fields of the wrong type, sign or size, block sizes
of 0 or 2^31, hashes of odd widths, timestamps of NaN and ±inf) must leave the subscriber
running, the index within its memory bound and for pods of the pool only, the lag histogram
finite, nothing logged as an error and the gaps and restarts not logged one by one — and the real
stream that follows matched as if nothing had happened. (Written in round 50; it found the lag sum
going infinite on two stamps of -1e308, and a warning logged per message of a jumping stream.)
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from typing import Any

import msgspec
import pytest

from epp.datalayer.kv_subscriber import KVEventSubscriber
from epp.datastore.kv_block_index import KVBlockIndex
from epp.datastore.kv_events_config import KVEventsConfig
from tests.precise.helpers import frames
from tests.precise.publisher import Publisher
from tests.precise.test_kv_subscriber import ADDRESS, TOPIC, datastore, keys, until

MAX_KEYS = 3_000
STRANGER = "10.9.9.9:8000"  # a pod not in the pool
ODD: list[Any] = [None, True, 0, -1, 2**64 - 1, -2**63, 1.5, float("nan"), "", "x" * 300, b"\x00" * 32, [],
                  {}, [1, 2]]


def _hash(r: random.Random) -> Any:
    return r.choice([r.randint(0, 2**64 - 1), r.randint(-2**63, -1), r.randbytes(r.choice([0, 1, 32, 64])),
                     r.choice(ODD)])


def _event(r: random.Random) -> dict[str, Any]:
    kind = r.choice(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared", "Bogus", 5])
    event: dict[str, Any] = {"type": kind}
    if kind == "BlockStored":
        n = r.randint(0, 8)
        event.update(block_hashes=[_hash(r) for _ in range(n)],
                     parent_block_hash=_hash(r) if r.random() < 0.5 else None,
                     token_ids=[r.randint(-5, 200_000) for _ in range(r.choice([0, 16 * n, 64 * n, 7, 20_000]))],
                     block_size=r.choice([16, 64, 64, 0, -16, 1, 2**31, r.choice(ODD)]),
                     lora_id=r.choice([None, 1, -1, "x"]), medium=r.choice([None, "GPU", "cpu", "x" * 500, 5]),
                     lora_name=r.choice([None, "a", "x" * 10_000]), group_idx=r.choice([None, 0, 1, -1, 2**40]))
    elif kind == "BlockRemoved":
        event.update(block_hashes=[_hash(r) for _ in range(r.randint(0, 8))], medium=r.choice([None, "GPU", "CPU", 7]))
    if r.random() < 0.2:  # some fields of the wrong type altogether
        for key in list(event):
            if key != "type" and r.random() < 0.5:
                event[key] = r.choice(ODD)
    return event


def _message(r: random.Random, seq: int) -> list[bytes]:
    """One hostile message's frames."""
    topic = r.choice([TOPIC.encode()] * 6 + [f"kv@{STRANGER}@tiny".encode(), b"kv@", b"\xff\xfe", b"x" * 1000])
    seq_frame = r.choice([seq.to_bytes(8, "big")] * 4 + [r.randbytes(8), b"short", (0).to_bytes(8, "big")])
    roll = r.random()
    if roll < 0.1:
        payload = r.randbytes(r.randint(0, 64))
    elif roll < 0.2:
        payload = msgspec.msgpack.encode(r.choice(ODD + [[1.0, "events", 0], {"ts": 1.0}]))
    else:
        ts = r.choice([1.0e9, float("nan"), float("inf"), float("-inf"), -1e308, 0.0])
        payload = msgspec.msgpack.encode([ts, [_event(r) for _ in range(r.randint(0, 5))],
                                          r.choice([None, 0, 1, -1, 2**40])])
    out = [topic, seq_frame, payload]
    if r.random() < 0.05:
        out = out[: r.randint(1, 2)] if r.random() < 0.5 else [*out, b"extra"]
    return out


@pytest.mark.parametrize("seed", [1, 2])
async def test_hostile_kv_events_leave_the_subscriber_working(seed: int, caplog: pytest.LogCaptureFixture) -> None:
    r = random.Random(seed)
    ds = datastore(ADDRESS)
    index = KVBlockIndex(64, max_keys=MAX_KEYS)
    sub = KVEventSubscriber(index, ds, KVEventsConfig(zmq_endpoint="tcp://127.0.0.1:0", discover_pods=False))
    await sub.start()
    pub = Publisher(sub.bound_endpoint, TOPIC)
    captured = frames()
    try:
        with caplog.at_level(logging.DEBUG):
            while not index.has_events(ADDRESS):  # ZMQ's slow joiner: until the SUB is connected
                pub.send(captured[0][2], seq=0)
                await asyncio.sleep(0.02)
            seen = sub.stats.messages + sub.stats.decode_errors + sub.stats.unknown_topic_messages
            for seq in range(1, 401):
                pub.pub.send_multipart(_message(r, seq))
                if seq % 50 == 0:
                    await asyncio.sleep(0)
            # A real stream after it, numbered as a restarted engine's: matched as usual.
            for n, (_, _, payload) in enumerate(captured[:10]):
                pub.send(payload, seq=n)
            await until(lambda: index.match(keys(index, 0)).matched == {ADDRESS: 6})
        stats = sub.stats
        assert stats.messages + stats.decode_errors + stats.unknown_topic_messages > seen + 300
        assert stats.decode_errors > 0 and stats.skipped_events > 0 and stats.unknown_topic_messages > 0
        assert math.isfinite(stats.lag_sum) and stats.lag_count > 0
        assert index.size <= MAX_KEYS
        assert not index.has_events(STRANGER)
        assert index.match(keys(index, 1)).matched == {ADDRESS: 6}
        errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
        assert not errors, [rec.getMessage() for rec in errors]
        # Every gap and restart counted, but logged once per endpoint per interval, not per message.
        stream_warnings = [rec for rec in caplog.records if "KV-event gap" in rec.getMessage()
                           or "sequence went back" in rec.getMessage()]
        assert stats.gaps + stats.restarts > 20 and len(stream_warnings) <= 2
    finally:
        pub.close()
        await sub.stop()
