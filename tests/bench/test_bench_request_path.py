"""A tiny run of `bench.request_path`: both servers start, answer every request with a
destination, the report and the profile are written, and nothing is left running. No timing is
asserted."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from bench import common, request_path


def test_request_path_measures_both_servers_and_stops_them(tmp_path: Path) -> None:
    out = tmp_path / "request-path.md"
    report = asyncio.run(request_path.measure([3], count=30, concurrency=4, rounds=1, profile_top=5, keep=out))
    assert not common._LIVE, f"processes left running: {[p.args for p in common._LIVE.values()]}"
    rows = [line for line in report.splitlines() if line.startswith("| 3 |")]
    assert len(rows) == 2, report  # the gRPC table and the in-process one
    assert "× |" in rows[0]
    assert "cProfile of the EPP server" in report and out.with_suffix(".3.prof").exists()


def test_every_request_gets_its_destination() -> None:
    server = request_path.Server("epp", 2)
    try:
        requests = request_path._messages(random.Random(1), 12)
        assert asyncio.run(request_path._drive(server.port, requests, 3)) == 12
    finally:
        server.close()
    assert server.proc.poll() is not None
