"""Kubernetes objects (as the JSON dicts the apiserver sends) → what the EPP needs from them.

Pure functions only: no client, no I/O, so the rules (which pod is ready, which ports are
endpoints, which objective belongs to our pool) are tested without an apiserver.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from epp.datastore import EndpointSpec

log = logging.getLogger("epp.discovery")

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
OBJECTIVE_VERSION = "v1alpha2"
OBJECTIVE_PLURAL = "inferenceobjectives"
ENGINE_LABEL = "inference.networking.k8s.io/engine-type"
ACTIVE_PORTS_ANNOTATION = "inference.networking.k8s.io/active-ports"
MAX_TARGET_PORTS = 8  # the CRD's limit; the standalone flag keeps it too

Object = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class EndpointPickerRef:
    name: str
    kind: str = "Service"
    group: str = ""
    port: int = 0
    failure_mode: str = "FailClose"


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The parts of an InferencePool (or of the standalone flags) that decide the endpoints."""

    name: str
    namespace: str
    selector: tuple[tuple[str, str], ...]
    target_ports: tuple[int, ...]
    app_protocol: str = "http"
    endpoint_picker: EndpointPickerRef | None = None

    @property
    def label_selector(self) -> str:
        """The selector as the apiserver's `labelSelector` query (server-side filtering)."""
        return ",".join(f"{k}={v}" for k, v in self.selector)

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.selector)


def meta(obj: Object) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def name_of(obj: Object) -> str:
    return str(meta(obj).get("name", ""))


def parse_pool(obj: Object) -> PoolSpec:
    """An InferencePool object → PoolSpec. Raises ValueError on a pool we cannot use."""
    spec = obj.get("spec") or {}
    match_labels = (spec.get("selector") or {}).get("matchLabels") or {}
    if not isinstance(match_labels, Mapping) or not match_labels:
        raise ValueError("spec.selector.matchLabels must have at least one label")
    ports = []
    for i, item in enumerate(spec.get("targetPorts") or []):
        number = item.get("number") if isinstance(item, Mapping) else None
        if not isinstance(number, int) or not 0 < number < 65536:
            raise ValueError(f"spec.targetPorts[{i}].number: invalid port {number!r}")
        if number not in ports:
            ports.append(number)
    if not ports:
        raise ValueError("spec.targetPorts must have at least one port")
    ref = spec.get("endpointPickerRef")
    picker = None
    if isinstance(ref, Mapping) and ref.get("name"):
        port = ref.get("port") or {}
        picker = EndpointPickerRef(
            name=str(ref["name"]), kind=str(ref.get("kind") or "Service"), group=str(ref.get("group") or ""),
            port=int(port.get("number", 0)) if isinstance(port, Mapping) else 0,
            failure_mode=str(ref.get("failureMode") or "FailClose"),
        )
    return PoolSpec(
        name=name_of(obj),
        namespace=str(meta(obj).get("namespace", "")),
        selector=tuple(sorted((str(k), str(v)) for k, v in match_labels.items())),
        target_ports=tuple(ports[:MAX_TARGET_PORTS]),
        app_protocol=str(spec.get("appProtocol") or "http"),
        endpoint_picker=picker,
    )


def pod_is_ready(pod: Object) -> bool:
    """Ready condition True and not being deleted: the only pods that may take new requests."""
    if meta(pod).get("deletionTimestamp"):
        return False
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def active_ports(pod: Object) -> frozenset[int] | None:
    """Ports named by the active-ports annotation; None when the pod has no such annotation.

    An empty annotation means "no active port" (a pod draining all its ranks); tokens that are
    not port numbers are ignored.
    """
    value = (meta(pod).get("annotations") or {}).get(ACTIVE_PORTS_ANNOTATION)
    if value is None:
        return None
    ports = set()
    for token in str(value).split(","):
        token = token.strip()
        if token.isdigit() and 0 < int(token) < 65536:
            ports.add(int(token))
        elif token:
            log.debug("ignoring active port %r of pod %s", token, name_of(pod))
    return frozenset(ports)


def pod_endpoints(pod: Object, pool: PoolSpec) -> list[EndpointSpec]:
    """The endpoints a pod contributes: one per (active) target port, none unless it is ready.

    With several target ports each is a data-parallel rank named `<pod>-rank-<i>`, i being the
    port's index in `targetPorts`, so names stay stable when the annotation turns ranks off.
    """
    if not pod_is_ready(pod):
        return []
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return []
    labels = {str(k): str(v) for k, v in (meta(pod).get("labels") or {}).items()}
    if not pool.selects(labels):
        return []
    active = active_ports(pod)
    pod_name = name_of(pod)
    several = len(pool.target_ports) > 1
    label_items = tuple(sorted(labels.items()))
    return [
        EndpointSpec(
            name=f"{pod_name}-rank-{i}" if several else pod_name,
            ip=str(ip),
            port=port,
            namespace=str(meta(pod).get("namespace", "")),
            labels=label_items,
            engine=labels.get(ENGINE_LABEL, ""),
        )
        for i, port in enumerate(pool.target_ports)
        if active is None or port in active
    ]


def objective_priority(obj: Object, pool_name: str, pool_group: str = POOL_GROUP) -> tuple[bool, int | None]:
    """(belongs to our pool, priority) for an InferenceObjective."""
    spec = obj.get("spec") or {}
    ref = spec.get("poolRef") or {}
    group = ref.get("group") or POOL_GROUP
    kind = ref.get("kind") or "InferencePool"
    if ref.get("name") != pool_name or group != pool_group or kind != "InferencePool":
        return False, None
    priority = spec.get("priority")
    return True, priority if isinstance(priority, int) and not isinstance(priority, bool) else None


# -- standalone mode (pods only, from flags) --

_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def parse_selector(text: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k2=v2` (the --endpoint-selector flag) → sorted pairs; ValueError when malformed."""
    pairs: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = term.partition("=")
        key, value = key.strip(), value.strip().lstrip("=")
        if not sep or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value) or len(value) > 63:
            raise ValueError(f"invalid selector term {term!r}: expected key=value")
        pairs[key] = value
    if not pairs:
        raise ValueError("the selector needs at least one key=value")
    return tuple(sorted(pairs.items()))


def parse_ports(text: str | Iterable[int]) -> tuple[int, ...]:
    """`8000,8001` → (8000, 8001), duplicates dropped, 1..8 ports, as the reference's flag."""
    tokens = text.split(",") if isinstance(text, str) else [str(p) for p in text]
    ports: list[int] = []
    for token in filter(None, (t.strip() for t in tokens)):
        if not token.isdigit() or not 0 < int(token) < 65536:
            raise ValueError(f"invalid port {token!r}")
        if int(token) not in ports:
            ports.append(int(token))
    if not 0 < len(ports) <= MAX_TARGET_PORTS:
        raise ValueError(f"between 1 and {MAX_TARGET_PORTS} target ports are needed, got {len(ports)}")
    return tuple(ports)


def standalone_pool_name(pod_name: str | None = None) -> str:
    """The pool name in standalone mode: our own Deployment's name, from POD_NAME.

    A Deployment's pods are named `<deployment>-<replicaset hash>-<pod hash>`, so stripping
    the last two dash-separated parts gives the deployment.
    """
    pod_name = pod_name if pod_name is not None else os.environ.get("POD_NAME", "")
    parts = pod_name.split("-")
    if len(parts) >= 3:
        return "-".join(parts[:-2])
    return pod_name or "standalone"
