"""Static endpoints from a flag or a file, for use without Kubernetes.

The file is re-read when it changes, so endpoints can be added and removed at run time (also how
the tests make pods appear and disappear without an apiserver).

File format: YAML (or plain text) — a list whose items are "ip:port" strings or mappings
`{address: "ip:port", name: pod-a, engine: vllm, labels: {k: v}}`; plain text may also be one
address per line or comma-separated. `engine` picks the pod's metric mapping and request API
(vllm, sglang, tgi, trtllm-serve, triton-tensorrt-llm, or an `engineConfigs` name), as the
`inference.networking.k8s.io/engine-type` label does in Kubernetes; it must read like a label value.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from pathlib import Path
from typing import Any

import yaml

from epp.datastore import Datastore, EndpointSpec, split_host_port
from epp.discovery.base import Discovery

log = logging.getLogger("epp.discovery")

_ENGINE_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")  # a Kubernetes label value


def _engine(item: dict[str, Any], where: str) -> str:
    engine = item.get("engine")
    if engine is None or engine == "":
        return ""
    if not isinstance(engine, str) or not _ENGINE_NAME.fullmatch(engine):
        raise ValueError(f"{where}.engine: must be an engine name such as vllm, sglang or tgi, got {engine!r}")
    return engine


def parse_endpoint(item: Any, where: str) -> EndpointSpec:
    if isinstance(item, str):
        item = {"address": item}
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected 'ip:port' or a mapping, got {item!r}")
    unknown = set(item) - {"address", "name", "engine", "labels", "namespace", "metricsPort"}
    if unknown:
        raise ValueError(f"{where}.{sorted(unknown)[0]}: unknown field")
    address = item.get("address")
    if not isinstance(address, str):
        raise ValueError(f"{where}.address: required 'ip:port' string")
    try:
        ip, port = split_host_port(address)
    except ValueError as exc:
        raise ValueError(f"{where}.address: {exc}") from None
    labels = item.get("labels") or {}
    if not isinstance(labels, dict):
        raise ValueError(f"{where}.labels: must be a mapping")
    metrics_port = item.get("metricsPort", 0)
    if not isinstance(metrics_port, int):
        raise ValueError(f"{where}.metricsPort: must be an integer")
    return EndpointSpec(
        name=str(item.get("name") or address),
        ip=ip,
        port=port,
        namespace=str(item.get("namespace", "")),
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        engine=_engine(item, where),
        metrics_port=metrics_port,
    )


def parse_endpoint_list(text: str, where: str = "endpoints") -> list[EndpointSpec]:
    stripped = text.strip()
    if not stripped:
        return []
    try:
        data = yaml.safe_load(stripped)
    except yaml.YAMLError:
        data = None
    if isinstance(data, str) or data is None:
        data = [s.strip() for s in stripped.replace("\n", ",").split(",") if s.strip() and not s.strip().startswith("#")]
    if isinstance(data, dict) and "endpoints" in data:
        data = data["endpoints"]
    if not isinstance(data, list):
        raise ValueError(f"{where}: expected a list of endpoints")
    specs = [parse_endpoint(item, f"{where}[{i}]") for i, item in enumerate(data)]
    addresses = [s.address for s in specs]
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"{where}: duplicate endpoint address")
    return specs


class StaticDiscovery(Discovery):
    def __init__(self, endpoints: list[EndpointSpec] | None = None, path: str = "", poll_interval: float = 1.0,
                 pool_name: str = "static") -> None:
        self.endpoints = endpoints or []
        self.path = path
        self.poll_interval = poll_interval
        self.pool_name = pool_name
        self._task: asyncio.Task[None] | None = None
        self._stamp: tuple[int, int] = (-1, -1)

    async def start(self, datastore: Datastore) -> None:
        datastore.pool.name = datastore.pool.name or self.pool_name
        specs = list(self.endpoints)
        if self.path:
            specs += self._read_file()
        datastore.replace_all(specs)
        datastore.synced = True
        if self.path:
            self._task = asyncio.create_task(self._watch(datastore), name="static-discovery")

    def _read_file(self) -> list[EndpointSpec]:
        path = Path(self.path)
        stat = path.stat()
        self._stamp = (stat.st_mtime_ns, stat.st_size)
        return parse_endpoint_list(path.read_text(), where=str(path))

    async def _watch(self, datastore: Datastore) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                stat = Path(self.path).stat()
                if (stat.st_mtime_ns, stat.st_size) == self._stamp:
                    continue
                specs = self.endpoints + self._read_file()
            except (OSError, ValueError) as exc:
                log.warning("static endpoints file %s not reloaded: %s", self.path, exc)
                continue
            datastore.replace_all(specs)
            log.info("static endpoints reloaded: %d endpoints", len(specs))

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
