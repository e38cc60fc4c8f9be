"""The subscriber against real pyzmq sockets: central and discovery modes, gaps, replays, restarts,
and the warnings for misconfiguration."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer

from epp.datalayer.kv_subscriber import MAX_LAG, KVEventSubscriber, SubscriberStats
from epp.datastore import Datastore, EndpointSpec
from epp.datastore.kv_block_index import KVBlockIndex
from epp.datastore.kv_events_config import KVEventsConfig
from tests.precise.helpers import MODEL_DIR, decoded, frames, kvreq_prompt
from tests.precise.publisher import Publisher, Removed, Stored, batch

ADDRESS = "127.0.0.1:8200"
TOPIC = f"kv@{ADDRESS}@tiny"


def keys(index: KVBlockIndex, k: int = 0) -> list[int]:
    ids = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(kvreq_prompt(k)).ids
    return index.keys_for(ids)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def datastore(*addresses: str) -> Datastore:
    ds = Datastore()
    for a in addresses:
        ip, port = a.rsplit(":", 1)
        ds.upsert(EndpointSpec(f"pod-{port}", ip, int(port)))
    return ds


async def test_central_mode_replays_the_captured_stream() -> None:
    ds = datastore(ADDRESS)
    index = KVBlockIndex(64)
    sub = KVEventSubscriber(index, ds, KVEventsConfig(zmq_endpoint="tcp://127.0.0.1:0", discover_pods=False))
    await sub.start()
    pub = Publisher(sub.bound_endpoint, TOPIC)  # connect mode, like vLLM given a host address
    try:
        captured = frames()
        # ZMQ's slow joiner: resend the first batch until the SUB is connected (the same seq: a duplicate
        # of a live message would be a restart, so resend with the socket's own number only once seen).
        while not index.has_events(ADDRESS):
            pub.send(captured[0][2], seq=0)
            await asyncio.sleep(0.02)
        for _, _, payload in captured[1:10]:
            pub.send(payload)
        await until(lambda: sub.stats.messages >= 10)
        assert index.match(keys(index, 0)).matched == {ADDRESS: 6}
        assert index.match(keys(index, 1)).matched == {ADDRESS: 6}
        for _, _, payload in captured[10:]:
            pub.send(payload)
        await until(lambda: index.stats.resets.get("cleared") == 1)
        assert index.size == 0
        assert sub.stats.gaps == 0 and sub.stats.decode_errors == 0
        removed = sum(1 for b in decoded() for e in b["payload"]["events"] if e["type"] == "BlockRemoved")
        assert sub.stats.events["BlockRemoved"] == removed and sub.stats.lag_count >= 15
    finally:
        pub.close()
        await sub.stop()


async def test_central_mode_warns_about_topics_naming_no_endpoint(caplog: pytest.LogCaptureFixture) -> None:
    ds = datastore(ADDRESS)
    index = KVBlockIndex(64)
    sub = KVEventSubscriber(index, ds, KVEventsConfig(zmq_endpoint="tcp://127.0.0.1:0", discover_pods=False,
                                                      topic_filter=""))
    await sub.start()
    pub = Publisher(sub.bound_endpoint, "kv-events")  # the capture's topic: names no endpoint
    try:
        with caplog.at_level(logging.WARNING, logger="epp.datalayer.kvevents"):
            while sub.stats.unknown_topic_messages < 3:
                pub.send(frames()[0][2])
                await asyncio.sleep(0.02)
            pub.send(frames()[0][2], topic=b"kv@10.9.9.9:8000@tiny")  # a pod discovery does not know
            await until(lambda: len(sub._warned_topics) == 2)
        assert index.size == 0
        assert sub.stats.warnings["unknown_topic"] == 2  # once per distinct topic, not per message
        assert any("names no known endpoint" in r.message for r in caplog.records)
    finally:
        pub.close()
        await sub.stop()


async def test_discovery_mode_catches_up_by_replay_then_follows_the_endpoint_set() -> None:
    pub = Publisher("tcp://127.0.0.1:0", "", replay_endpoint="tcp://127.0.0.1:0")  # vLLM's default: bind, topic ""
    ds = datastore()
    index = KVBlockIndex(64)
    config = KVEventsConfig(topic_filter="", discover_pods=True,
                            sockets=KVEventsConfig().sockets.__class__(offset=pub.port - 8200),
                            replay=KVEventsConfig().replay.__class__(offset=pub.replay_port - 8200))
    sub = KVEventSubscriber(index, ds, config)
    await sub.start()
    try:
        for _, _, payload in frames()[:3]:
            pub.send(payload)  # published before anyone listens: lost on the PUB socket
        ds.upsert(EndpointSpec("pod", "127.0.0.1", 8200))  # discovery adds the endpoint: one SUB for it
        extra = batch(Stored([7], None, list(range(128)), 128))
        while sub.stats.messages == 0:
            pub.send(extra)
            await asyncio.sleep(0.05)
        await until(lambda: sub.stats.replays.get("complete", 0) >= 1)
        assert pub.replays >= 1
        assert index.match(keys(index, 0)).matched == {ADDRESS: 6}  # seq 0-2 came through the replay
        ds.remove(ADDRESS)
        await until(lambda: ADDRESS not in sub._tasks)
        assert index.endpoints() == [] and index.size == 0
    finally:
        pub.close()
        await sub.stop()


async def test_gap_is_replayed_and_unreplayable_gaps_and_restarts_reset() -> None:
    pub = Publisher("tcp://127.0.0.1:0", TOPIC, replay_endpoint="tcp://127.0.0.1:0")
    ds = datastore(ADDRESS)
    index = KVBlockIndex(64)
    config = KVEventsConfig(discover_pods=True,
                            sockets=KVEventsConfig().sockets.__class__(endpoints={ADDRESS: pub.endpoint}),
                            replay=KVEventsConfig().replay.__class__(endpoints={ADDRESS: pub.replay_endpoint}))
    sub = KVEventSubscriber(index, ds, config)
    await sub.start()
    try:
        ids = list(range(512))
        while not index.has_events(ADDRESS):
            pub.send(batch(Stored([1], None, ids[:128], 128)), seq=0)
            await asyncio.sleep(0.02)
        pub.seq = 1
        pub.buffer.clear()
        pub.buffer.append((0, batch(Stored([1], None, ids[:128], 128))))
        # seq 1 is lost on the wire (kept for replay), seq 2 arrives: a gap, replayed.
        pub.send(batch(Stored([2], 1, ids[128:256], 128)), record=True, seq=1)
        await until(lambda: sub.stats.messages >= 2)
        lost = batch(Stored([3], 2, ids[256:384], 128))
        pub.buffer.append((2, lost))
        pub.seq = 3
        pub.send(batch(Stored([4], 3, ids[384:512], 128)))
        await until(lambda: sub.stats.gaps == 1 and sub.stats.replays.get("complete", 0) >= 1)
        assert index.match(index.keys_for(ids)).matched == {ADDRESS: 8}
        # A gap the publisher cannot replay (its buffer no longer has it): the endpoint is reset.
        pub.buffer.clear()
        pub.seq = 10
        pub.send(batch(Removed([4])))
        await until(lambda: index.stats.resets.get("gap") == 1)
        assert index.match(index.keys_for(ids)).matched == {}
        pub.send(batch(Stored([1], None, ids[:128], 128)))
        await until(lambda: index.size == 2)
        # The engine restarts: its numbers start again at 0, its cache is empty.
        pub.seq = 0
        pub.send(batch(Stored([9], None, ids[:128], 128)))
        await until(lambda: sub.stats.restarts == 1)
        assert index.stats.resets.get("restart") == 1
        assert index.size == 2  # only what the restarted engine stored since
    finally:
        pub.close()
        await sub.stop()


async def test_silent_endpoints_and_a_precise_index_that_never_matches_are_loud(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    ds = Datastore(clock=lambda: now[0])
    ds.upsert(EndpointSpec("pod", "127.0.0.1", 8200))
    index = KVBlockIndex(64)
    sub = KVEventSubscriber(index, ds, KVEventsConfig(zmq_endpoint="tcp://127.0.0.1:0", discover_pods=False,
                                                      silent_after=30.0), watchdog_interval=3600)
    await sub.start()
    try:
        with caplog.at_level(logging.WARNING, logger="epp.datalayer.kvevents"):
            sub.check()
            assert sub.stats.silent_endpoints == 0
            now[0] += 31
            for _ in range(12):
                index.match([1, 2, 3], now[0])
            sub.check()
            sub.check()
        assert sub.stats.silent_endpoints == 1
        assert sub.stats.warnings == {"silent_endpoint": 1, "no_match": 1}  # each once, not per check
        messages = " ".join(r.message for r in caplog.records)
        assert "has sent no KV event" in messages and "matched no block" in messages
    finally:
        await sub.stop()


async def test_garbage_messages_are_counted_and_dropped() -> None:
    ds = datastore(ADDRESS)
    index = KVBlockIndex(64)
    sub = KVEventSubscriber(index, ds, KVEventsConfig(zmq_endpoint="tcp://127.0.0.1:0", discover_pods=False))
    await sub.start()
    pub = Publisher(sub.bound_endpoint, TOPIC)
    try:
        while sub.stats.decode_errors < 3:
            pub.send(b"\xc1 not msgpack")
            pub.pub.send_multipart([TOPIC.encode(), b"short"])
            await asyncio.sleep(0.02)
        assert sub.stats.messages == 0 and index.size == 0
    finally:
        pub.close()
        await sub.stop()


def test_a_non_finite_batch_timestamp_is_not_a_lag() -> None:
    """A pod's batch stamped -inf (or NaN) would have held the lag histogram's sum at infinity."""
    stats = SubscriberStats()
    for lag in (float("inf"), float("-inf"), float("nan"), 0.002):
        stats.observe_lag(lag)
    assert stats.lag_count == 1 and stats.lag_sum == 0.002
    for _ in range(3):  # stamps of -1e308: finite lags whose sum is not
        stats.observe_lag(1e308)
    assert stats.lag_count == 4 and stats.lag_sum == 0.002 + 3 * MAX_LAG and stats.lag_buckets[-1] == 3
