"""Active-active replicas: EPP pods that share in-flight counts and prefix picks through Redis/Valkey.

Never on the pick path. The link is a background task of the pod (its supervisor, or the one
process of a single-process EPP) and a member of the pod's shared table like any worker:

- out: every `flush_interval` it adds up the pod's own rows (its workers' and dispatcher's
  in-flight counts and ledger sums; never what it received) for the endpoints that moved and
  publishes them on `<channel>:load`, with a full snapshot every `heartbeat`; it drains the
  workers' prefix rings and publishes their records on `<channel>:prefix`;
- in: what the other replicas publish it keeps per replica, and writes their sum into its own rows
  of the table, and their prefix records into its own ring — so the workers fold them in before
  each pick exactly as they fold each other's.

Snapshots rather than deltas: a lost or late message is corrected by the next, and a replica that
stops publishing (it died, or lost Redis) is forgotten after `peer_ttl` — its in-flight counts
leave the view; one that stops cleanly says goodbye and is forgotten at once. Pub/sub is
at-most-once, which is what an approximate prefix index and a load estimate can live with; while
Redis is unreachable each replica simply routes on its own view (and retries, with backoff).
The precise prefix index needs nothing from here: every replica reads the pods' KV events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge

from epp.datastore.load import RATE_WINDOW
from epp.scale import table as t
from epp.scale.ring import RingReader

if TYPE_CHECKING:
    from epp.config.options import Options
    from epp.scale.member import PodState

log = logging.getLogger("epp.scale.replicas")

# What a replica shares per endpoint: the table's sums up to the rates (no service-model fit: each
# replica learns its pods from its own traffic).
_SHARED = t.RATES_AT  # fields [0, RATES_AT) ; the four rates are sent as of the moment of sending
_MAX_MESSAGE = 256 << 10
_PEER_RATES_HISTORY = 10 * RATE_WINDOW  # seconds
_SLOTS_PERIOD = 0.25  # seconds between two reads of the table's endpoint names


@dataclass(slots=True, frozen=True)
class ReplicaSettings:
    url: str
    channel: str  # prefix of this pool's channels
    replica_id: str
    peer_ttl: float = 3.0
    heartbeat: float = 1.0
    flush_interval: float = 0.005


def replica_settings(options: Options) -> ReplicaSettings:
    pool = f"{options.pool_namespace or os.environ.get('NAMESPACE', 'default')}/{options.pool_name or 'pool'}"
    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
    return ReplicaSettings(url=options.replicas_url, channel=options.replicas_channel or f"epp:{pool}",
                           replica_id=identity, peer_ttl=options.replicas_peer_ttl,
                           heartbeat=min(1.0, options.replicas_peer_ttl / 3))


class LoadMessage(msgspec.Struct, array_like=True):
    replica: str
    full: bool  # a snapshot of every endpoint (else only those that moved); empty and full: goodbye
    endpoints: dict[str, list[float]]


class PrefixMessage(msgspec.Struct, array_like=True):
    replica: str
    records: list[bytes]  # `epp.scale.prefix` records, as the rings hold them


@dataclass(slots=True)
class _Peer:
    seen: float  # local monotonic time of its last message
    endpoints: dict[str, list[float]] = field(default_factory=dict)  # rates as of `at[address]`
    at: dict[str, float] = field(default_factory=dict)
    warned_layout: bool = False  # said once that its rows are of another version's layout


class ReplicaLink:
    def __init__(self, state: PodState, settings: ReplicaSettings, clock: Callable[[], float] = time.monotonic, *,
                 registry: CollectorRegistry | None = None) -> None:
        layout = state.layout
        if layout.link_member < 0:
            raise ValueError("the pod's layout has no replica link member")
        self.settings = settings
        self.clock = clock
        self.table = state.table
        self.member = layout.link_member
        self.local = [m for m in range(layout.members) if m != self.member]
        self.ring = state.rings[self.member]  # the other replicas' prefix records, for the workers
        self.readers = [RingReader(state.rings[m]) for m in self.local]
        self._slots: dict[str, int] = {}  # address -> slot this link marked
        self._known: dict[str, int] = {}  # the table's named slots, re-read every `_SLOTS_PERIOD`
        self._known_at = -math.inf
        self._versions: dict[tuple[int, int], int] = {}  # (member, slot) -> version last published
        self._sequences: dict[int, tuple[int, int]] = {}
        self._sent: dict[str, list[float]] = {}
        self._last_full = 0.0
        self.peers: dict[str, _Peer] = {}
        self._client: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._load_channel = f"{settings.channel}:load"
        self._prefix_channel = f"{settings.channel}:prefix"
        registry = registry if registry is not None else CollectorRegistry()
        self._up = Gauge("inference_extension_replica_link_up", "1 while this replica reaches Redis/Valkey "
                         "(sharing in-flight counts and prefix picks with the other replicas).", registry=registry)
        self._peers = Gauge("inference_extension_replica_peers", "Other EPP replicas heard from within the "
                            "peer TTL.", registry=registry)
        self._messages = Counter("inference_extension_replica_messages", "Messages exchanged with the other "
                                 "replicas, by direction (sent, received) and kind (load, prefix).",
                                 ["direction", "kind"], registry=registry)
        self._expired = Counter("inference_extension_replica_peers_expired", "Replicas forgotten because they "
                                "were not heard from within the peer TTL (their in-flight counts with them).",
                                registry=registry)

    # -- lifecycle --

    async def start(self) -> None:
        import redis.asyncio as aioredis

        self._client = aioredis.from_url(self.settings.url, socket_connect_timeout=2, socket_timeout=5,
                                         health_check_interval=10)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._publish_loop(), name="replicas-out"),
                       loop.create_task(self._subscribe_loop(), name="replicas-in")]
        log.info("replica link started", extra={"channel": self.settings.channel, "replica": self.settings.replica_id})

    async def stop(self) -> None:
        """Bounded: a Redis that stopped answering must not hold up a replica's shutdown."""
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._client is not None:
            with contextlib.suppress(Exception):  # goodbye: the others forget our counts now
                async with asyncio.timeout(1.0):
                    await self._client.publish(self._load_channel, msgspec.msgpack.encode(
                        LoadMessage(self.settings.replica_id, True, {})))
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._client.aclose()
            self._client = None

    # -- out --

    async def _publish_loop(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._publish_once()
                self._up.set(1)
                backoff = 0.1
                await asyncio.sleep(self.settings.flush_interval)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._up.set(0)
                log.warning("replica link: publishing failed (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)
            self._expire()

    async def _publish_once(self) -> None:
        records: list[bytes] = []
        size = 0
        for reader in self.readers:
            for payload in reader.read():
                records.append(payload)
                size += len(payload)
                if size > _MAX_MESSAGE:
                    await self._send_prefix(records)
                    records, size = [], 0
        if records:
            await self._send_prefix(records)
        now = self.clock()
        full = now - self._last_full >= self.settings.heartbeat
        moved = self._own_load(now, full)
        if moved or full:
            await self._client.publish(self._load_channel, msgspec.msgpack.encode(
                LoadMessage(self.settings.replica_id, full, moved)))
            self._messages.labels("sent", "load").inc()
            if full:
                self._last_full = now

    async def _send_prefix(self, records: list[bytes]) -> None:
        await self._client.publish(self._prefix_channel, msgspec.msgpack.encode(
            PrefixMessage(self.settings.replica_id, records)))
        self._messages.labels("sent", "prefix").inc()

    def _own_load(self, now: float, full: bool) -> dict[str, list[float]]:
        """The pod's own sums (its local members' rows) for the endpoints that moved since the last
        publication (all of them when `full`); rates as of `now`."""
        table = self.table
        sequences = {m: table.sequence(m) for m in self.local}
        if not full and sequences == self._sequences:
            return {}
        self._sequences = sequences
        out: dict[str, list[float]] = {}
        for address, slot in self._endpoints(now).items():
            versions = [table.version(m, slot) for m in self.local]
            if not full and all(self._versions.get((m, slot)) == v for m, v in zip(self.local, versions)):
                continue
            total = [0.0] * _SHARED
            for m, version in zip(self.local, versions):
                self._versions[(m, slot)] = version
                row = table.read(m, slot)
                for i in range(t.PICK_RATE):
                    total[i] += row[i]
                if row[t.RATES_AT] > 0:
                    decay = math.exp(-max(0.0, now - row[t.RATES_AT]) / RATE_WINDOW)
                    total[t.PICK_RATE] += row[t.PICK_RATE] * decay
                    total[t.WORK_RATE] += row[t.WORK_RATE] * decay
                    total[t.PREFILL_RATE] += row[t.PREFILL_RATE] * decay
                    total[t.KV_RATE] += row[t.KV_RATE] * decay
            if full or total != self._sent.get(address):
                out[address] = total
                self._sent[address] = total
        return out

    # -- in --

    async def _subscribe_loop(self) -> None:
        backoff = 0.1
        while True:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._load_channel, self._prefix_channel)
                backoff = 0.1
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._received(message["channel"], message["data"])
                    self._expire()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._up.set(0)
                log.warning("replica link: subscription failed (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()

    def _received(self, channel: bytes | str, data: bytes) -> None:
        channel = channel.decode() if isinstance(channel, bytes) else channel
        try:
            if channel == self._prefix_channel:
                prefix = msgspec.msgpack.decode(data, type=PrefixMessage)
                if prefix.replica != self.settings.replica_id:
                    for record in prefix.records:
                        self.ring.append(record)
                    self._messages.labels("received", "prefix").inc()
                return
            load = msgspec.msgpack.decode(data, type=LoadMessage)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("replica link: ignored a malformed message on %s: %s", channel, exc)
            return
        if load.replica == self.settings.replica_id:
            return
        self._messages.labels("received", "load").inc()
        now = self.clock()
        if load.full and not load.endpoints:  # goodbye
            self._forget(load.replica)
            return
        peer = self.peers.get(load.replica)
        if peer is None:
            peer = self.peers[load.replica] = _Peer(now)
            log.info("replica link: a new replica", extra={"replica": load.replica})
        peer.seen = now
        if load.full:
            peer.endpoints.clear()
            peer.at.clear()
        for address, values in load.endpoints.items():
            if len(values) != _SHARED and not peer.warned_layout:
                # Another version's table layout (a rolling upgrade): its counts cannot be added
                # to ours field by field, so they are left out until it runs this version.
                peer.warned_layout = True
                log.warning("replica link: a replica sends %d fields per endpoint, this version %d; "
                            "its in-flight counts are ignored until both run the same version",
                            len(values), _SHARED, extra={"replica": load.replica})
            if (len(values) == _SHARED and all(math.isfinite(v) and v >= 0 for v in values)
                    and len(address) <= t.MAX_ADDRESS_BYTES
                    and (address in peer.endpoints or len(peer.endpoints) < self.table.capacity)):
                peer.endpoints[address] = values
                peer.at[address] = now
        self._write(set(load.endpoints) | (set(self._slots) if load.full else set()))
        self._peers.set(len(self.peers))

    def _expire(self) -> None:
        deadline = self.clock() - self.settings.peer_ttl
        for replica in [r for r, p in self.peers.items() if p.seen < deadline]:
            log.warning("replica link: a replica went silent; its in-flight counts are forgotten",
                        extra={"replica": replica})
            self._expired.inc()
            self._forget(replica)

    def _forget(self, replica: str) -> None:
        peer = self.peers.pop(replica, None)
        if peer is not None:
            self._write(set(peer.endpoints))
        self._peers.set(len(self.peers))

    def _write(self, addresses: set[str]) -> None:
        """This link's rows: the other replicas' sums per endpoint, as of now."""
        now = self.clock()
        for address in addresses:
            total = [0.0] * t.F
            for peer in self.peers.values():
                values = peer.endpoints.get(address)
                if values is None:
                    continue
                decay = math.exp(-max(0.0, now - peer.at[address]) / RATE_WINDOW)
                for i in range(t.PICK_RATE):
                    total[i] += values[i]
                total[t.PICK_RATE] += values[t.PICK_RATE] * decay
                total[t.WORK_RATE] += values[t.WORK_RATE] * decay
                total[t.PREFILL_RATE] += values[t.PREFILL_RATE] * decay
                total[t.KV_RATE] += values[t.KV_RATE] * decay
            total[t.RATES_AT] = now
            # Other replicas send their rates without their history: taken as a whole window's
            # (a replica joining a running pool must not read them several times too high).
            total[t.RATES_AGE] = _PEER_RATES_HISTORY
            slot = self._slots.get(address)
            if slot is None:
                if address not in self._endpoints(now):  # no local member has it (yet, or any more)
                    continue
                slot = self._slots[address] = self.table.claim(self.member, address)
            self.table.write(self.member, slot, total)

    def _endpoints(self, now: float) -> dict[str, int]:
        """The pod's endpoints (address -> slot) its local members use, re-read now and then; the
        link gives back the slots of endpoints they all dropped."""
        if now - self._known_at >= _SLOTS_PERIOD:
            self._known_at = now
            table = self.table
            self._known = {a: s for a, s in table.slots().items() if any(table.marked(m, s) for m in self.local)}
            for address in [a for a in self._slots if a not in self._known]:
                table.give_back(self.member, self._slots.pop(address))
        return self._known
