"""One process's link to its pod's shared state: the table, its ring, the others' rings.

A pod's shared directory holds the table (`table`) and one prefix ring per member
(`ring-<member>`). Members are numbered: the request-path workers first, then the flow-control
dispatcher (when flow control is configured), then the replica link (with `--replicas-url`).
`Member.install` hooks a built core into it: the director's `shared` hooks, and the approximate
prefix producers' indexes replaced by broadcasting ones (before any traffic, while empty).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from epp.core import Core
from epp.datastore import Endpoint
from epp.scale import table as t
from epp.scale.peers import SharedLoad
from epp.scale.prefix import PrefixSync, SharedPrefixIndex
from epp.scale.ring import Ring
from epp.scale.table import SharedTable, TableSpec
from epp.scheduling.plugins.approx_prefix_cache_producer import ApproxPrefixCacheProducer

log = logging.getLogger("epp.scale")


@dataclass(slots=True, frozen=True)
class PodLayout:
    """What every process of the pod needs to map its shared state."""

    directory: str
    workers: int
    dispatcher: bool = False
    replica_link: bool = False
    capacity: int = 1024
    ring_bytes: int = 4 << 20

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
    def table(self) -> TableSpec:
        return TableSpec(self.directory, self.capacity, self.members)

    def ring_path(self, member: int) -> Path:
        return Path(self.directory) / f"ring-{member}"

    def create(self) -> None:
        """Create the files (the supervisor, once, before any member starts)."""
        SharedTable(self.table, create=True).close()
        for member in range(self.members):
            Ring(self.ring_path(member), self.ring_bytes, create=True).close()


class Member:
    def __init__(self, layout: PodLayout, member: int, core: Core) -> None:
        self.layout = layout
        self.member = member
        self.core = core
        self.table = SharedTable(layout.table)
        self.rings = {m: Ring(layout.ring_path(m), layout.ring_bytes) for m in range(layout.members)}
        self.load = SharedLoad(self.table, member, core.datastore)
        self.indexes: list[SharedPrefixIndex] = []
        self.prefix: PrefixSync | None = None
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
        self.table.set_status(self.member, t.HEARTBEAT, time.time())

    # -- the director's hooks (`SharedAccounting`) --

    def refresh(self) -> None:
        if self.prefix is not None:
            self.prefix.drain()
        self.load.refresh()

    def changed(self, endpoint: Endpoint) -> None:
        self.load.changed(endpoint)

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
                self.refresh()
                self.load.publish_all()
                self.table.set_status(self.member, t.HEARTBEAT, time.time())
                self.table.set_status(self.member, t.SYNCED, float(self.core.datastore.synced))
            except Exception:  # never stop the timer: a stale view would follow
                log.exception("shared state refresh failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.core.director.shared = None
        self.load.stop()

    def close(self) -> None:
        self.table.close()
        for ring in self.rings.values():
            ring.close()
