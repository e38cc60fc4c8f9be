"""Endpoints from Kubernetes: one InferencePool, the ready pods it selects, its objectives.

Three informers feed this class on the event loop:
- the InferencePool (field selector `metadata.name=<pool>`): its selector and target ports;
- the pods matching the pool's selector (server-side label selector), restarted when the
  selector changes;
- InferenceObjectives, only when their CRD is served (checked once through API discovery).

Rules, as the reference EPP: only ready pods without a deletionTimestamp are endpoints, one per
target port (`<pod>-rank-<i>` with several); a pod going unready leaves the datastore on that very
event; a deleted pool empties the datastore and reports not-synced (so readiness fails) until it
is back. In standalone mode (`--endpoint-selector`) there is no pool object: the selector and
ports come from flags and only pods are watched.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from epp.datastore import Datastore, EndpointSpec
from epp.discovery.base import Discovery
from epp.discovery.informer import DEFAULT_TUNING, Informer, WatchEvent, WatchTuning
from epp.discovery.kubeobjects import (
    OBJECTIVE_GROUP,
    OBJECTIVE_PLURAL,
    OBJECTIVE_VERSION,
    POOL_GROUP,
    POOL_PLURAL,
    POOL_VERSION,
    PoolSpec,
    name_of,
    objective_priority,
    parse_pool,
    pod_endpoints,
)

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger("epp.discovery")


class KubernetesDiscovery(Discovery):
    """A `Discovery` over the apiserver. Give `pool_name`, or `standalone` (a PoolSpec from flags)."""

    def __init__(self, api: ApiClient, namespace: str, *, pool_name: str = "", pool_group: str = POOL_GROUP,
                 standalone: PoolSpec | None = None, tuning: WatchTuning = DEFAULT_TUNING,
                 initial_sync_timeout: float = 30.0) -> None:
        if bool(pool_name) == bool(standalone):
            raise ValueError("give exactly one of a pool name or a standalone selector")
        self.api = api
        self.namespace = namespace
        self.pool_name = pool_name or (standalone.name if standalone else "")
        self.pool_group = pool_group
        self.standalone = standalone
        self.tuning = tuning
        self.initial_sync_timeout = initial_sync_timeout
        self.pool: PoolSpec | None = None
        self._datastore: Datastore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pods: dict[str, dict[str, Any]] = {}
        self._pod_addresses: dict[str, set[str]] = {}
        self._objectives: set[str] = set()
        self._pool_informer: Informer | None = None
        self._pod_informer: Informer | None = None
        self._objective_informer: Informer | None = None
        self._retired: list[Informer] = []
        self._first_listing = asyncio.Event()
        self._objectives_listed = asyncio.Event()
        self._stopped = False

    # -- Discovery --

    async def start(self, datastore: Datastore) -> None:
        self._datastore = datastore
        self._loop = asyncio.get_running_loop()
        datastore.pool.namespace = self.namespace
        datastore.pool.name = self.pool_name
        if self.standalone is not None:
            self._set_pool(self.standalone)
        else:
            from kubernetes.client import CustomObjectsApi

            custom = CustomObjectsApi(self.api)
            pools = functools.partial(custom.list_namespaced_custom_object, self.pool_group, POOL_VERSION,
                                      self.namespace, POOL_PLURAL)
            self._pool_informer = self._informer("inferencepool", pools, self._on_pool,
                                                 field_selector=f"metadata.name={self.pool_name}")
            if await asyncio.to_thread(self._objectives_served):
                objectives = functools.partial(custom.list_namespaced_custom_object, OBJECTIVE_GROUP,
                                               OBJECTIVE_VERSION, self.namespace, OBJECTIVE_PLURAL)
                self._objective_informer = self._informer("inferenceobjectives", objectives, self._on_objective)
            else:
                log.info("InferenceObjective CRD not installed; objectives are not watched")
        try:  # serve with the whole picture: endpoints, and priorities for every known objective
            async with asyncio.timeout(self.initial_sync_timeout):
                await self._first_listing.wait()
                if self._objective_informer is not None:
                    await self._objectives_listed.wait()
        except TimeoutError:
            log.warning("kubernetes discovery: no complete listing after %.0fs; not ready until one arrives",
                        self.initial_sync_timeout)

    async def stop(self) -> None:
        self._stopped = True
        informers = [i for i in (self._pool_informer, self._pod_informer, self._objective_informer) if i]
        informers += self._retired
        for informer in informers:
            informer.stop()
        await asyncio.gather(*(i.join() for i in informers))
        self._pool_informer = self._pod_informer = self._objective_informer = None
        self._retired.clear()

    # -- plumbing --

    def _informer(self, name: str, list_call: Callable[..., Any], handler: Callable[[WatchEvent], None], *,
                  label_selector: str = "", field_selector: str = "") -> Informer:
        assert self._loop is not None
        informer: Informer

        def deliver(event: WatchEvent) -> None:
            # Events already queued by an informer we replaced or stopped are stale: drop them.
            if not self._stopped and informer in (self._pool_informer, self._pod_informer, self._objective_informer):
                handler(event)

        informer = Informer(name, list_call, deliver, self._loop, label_selector=label_selector,
                            field_selector=field_selector, tuning=self.tuning)
        informer.start()
        return informer

    def _objectives_served(self) -> bool:
        """API discovery: is the InferenceObjective resource served? (Run in a thread.)"""
        from kubernetes.client import CustomObjectsApi

        try:
            resources = CustomObjectsApi(self.api).get_api_resources(OBJECTIVE_GROUP, OBJECTIVE_VERSION,
                                                                     _request_timeout=self.tuning.request_timeout)
        except Exception as exc:  # noqa: BLE001 - 404 (not installed) or unreachable: skip either way
            if getattr(exc, "status", None) != 404:
                log.warning("API discovery for %s/%s failed: %s", OBJECTIVE_GROUP, OBJECTIVE_VERSION, exc)
            return False
        return any(r.name == OBJECTIVE_PLURAL for r in resources.resources or [])

    @property
    def datastore(self) -> Datastore:
        assert self._datastore is not None
        return self._datastore

    # -- the pool --

    def _on_pool(self, event: WatchEvent) -> None:
        if event.type == "SYNC":
            obj = next((o for o in event.items if name_of(o) == self.pool_name), None)
        elif event.type == "DELETED":
            obj = None
        else:
            obj = event.obj
        if obj is None:
            self._pool_gone()
            return
        try:
            pool = parse_pool(obj)
        except ValueError as exc:
            log.warning("InferencePool %s/%s is not usable: %s", self.namespace, self.pool_name, exc)
            self._pool_gone()
            return
        self._set_pool(pool)

    def _pool_gone(self) -> None:
        if self.pool is not None:
            log.warning("InferencePool %s/%s is gone: no endpoints until it is back", self.namespace, self.pool_name)
        self.pool = None
        self._retire_pod_informer()
        self._pods.clear()
        self._pod_addresses.clear()
        self.datastore.clear()
        self.datastore.synced = False
        self._first_listing.set()  # we know the whole state: there is nothing to serve

    def _set_pool(self, pool: PoolSpec) -> None:
        previous, self.pool = self.pool, pool
        info = self.datastore.pool
        info.name, info.namespace = self.pool_name, self.namespace
        info.target_ports, info.app_protocol = pool.target_ports, pool.app_protocol
        if previous is None or previous.selector != pool.selector or self._pod_informer is None:
            log.info("watching pods %s in %s (ports %s)", pool.label_selector, self.namespace,
                     ",".join(map(str, pool.target_ports)))
            self._retire_pod_informer()
            from kubernetes.client import CoreV1Api

            pods = functools.partial(CoreV1Api(self.api).list_namespaced_pod, self.namespace)
            self._pod_informer = self._informer("pods", pods, self._on_pod, label_selector=pool.label_selector)
        elif previous != pool:
            self._rebuild()  # same pods, other ports: recompute every endpoint now

    def _retire_pod_informer(self) -> None:
        if self._pod_informer is not None:
            self._pod_informer.stop()
            self._retired.append(self._pod_informer)
            self._pod_informer = None
        self._retired = [i for i in self._retired if i.alive]

    # -- pods --

    def _on_pod(self, event: WatchEvent) -> None:
        if self.pool is None:
            return
        if event.type == "SYNC":
            self._pods = {name_of(p): p for p in event.items}
            self._rebuild()
            if not self.datastore.synced:
                log.info("InferencePool %s/%s synced: %d endpoints", self.namespace, self.pool_name,
                         len(self.datastore.endpoints()))
            self.datastore.synced = True
            self._first_listing.set()
            return
        name = name_of(event.obj)
        if event.type == "DELETED":
            self._pods.pop(name, None)
            self._apply_pod(name, [])
        else:
            self._pods[name] = event.obj
            self._apply_pod(name, pod_endpoints(event.obj, self.pool))

    def _apply_pod(self, name: str, specs: list[EndpointSpec]) -> None:
        wanted = {s.address for s in specs}
        if wanted != self._pod_addresses.get(name, set()):
            log.debug("pod %s/%s: endpoints %s", self.namespace, name, ",".join(sorted(wanted)) or "none")
        for address in self._pod_addresses.get(name, set()) - wanted:
            self.datastore.remove(address)
        for spec in specs:
            self.datastore.upsert(spec)
        if wanted:
            self._pod_addresses[name] = wanted
        else:
            self._pod_addresses.pop(name, None)

    def _rebuild(self) -> None:
        assert self.pool is not None
        self._pod_addresses.clear()
        specs: list[EndpointSpec] = []
        for name, pod in self._pods.items():
            mine = pod_endpoints(pod, self.pool)
            if mine:
                self._pod_addresses[name] = {s.address for s in mine}
                specs.extend(mine)
        self.datastore.replace_all(specs)

    # -- objectives --

    def _on_objective(self, event: WatchEvent) -> None:
        # Only objectives this discovery set are ever deleted: others (e.g. from a file) stay.
        if event.type == "SYNC":
            wanted: dict[str, int | None] = {}
            for obj in event.items:
                ours, priority = objective_priority(obj, self.pool_name, self.pool_group)
                if ours:
                    wanted[name_of(obj)] = priority
            for name in self._objectives - set(wanted):
                self.datastore.delete_objective(name)
            for name, priority in wanted.items():
                self.datastore.set_objective(name, priority)
            self._objectives = set(wanted)
            self._objectives_listed.set()
            return
        name = name_of(event.obj)
        ours, priority = objective_priority(event.obj, self.pool_name, self.pool_group)
        if event.type != "DELETED" and ours:
            self.datastore.set_objective(name, priority)
            self._objectives.add(name)
        elif name in self._objectives:
            self.datastore.delete_objective(name)
            self._objectives.discard(name)


def kubernetes_discovery(*, pool_name: str, pool_namespace: str, pool_group: str, kubeconfig: str,
                         endpoint_selector: str, endpoint_target_ports: str) -> KubernetesDiscovery:
    """The Kubernetes discovery `epp serve` flags ask for (pool mode or standalone selector mode)."""
    import os

    from epp.discovery.kubeclient import KubeConfigError, api_client, resolve_namespace
    from epp.discovery.kubeobjects import parse_ports, parse_selector, standalone_pool_name

    namespace = resolve_namespace(pool_namespace)
    try:
        api = api_client(kubeconfig)
    except KubeConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    if endpoint_selector:
        try:
            selector = parse_selector(endpoint_selector)
            ports = parse_ports(endpoint_target_ports)
        except ValueError as exc:
            raise SystemExit(f"error: --endpoint-selector/--endpoint-target-ports: {exc}") from None
        if not os.environ.get("POD_NAME"):
            log.warning("POD_NAME is not set: the standalone pool is named 'standalone'")
        spec = PoolSpec(name=standalone_pool_name(), namespace=namespace, selector=selector, target_ports=ports)
        return KubernetesDiscovery(api, namespace, standalone=spec)
    return KubernetesDiscovery(api, namespace, pool_name=pool_name, pool_group=pool_group)
