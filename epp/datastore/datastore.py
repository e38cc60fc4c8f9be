"""The single source of truth every decision reads: endpoints, their metrics, objectives.

Discovery and the data layer write it; flow control and scheduling read it. It does no I/O and
imports nothing of ours beyond `endpoint`, so the simulator can drive it on a virtual clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from epp.datastore.endpoint import Endpoint, EndpointSpec
from epp.datastore.model_stats import ModelStatsTable
from epp.datastore.ttft_tail import TtftTail

Listener = Callable[[Endpoint], None]


@dataclass(slots=True)
class PoolInfo:
    name: str = ""
    namespace: str = ""
    target_ports: tuple[int, ...] = ()
    app_protocol: str = "http"


class Datastore:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.pool = PoolInfo()
        self.synced = False  # discovery has listed the pool at least once
        self._endpoints: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] = ()
        self._objectives: dict[str, int | None] = {}
        self.models = ModelStatsTable()  # learned per target model from responses
        self.ttft_tail = TtftTail()  # the pool's slowest first tokens lately (`predicted-latency-producer`)
        self._on_add: list[Listener] = []
        self._on_remove: list[Listener] = []

    # -- listeners (the data layer starts/stops scrapers; plugins drop per-endpoint state) --

    def subscribe(self, on_add: Listener | None = None, on_remove: Listener | None = None) -> None:
        if on_add:
            self._on_add.append(on_add)
            for ep in self._snapshot:
                on_add(ep)
        if on_remove:
            self._on_remove.append(on_remove)

    def unsubscribe(self, on_add: Listener | None = None, on_remove: Listener | None = None) -> None:
        if on_add in self._on_add:
            self._on_add.remove(on_add)
        if on_remove in self._on_remove:
            self._on_remove.remove(on_remove)

    # -- endpoints --

    def endpoints(self) -> tuple[Endpoint, ...]:
        """All endpoints, as an immutable tuple that later changes do not touch."""
        return self._snapshot

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)

    def upsert(self, spec: EndpointSpec) -> Endpoint:
        current = self._endpoints.get(spec.address)
        if current is not None:
            if current.spec == spec:
                return current
            if current.spec.metrics_port == spec.metrics_port and current.spec.engine == spec.engine:
                current.spec = spec  # same scrape target: keep metrics and in-flight counts
                current.labels = dict(spec.labels)
                return current
            self.remove(spec.address)
        endpoint = Endpoint(spec)
        self._endpoints[spec.address] = endpoint
        self._snapshot = tuple(self._endpoints.values())
        for listener in self._on_add:
            listener(endpoint)
        return endpoint

    def remove(self, address: str) -> None:
        endpoint = self._endpoints.pop(address, None)
        if endpoint is None:
            return
        self._snapshot = tuple(self._endpoints.values())
        for listener in self._on_remove:
            listener(endpoint)

    def replace_all(self, specs: Iterable[EndpointSpec]) -> None:
        """Make the endpoint set exactly `specs` (a full relist)."""
        wanted = {spec.address: spec for spec in specs}
        for address in [a for a in self._endpoints if a not in wanted]:
            self.remove(address)
        for spec in wanted.values():
            self.upsert(spec)

    def clear(self) -> None:
        self.replace_all(())

    # -- objectives (priority per InferenceObjective name) --

    def set_objective(self, name: str, priority: int | None) -> None:
        self._objectives[name] = priority

    def delete_objective(self, name: str) -> None:
        self._objectives.pop(name, None)

    def objective_priority(self, name: str) -> int:
        """Priority of a named objective; unknown or unset means 0, as in the reference."""
        return self._objectives.get(name) or 0

    def objectives(self) -> dict[str, int | None]:
        return dict(self._objectives)
