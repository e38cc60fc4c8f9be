"""Many cheap fake model servers in one Envoy: static vLLM `/metrics` pages and canned completions.

The picker-cost benchmarks need 10 or 100 endpoints that answer scrapes and requests without
spending the CPU the EPP is measured against. Envoy's `direct_response` serves a fixed body from
C++ on as many listeners as asked, so the fake pods cost little next to the EPP. The `/metrics`
page is what a simulated vLLM pod renders (~55 KB, vLLM 0.32's families), so the EPP parses a
vLLM-sized page on every scrape.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from bench.common import free_ports, start_process, stop_process
from epp.local.envoy import envoy_binary
from epp.sim.config import SimConfig
from epp.sim.server import SimPod

COMPLETION = orjson.dumps({
    "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "meta-llama/Llama-3.1-8B-Instruct",
    "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 16, "total_tokens": 17, "completion_tokens": 1},
})


def metrics_page() -> bytes:
    """A simulated vLLM pod's /metrics, rendered without serving it."""
    pod = SimPod(SimConfig())
    return pod.exposition.render(pod.engine, pod.metrics).encode()


def _listener(i: int, port: int, metrics_file: str, completion_file: str) -> str:
    return f"""
  - name: stub{i}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: stub
          route_config:
            max_direct_response_body_size_bytes: 1048576
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/metrics"}}
                direct_response: {{status: 200, body: {{filename: "{metrics_file}"}}}}
                response_headers_to_add:
                - header: {{key: content-type, value: "text/plain; version=0.0.4; charset=utf-8"}}
              - match: {{prefix: "/v1/"}}
                direct_response: {{status: 200, body: {{filename: "{completion_file}"}}}}
                response_headers_to_add:
                - header: {{key: content-type, value: application/json}}
              - match: {{prefix: "/"}}
                direct_response: {{status: 200}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"""


@dataclass(slots=True)
class StubPods:
    count: int
    ports: list[int] = field(default_factory=list)
    admin_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    _dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def start(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="bench-stub-")
        d = Path(self._dir.name)
        (d / "metrics.txt").write_bytes(metrics_page())
        (d / "completion.json").write_bytes(COMPLETION)
        *self.ports, self.admin_port = free_ports(self.count + 1)
        listeners = "".join(_listener(i, p, str(d / "metrics.txt"), str(d / "completion.json"))
                            for i, p in enumerate(self.ports))
        (d / "envoy.yaml").write_text(f"""
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {self.admin_port}}}}}
static_resources:
  listeners:{listeners}
""")
        self.proc = start_process([envoy_binary(), "-c", str(d / "envoy.yaml"), "--concurrency", "1",
                                   "--log-level", "warning", "--base-id", str(self.admin_port)],
                                  f"stubpods-{self.count}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stub Envoy exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("stub Envoy did not become ready")

    def requests_served(self) -> int:
        """Requests answered so far, over all listeners (Envoy's own counter)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats?filter=^http.stub.downstream_rq_total$",
                                    timeout=5) as r:
            text = r.read().decode()
        return sum(int(line.split(":")[1]) for line in text.splitlines() if ":" in line)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> StubPods:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
