"""Leader election on a `coordination.k8s.io/v1` Lease, for `--ha-enable-leader-election`.

Why: prefix-cache affinity and in-flight counts live in one EPP's memory, so of several replicas
only one should take traffic; the others keep their datastore warm (discovery runs everywhere)
and report NOT_SERVING on readiness until they lead. With active-active replicas
(`--replicas-url`: they share that state through Redis/Valkey, `epp.scale.replicas`) election is
optional and readiness does not wait for it: the lease, if still elected, only names a leader. A
pod of several workers elects once, in its supervisor. The Lease is the reference's:
`epp-<namespace>-<pool>.gateway-api-inference-extension.sigs.k8s.io` in the pool's namespace.

Semantics follow client-go's leader election, in our own code:
- a candidate tries every `retry_period`; it takes the lease when it is free (no holder, or
  released) or expired. Expiry is judged by *our* clock: the time we last saw the record change,
  plus its leaseDurationSeconds, so clock skew between replicas does not matter;
- the leader renews every `retry_period`; if it cannot renew for `renew_deadline` it stops leading
  (here: readiness fails and it becomes a candidate again, rather than exiting the process);
- on stop the leader releases the lease (no holder, duration 1s), so a standby takes over at its
  next try instead of waiting out the lease;
- writes use the object's resourceVersion, so two candidates can never both win (409 Conflict).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger("epp.leader")


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("leader election needs retry period < renew deadline < lease duration")


DEFAULT_TIMING = LeaseTiming()


def lease_name(namespace: str, pool: str) -> str:
    return f"epp-{namespace}-{pool}.gateway-api-inference-extension.sigs.k8s.io"


def default_identity() -> str:
    """Unique per process: the pod name when the chart sets POD_NAME, plus a random suffix."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class LeaderElector:
    def __init__(self, api: ApiClient, namespace: str, name: str, identity: str = "",
                 timing: LeaseTiming = DEFAULT_TIMING, on_change: Callable[[bool], None] | None = None) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity or default_identity()
        self.timing = timing
        self.on_change = on_change
        self._leader = False
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def is_leader(self) -> bool:
        return self._leader

    async def start(self) -> None:
        # One worker thread of our own: attempts and the final release run strictly in order,
        # so a renewal still in flight can never land after the release.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="leader-election")
        self._task = asyncio.create_task(self._run(), name="leader-election")

    async def stop(self, release: bool = True) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._executor is None:
            return
        if release:
            try:
                if await self._in_thread(self._release):
                    log.info("released leadership of %s/%s", self.namespace, self.name)
            except Exception as exc:  # noqa: BLE001 - best effort; the lease expires anyway
                log.warning("could not release lease %s/%s: %s", self.namespace, self.name, exc)
        self._executor.shutdown(wait=False)
        self._executor = None
        self._set_leader(False)

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        assert self._executor is not None
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # -- loop --

    async def _run(self) -> None:
        t = self.timing
        last_renewal = 0.0
        while True:
            try:  # each call is bounded by its own request timeout (no wait_for: see stop())
                won = await self._in_thread(self._try_acquire_or_renew)
            except Exception as exc:  # noqa: BLE001 - apiserver trouble is a failed attempt
                log.debug("lease %s: attempt failed: %s", self.name, exc)
                won = False
            now = time.monotonic()
            if won:
                last_renewal = now
                self._set_leader(True)
            elif self._leader and now - last_renewal > t.renew_deadline:
                log.warning("lost leadership of %s/%s: not renewed for %.1fs", self.namespace, self.name,
                            now - last_renewal)
                self._set_leader(False)
            await asyncio.sleep(t.retry_period if self._leader else t.retry_period * random.uniform(1.0, 1.2))

    def _set_leader(self, leader: bool) -> None:
        if leader == self._leader:
            return
        self._leader = leader
        if leader:
            log.info("became leader of %s/%s as %s", self.namespace, self.name, self.identity)
            self._event(f"{self.identity} became leader")
        if self.on_change:
            self.on_change(leader)

    # -- one attempt (in a worker thread; the client is synchronous) --

    def _try_acquire_or_renew(self) -> bool:
        from kubernetes.client import CoordinationV1Api, V1Lease, V1LeaseSpec, V1ObjectMeta
        from kubernetes.client.exceptions import ApiException

        api = CoordinationV1Api(self.api)
        timeout = self.timing.renew_deadline / 2  # a read and a write: together within the deadline
        now = _now()
        try:
            lease = api.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status != 404:
                raise
            spec = V1LeaseSpec(holder_identity=self.identity, lease_duration_seconds=self._duration_seconds(),
                               acquire_time=now, renew_time=now, lease_transitions=0)
            body = V1Lease(metadata=V1ObjectMeta(name=self.name, namespace=self.namespace), spec=spec)
            try:
                api.create_namespaced_lease(self.namespace, body, _request_timeout=timeout)
            except ApiException as create_exc:
                if create_exc.status == 409:  # another candidate created it first
                    return False
                raise
            return True

        spec = lease.spec or V1LeaseSpec()
        record = (spec.holder_identity, spec.renew_time, spec.lease_duration_seconds, spec.lease_transitions)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        holder = spec.holder_identity or ""
        mine = holder == self.identity
        duration = spec.lease_duration_seconds or self._duration_seconds()
        if holder and not mine and time.monotonic() < self._observed_at + duration:
            return False  # someone else holds a live lease
        lease.spec = V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=self._duration_seconds(),
            acquire_time=spec.acquire_time if mine and spec.acquire_time else now,
            renew_time=now,
            lease_transitions=(spec.lease_transitions or 0) + (0 if mine else 1),
        )
        try:
            api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status == 409:  # someone wrote in between: not ours this round
                return False
            raise
        return True

    def _release(self) -> bool:
        """Give the lease up if we hold it: by the record, not our flag (a last renewal may have won)."""
        from kubernetes.client import CoordinationV1Api, V1LeaseSpec

        api = CoordinationV1Api(self.api)
        lease = api.read_namespaced_lease(self.name, self.namespace, _request_timeout=self.timing.renew_deadline)
        spec = lease.spec or V1LeaseSpec()
        if spec.holder_identity != self.identity:
            return False
        now = _now()
        lease.spec = V1LeaseSpec(holder_identity=None, lease_duration_seconds=1, acquire_time=now, renew_time=now,
                                 lease_transitions=spec.lease_transitions or 0)
        api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=self.timing.renew_deadline)
        return True

    def _duration_seconds(self) -> int:
        return max(1, round(self.timing.lease_duration))

    def _event(self, message: str) -> None:
        """A `LeaderElection` Event on the Lease, so `kubectl get events` shows failovers (best effort)."""

        def create() -> None:
            from kubernetes.client import CoreV1Api, CoreV1Event, V1EventSource, V1ObjectMeta, V1ObjectReference

            now = _now()
            event = CoreV1Event(
                metadata=V1ObjectMeta(name=f"{self.name}.{uuid.uuid4().hex[:12]}", namespace=self.namespace),
                involved_object=V1ObjectReference(api_version="coordination.k8s.io/v1", kind="Lease",
                                                  name=self.name, namespace=self.namespace),
                reason="LeaderElection", message=message, type="Normal",
                source=V1EventSource(component="epp"), first_timestamp=now, last_timestamp=now, count=1,
            )
            try:
                CoreV1Api(self.api).create_namespaced_event(self.namespace, event,
                                                             _request_timeout=self.timing.renew_deadline)
            except Exception as exc:  # noqa: BLE001
                log.debug("leader election event not recorded: %s", exc)

        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().run_in_executor(None, create)


def leader_elector(*, pool_namespace: str, pool_name: str, kubeconfig: str, lease_duration: float,
                   renew_deadline: float, retry_period: float) -> LeaderElector:
    """The elector `--ha-enable-leader-election` asks for, on the pool's namespace and name."""
    from epp.discovery.kubeclient import KubeConfigError, api_client, resolve_namespace
    from epp.discovery.kubeobjects import standalone_pool_name

    namespace = resolve_namespace(pool_namespace)
    pool = pool_name or standalone_pool_name()
    try:
        timing = LeaseTiming(lease_duration, renew_deadline, retry_period)
        api = api_client(kubeconfig)
    except (ValueError, KubeConfigError) as exc:
        raise SystemExit(f"error: --ha-enable-leader-election: {exc}") from None
    return LeaderElector(api, namespace, lease_name(namespace, pool), timing=timing)
