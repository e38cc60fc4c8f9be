"""Helpers shared by the benchmarks: child processes, load loops, percentiles, reports.

Every child process is started in its own session (process group) and recorded, so a benchmark
that is interrupted (Ctrl-C, an exception) still stops everything it started: each harness
stops its processes in `finally`, and an `atexit` hook catches anything left over.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

RESULTS = Path(__file__).parent / "results"
LOGS = RESULTS / "logs"
REPO = Path(__file__).resolve().parent.parent
MODEL = "meta-llama/Llama-3.1-8B-Instruct"

_LIVE: dict[int, subprocess.Popen[bytes]] = {}


def epp_command(*args: str) -> list[str]:
    """`epp <args>`; `serve` runs one process (`--workers 1`) unless the arm names its workers, so
    the arms measure what they always did whatever the machine's cores."""
    if args and args[0] == "serve" and not any(a == "--workers" or a.startswith("--workers=") for a in args):
        args = (*args, "--workers", "1")
    return [sys.executable, "-m", "epp.cli", *args]


def log(message: str) -> None:
    """Progress goes to stderr so the report on stdout stays clean."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def start_process(cmd: Sequence[str], log_name: str, env: dict[str, str] | None = None,
                  cwd: str | Path | None = None) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new process group, output to bench/results/logs/<log_name>.log."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log_name = re.sub(r"[^A-Za-z0-9._-]+", "_", log_name)
    merged = {**os.environ, "GRPC_VERBOSITY": "ERROR", "PYTHONPATH": str(REPO), **(env or {})}
    with open(LOGS / f"{log_name}.log", "wb") as out:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=merged,
                                cwd=cwd, start_new_session=True)
    _LIVE[proc.pid] = proc
    return proc


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGTERM the process group we created for `proc`, then SIGKILL it if it lingers."""
    if proc is None:
        return
    _LIVE.pop(proc.pid, None)
    if proc.poll() is None:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    # Children left in the group (e.g. a launcher's worker) go too.
    _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the group id is the pid: start_new_session=True
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _stop_leftovers() -> None:
    for proc in list(_LIVE.values()):
        stop_process(proc, timeout=3.0)


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until `url` answers at all (any HTTP status counts: the server is up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer")


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (all held open while choosing, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_load() -> str:
    """The 1-minute load average: other work on this 2-core machine skews absolute figures
    (ratios from one run much less), so reports say how busy it was."""
    return f"{os.getloadavg()[0]:.2f}"


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def write_report(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    log(f"report written to {path}")


@dataclass(slots=True)
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    elapsed: float = 0.0

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed if self.elapsed else 0.0

    def merge(self, other: LoadResult) -> None:
        self.latencies += other.latencies
        self.errors += other.errors
        self.elapsed += other.elapsed


_JSON = {"content-type": "application/json"}


async def timed_post(session: aiohttp.ClientSession, url: str, data: bytes, result: LoadResult) -> None:
    """One POST; its latency goes into `result` when it is a 200, else it counts as an error."""
    start = time.perf_counter()
    try:
        async with session.post(url, data=data, headers=_JSON) as r:
            await r.read()
            ok = r.status == 200
    except aiohttp.ClientError:
        ok = False
    if ok:
        result.latencies.append(time.perf_counter() - start)
    else:
        result.errors += 1


async def closed_loop(url: str, body: bytes | Sequence[bytes], concurrency: int, duration: float) -> LoadResult:
    """`concurrency` clients sending back to back for `duration` seconds (cycling through `body`
    when it is a list, so requests can differ)."""
    result = LoadResult()
    bodies = [body] if isinstance(body, bytes) else list(body)
    counter = iter(range(1 << 62))
    deadline = time.perf_counter() + duration

    async def client(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            await timed_post(session, url, bodies[next(counter) % len(bodies)], result)

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    result.elapsed = time.perf_counter() - start
    return result


async def open_loop(url: str, body: bytes, rate: float, duration: float) -> LoadResult:
    """Requests at a fixed rate (evenly spaced), whatever the latency."""
    result = LoadResult()

    tasks = []
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        n = int(rate * duration)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(timed_post(session, url, body, result)))
        await asyncio.gather(*tasks)
    result.elapsed = time.perf_counter() - start
    return result
