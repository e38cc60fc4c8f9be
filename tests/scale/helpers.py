"""Real `epp serve` processes (a pod of workers, or one replica) for the scale tests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from epp.local.envoy import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class EppServe:
    """`epp serve` in its own process group; `start` waits (bounded) until readiness is SERVING."""

    endpoints: list[str]
    workers: int = 2
    config_text: str = ""
    extra: list[str] = field(default_factory=list)
    grpc_port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix="epp-serve-", suffix=".log", delete=False)

    @property
    def log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")[-6000:]

    def command(self) -> list[str]:
        args = [sys.executable, "-m", "epp.cli", "serve", "--workers", str(self.workers),
                "--static-endpoints", ",".join(self.endpoints), "--grpc-port", str(self.grpc_port),
                "--grpc-health-port", str(self.health_port), "--metrics-port", str(self.metrics_port),
                "--admin-port", str(self.admin_port), "--bind-address", "127.0.0.1", "--secure-serving=false",
                "--pool-name", "local", "--v", "1"]
        if self.config_text:
            args += ["--config-text", self.config_text]
        return args + self.extra

    async def start(self, timeout: float = 90.0, attempts: int = 3) -> None:
        """Start and wait for readiness. `free_port` hands out ports from the kernel's ephemeral
        range, which any process's outgoing connection may take before `epp serve` binds them; a
        start that fails to bind is retried on fresh ports."""
        env = {**os.environ, "PYTHONPATH": str(REPO), "GRPC_VERBOSITY": "ERROR"}
        deadline = asyncio.get_running_loop().time() + timeout
        for attempt in range(attempts):
            self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
            while not await self.ready():
                if self.proc.poll() is not None:
                    log = self.log_text
                    if "Address already in use" in log and attempt + 1 < attempts:
                        break
                    raise RuntimeError(f"epp serve exited with {self.proc.returncode}:\n{log}")
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"epp serve not ready:\n{self.log_text}")
                await asyncio.sleep(0.2)
            else:
                return
            self._log.seek(0)
            self._log.truncate()
            self.grpc_port, self.health_port, self.metrics_port, self.admin_port = (
                free_port(), free_port(), free_port(), free_port())

    async def ready(self) -> bool:
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False

    async def _exposition(self) -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
                return await r.text()

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = await self._exposition()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    async def families(self) -> set[str]:
        """The metric families the pod exposes, with samples or not (a labelled counter no event
        has touched yet shows its HELP and TYPE only)."""
        return {family.name for family in text_string_to_metric_families(await self._exposition())}

    async def metric(self, name: str, **labels: str) -> float:
        """Sum of `name` over the series whose labels include `labels`."""
        found = await self.metrics()
        return sum(v for (n, ls), v in found.items() if n == name and all((k, w) in ls for k, w in labels.items()))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        self._log.close()


async def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    """Poll an async or plain predicate until true; fail after `timeout` seconds (a bound, not a measurement)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert asyncio.get_running_loop().time() < deadline, f"{what} not reached"
        await asyncio.sleep(0.1)
