"""Helpers shared by the benchmarks: child processes, load loops, percentiles, reports."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

RESULTS = Path(__file__).parent / "results"


def epp_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "epp.cli", *args]


def start_process(cmd: list[str], log_name: str) -> subprocess.Popen[bytes]:
    RESULTS.mkdir(exist_ok=True)
    log = open(RESULTS / f"{log_name}.log", "wb")
    env = dict(os.environ, GRPC_VERBOSITY="ERROR")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(slots=True)
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0


async def closed_loop(url: str, body: bytes, concurrency: int, duration: float) -> LoadResult:
    """`concurrency` clients sending back to back for `duration` seconds."""
    result = LoadResult()
    deadline = time.perf_counter() + duration
    headers = {"content-type": "application/json"}

    async def client(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                result.latencies.append(time.perf_counter() - start)
            else:
                result.errors += 1

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    result.elapsed = time.perf_counter() - start
    return result


async def open_loop(url: str, body: bytes, rate: float, duration: float) -> LoadResult:
    """Requests at a fixed rate (evenly spaced), whatever the latency."""
    result = LoadResult()
    headers = {"content-type": "application/json"}

    async def one(session: aiohttp.ClientSession) -> None:
        start = time.perf_counter()
        try:
            async with session.post(url, data=body, headers=headers) as r:
                await r.read()
                ok = r.status == 200
        except aiohttp.ClientError:
            ok = False
        if ok:
            result.latencies.append(time.perf_counter() - start)
        else:
            result.errors += 1

    tasks = []
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        n = int(rate * duration)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session)))
        await asyncio.gather(*tasks)
    result.elapsed = time.perf_counter() - start
    return result
