"""Fixtures: a fake apiserver per test, a client for it, and quick watch timings."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from epp.datastore import Datastore
from epp.discovery.informer import WatchTuning
from epp.discovery.kubernetes import KubernetesDiscovery
from tests.discovery.fakeapi import FakeApiServer

# Watch timings for tests: reconnects in tens of milliseconds, no resync during a test.
FAST = WatchTuning(resync_period=60.0, backoff_initial=0.02, backoff_max=0.2, request_timeout=5.0)


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def api(fake: FakeApiServer) -> client.ApiClient:
    return client.ApiClient(client.Configuration(host=fake.url))


@pytest.fixture
def kubeconfig(fake: FakeApiServer, tmp_path: Path) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(fake.kubeconfig())
    return str(path)


async def eventually(check: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll until `check()` holds; fail with `what` after `timeout` (a bound, never a measurement)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def addresses(datastore: Datastore) -> set[str]:
    return {ep.address for ep in datastore.endpoints()}


def names(datastore: Datastore) -> set[str]:
    return {ep.name for ep in datastore.endpoints()}


@contextlib.asynccontextmanager
async def discovering(api: client.ApiClient, pool: str = "pool", datastore: Datastore | None = None,
                      **kwargs: Any) -> AsyncIterator[tuple[KubernetesDiscovery, Datastore]]:
    """A started KubernetesDiscovery (pool mode, or standalone when `standalone=` is given)."""
    kwargs.setdefault("tuning", FAST)
    kwargs.setdefault("initial_sync_timeout", 5.0)
    if "standalone" not in kwargs:
        kwargs["pool_name"] = pool
    discovery = KubernetesDiscovery(api, "default", **kwargs)
    datastore = datastore or Datastore()
    await discovery.start(datastore)
    try:
        yield discovery, datastore
    finally:
        await discovery.stop()
