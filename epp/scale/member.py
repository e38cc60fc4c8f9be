"""One process's link to its pod's shared state: the table and the prefix rings, in one segment.

A pod's shared segment (`epp.shm.Segment`, created by the supervisor) holds the table and one
prefix ring per member. Members are numbered: the request-path workers first, then the
flow-control dispatcher (when flow control is configured), then the replica link (with
`--replicas-url`). `Member.install` hooks a built core into it: the director's `shared` hooks, and
the approximate prefix producers' indexes replaced by broadcasting ones (before any traffic,
while they are empty).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily

from epp.core import Core
from epp.datastore import Endpoint
from epp.scale import table as t
from epp.scale.peers import SharedLoad
from epp.scale.prefix import PrefixSync, SharedPrefixIndex
from epp.scale.ring import Ring
from epp.scale.observe import Relay
from epp.scale.table import SharedTable
from epp.scheduling.plugins.approx_prefix_cache_producer import ApproxPrefixCacheProducer
from epp.shm import Segment

log = logging.getLogger("epp.scale")


@dataclass(slots=True, frozen=True)
class PodLayout:
    """What every process of the pod needs to map its shared state (picklable: it is handed to
    each process the supervisor starts)."""

    segment: str  # the segment's name
    workers: int
    dispatcher: bool = False
    replica_link: bool = False
    capacity: int = 1024  # endpoints
    ring_bytes: int = 1 << 20  # per member: ~1,000 picks of 1k-token prompts; readers drain it every pick

    @property
    def members(self) -> int:
        return self.workers + int(self.dispatcher) + int(self.replica_link)

    @property
    def dispatcher_member(self) -> int:
        return self.workers if self.dispatcher else -1

    @property
    def link_member(self) -> int:
        return self.members - 1 if self.replica_link else -1

    @property
    def size(self) -> int:
        return SharedTable.size(self.capacity, self.members) + self.members * Ring.footprint(self.ring_bytes)

    @staticmethod
    def create(workers: int, *, dispatcher: bool = False, replica_link: bool = False, capacity: int = 1024,
               ring_bytes: int = 1 << 20) -> tuple[PodLayout, Segment]:
        """A new segment for a pod (the supervisor's; it owns it and removes it on close)."""
        probe = PodLayout("", workers, dispatcher, replica_link, capacity, ring_bytes)
        segment = Segment.create(probe.size, prefix="epp-pod")
        return PodLayout(segment.name, workers, dispatcher, replica_link, capacity, ring_bytes), segment


class PodState:
    """The table and rings mapped in this process."""

    def __init__(self, layout: PodLayout, segment: Segment | None = None) -> None:
        self.layout = layout
        self.segment = segment or Segment.attach(layout.segment)
        self._attached = segment is None
        buf = self.segment.buf
        self.table = SharedTable(buf, layout.capacity, layout.members, lock_path=self.segment.path)
        offset = SharedTable.size(layout.capacity, layout.members)
        self.rings: dict[int, Ring] = {}
        for member in range(layout.members):
            self.rings[member] = Ring(buf, layout.ring_bytes, offset)
            offset += Ring.footprint(layout.ring_bytes)

    def close(self) -> None:
        self.table.release()
        for ring in self.rings.values():
            ring.release()
        if self._attached:
            self.segment.close()


class Member:
    def __init__(self, state: PodState, member: int, core: Core) -> None:
        self.state = state
        self.member = member
        self.core = core
        self.table = state.table
        self.rings = state.rings
        self.load = SharedLoad(self.table, member, core.datastore)
        self.indexes: list[SharedPrefixIndex] = []
        self.prefix: PrefixSync | None = None
        self.relay: Relay | None = None  # set by the runner: observer streams for other workers' picks
        self._task: asyncio.Task[None] | None = None

    def install(self) -> None:
        own = self.rings[self.member]
        for plugin in self.core.config.plugins.values():
            if isinstance(plugin, ApproxPrefixCacheProducer):
                plugin.index = SharedPrefixIndex(plugin.name, own.append)
                self.indexes.append(plugin.index)
        store = self.core.datastore
        others = [ring for m, ring in self.rings.items() if m != self.member]
        self.prefix = PrefixSync(self.indexes, others, lambda address: store.get(address) is not None)
        self.load.start()
        self.core.director.shared = self
        self.table.set_status(self.member, t.PID, os.getpid())
        self.table.set_status(self.member, t.HEARTBEAT_MS, int(time.time() * 1000))

    # -- the director's hooks (`SharedAccounting`) --

    def refresh(self) -> None:
        """Before a pick (and on the timer): the others' prefix picks and accounting."""
        self.drain()
        self.count_pick()

    def drain(self) -> None:
        if self.prefix is not None:
            self.prefix.drain()
        self.load.refresh()

    def count_pick(self) -> None:
        self.table.set_status(self.member, t.PICKS, self.table.status(self.member, t.PICKS) + 1)

    def changed(self, endpoint: Endpoint) -> None:
        self.load.changed(endpoint)

    def collect(self) -> Iterator[CounterMetricFamily]:
        """`inference_extension_prefix_sync_records_total{outcome}`: the other writers' prefix
        records this process applied, lost (a ring lapped it) or could not decode; the pod's
        /metrics adds the workers' up."""
        family = CounterMetricFamily("inference_extension_prefix_sync_records",
                                     "Prefix-index records of the pod's other writers (workers, other replicas) "
                                     "by outcome: applied, lost (this reader was lapped), malformed.",
                                     labels=["outcome"])
        sync = self.prefix
        if sync is not None:
            family.add_metric(["applied"], float(sync.applied))
            family.add_metric(["lost"], float(sync.lost))
            family.add_metric(["malformed"], float(sync.malformed))
        yield family
        relay = self.relay
        if relay is not None:
            relayed = CounterMetricFamily("inference_extension_observer_relays",
                                          "Observations relayed between the pod's workers (an observer stream that "
                                          "landed on another worker than its pick's): sent, received, dropped.",
                                          labels=["direction"])
            relayed.add_metric(["sent"], float(relay.sent))
            relayed.add_metric(["received"], float(relay.received))
            relayed.add_metric(["dropped"], float(relay.dropped))
            yield relayed

    # -- status the supervisor reads --

    def set_started(self, metrics_port: int, admin_port: int) -> None:
        self.table.set_status(self.member, t.METRICS_PORT, metrics_port)
        self.table.set_status(self.member, t.ADMIN_PORT, admin_port)
        self.table.set_status(self.member, t.STARTED, 1)

    @property
    def pod_ready(self) -> bool:
        return self.table.pod_ready

    # -- the timer: an idle process stays current, a busy one's queued prefill stays fresh --

    async def start(self, tick: float) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(tick), name="shared-state")

    async def _run(self, tick: float) -> None:
        while True:
            await asyncio.sleep(tick)
            try:
                self.drain()
                self.load.publish_all()
                self.table.set_status(self.member, t.HEARTBEAT_MS, int(time.time() * 1000))
                self.table.set_status(self.member, t.SYNCED, int(self.core.datastore.synced))
            except Exception:  # never stop the timer: a stale view would follow
                log.exception("shared state refresh failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.core.director.shared = None
        self.load.stop()


@dataclass(slots=True, frozen=True)
class PodRole:
    """A process's place in a multi-process pod (`epp serve --workers N`), set by the supervisor."""

    layout: PodLayout
    member: int
    dispatcher: bool = False  # this process holds the pod's flow-control queues
    dispatch_socket: str = ""  # where the dispatcher listens (flow control on); "" otherwise
    grpc_port: int = 0  # the pod's ext_proc port, shared by the workers (SO_REUSEPORT)
    board: str = ""  # the pod's metrics board (its supervisor's scraper); "": the member scrapes itself
    directory: str = ""  # the pod's private directory: the workers' observation sockets
