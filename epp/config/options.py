"""Command-line options of `epp serve`, with the reference EPP's flag names and defaults."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

from epp.config.defaults import DEFAULT_PRESET, PRESETS
from epp.params import parse_duration


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "t", "true", "yes", "on"):
        return True
    if value in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}")


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(slots=True)
class Options:
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    bind_address: str = "0.0.0.0"
    config_file: str = ""
    config_text: str = ""
    config_preset: str = ""  # a named built-in configuration (epp.config.defaults.PRESETS)
    refresh_metrics_interval: float = 0.05
    scrape_in_process: bool = False  # scrape on the request path's event loop instead of a scraper process
    refresh_prometheus_metrics_interval: float = 5.0
    metrics_staleness_threshold: float = 2.0
    secure_serving: bool = True
    cert_path: str = ""
    enable_cert_reload: bool = False
    health_checking: bool = False
    static_endpoints: str = ""
    static_endpoints_file: str = ""
    pool_name: str = ""
    pool_namespace: str = ""
    pool_group: str = "inference.networking.k8s.io"
    endpoint_selector: str = ""
    endpoint_target_ports: str = ""
    kubeconfig: str = ""
    ha_enable_leader_election: bool = False
    ha_lease_duration: float = 15.0
    ha_renew_deadline: float = 10.0
    ha_retry_period: float = 2.0
    disable_endpoint_subset_filter: bool = False
    objectives_file: str = ""
    max_request_body_bytes: int = 32 << 20
    admin_port: int = 9004
    admin_bind_address: str = "127.0.0.1"
    debug_decision_header: bool = False
    metrics_bearer_token_file: str = ""
    metrics_model_names: str = ""  # comma-separated; always their own model_name label value
    metrics_max_series: int = 10_000
    # Scale: request-path processes in this pod (0: one per core the container is given; 1: this
    # process alone, as the in-process API and the simulator always run), and active-active
    # replicas sharing in-flight counts and prefix picks through Redis/Valkey.
    workers: int = 1
    replicas_url: str = ""
    replicas_channel: str = ""  # "" : epp:<namespace>/<pool>
    replicas_peer_ttl: float = 3.0
    v: int = 2


def add_bool(parser: argparse.ArgumentParser, flag: str, default: bool, help: str) -> None:
    """A Go-style boolean flag: `--x`, `--x=true`, `--x=false`."""
    parser.add_argument(flag, type=parse_bool, nargs="?", const=True, default=default, metavar="BOOL", help=help)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = Options()
    parser.add_argument("--grpc-port", type=int, default=d.grpc_port, help="ext_proc gRPC port")
    parser.add_argument("--grpc-health-port", type=int, default=d.grpc_health_port, help="gRPC health port (plaintext)")
    parser.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics port")
    parser.add_argument("--bind-address", default=d.bind_address, help="address the servers listen on")
    parser.add_argument("--config-file", default="", help="EndpointPickerConfig YAML file")
    parser.add_argument("--config-text", default="", help="EndpointPickerConfig YAML text")
    parser.add_argument("--config-preset", default="", choices=["", *PRESETS], metavar="NAME",
                        help=f"a built-in configuration instead of a file: {', '.join(PRESETS)} "
                             f"(default without any config: {DEFAULT_PRESET})")
    parser.add_argument("--refresh-metrics-interval", type=_duration, default=d.refresh_metrics_interval,
                        metavar="DURATION", help="model-server scrape period per endpoint (default 50ms)")
    add_bool(parser, "--scrape-in-process", d.scrape_in_process,
             "scrape model servers on the request path's event loop instead of in a separate scraper process "
             "that publishes through shared memory (default false; for debugging)")
    parser.add_argument("--refresh-prometheus-metrics-interval", type=_duration,
                        default=d.refresh_prometheus_metrics_interval, metavar="DURATION",
                        help="accepted for compatibility; pool gauges are computed at scrape time")
    parser.add_argument("--metrics-staleness-threshold", type=_duration, default=d.metrics_staleness_threshold,
                        metavar="DURATION", help="metrics older than this are left out of pool gauges (default 2s)")
    add_bool(parser, "--secure-serving", d.secure_serving, "TLS on the ext_proc port (default true)")
    parser.add_argument("--cert-path", default="", help="directory with tls.crt and tls.key; empty: self-signed")
    add_bool(parser, "--enable-cert-reload", d.enable_cert_reload, "re-read the certificate when it changes")
    add_bool(parser, "--health-checking", d.health_checking, "also serve gRPC health on the ext_proc port")
    parser.add_argument("--static-endpoints", default="", metavar="IP:PORT,...",
                        help="static endpoints (no Kubernetes), comma-separated")
    parser.add_argument("--static-endpoints-file", default="", metavar="PATH",
                        help="static endpoints from a file (YAML list or one per line); reloaded on change")
    parser.add_argument("--pool-name", default="",
                        help="InferencePool to serve (Kubernetes discovery); with static endpoints only a label")
    parser.add_argument("--pool-namespace", default="",
                        help="InferencePool namespace (default: env NAMESPACE, then 'default')")
    parser.add_argument("--pool-group", default=d.pool_group, help="InferencePool API group (version v1)")
    parser.add_argument("--endpoint-selector", default="", metavar="K=V,...",
                        help="standalone mode: pods with these labels are the pool (no CRDs; not with --pool-name)")
    parser.add_argument("--endpoint-target-ports", default="", metavar="PORT,...",
                        help="standalone mode: the pods' model-server ports, 1 to 8 (one endpoint per port)")
    parser.add_argument("--kubeconfig", default="",
                        help="kubeconfig file (default: in-cluster service account, then KUBECONFIG, ~/.kube/config)")
    add_bool(parser, "--ha-enable-leader-election", d.ha_enable_leader_election,
             "elect a leader among replicas with a Lease; only the leader reports ready")
    parser.add_argument("--ha-lease-duration", type=_duration, default=d.ha_lease_duration, metavar="DURATION",
                        help="leader election: how long a lease lasts without renewal (default 15s)")
    parser.add_argument("--ha-renew-deadline", type=_duration, default=d.ha_renew_deadline, metavar="DURATION",
                        help="leader election: the leader steps down if it cannot renew for this long (default 10s)")
    parser.add_argument("--ha-retry-period", type=_duration, default=d.ha_retry_period, metavar="DURATION",
                        help="leader election: how often to try to acquire or renew (default 2s)")
    add_bool(parser, "--disable-endpoint-subset-filter", d.disable_endpoint_subset_filter,
             "ignore the proxy's x-gateway-destination-endpoint-subset hint")
    parser.add_argument("--objectives-file", default="", metavar="PATH",
                        help="InferenceObjective manifests (YAML) giving each objective its priority")
    parser.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                        help="larger request bodies are rejected with 413")
    parser.add_argument("--admin-port", type=int, default=d.admin_port,
                        help="admin gRPC API for `epp status` (default 9004; -1 turns it off)")
    parser.add_argument("--admin-bind-address", default=d.admin_bind_address,
                        help="address of the admin API (default 127.0.0.1: local only)")
    add_bool(parser, "--debug-decision-header", d.debug_decision_header,
             "add x-epp-decision (pick and scores) to responses; for troubleshooting only")
    parser.add_argument("--metrics-bearer-token-file", default="", metavar="PATH",
                        help="require this bearer token on /metrics")
    parser.add_argument("--metrics-model-names", default="", metavar="NAME,...",
                        help="model names that keep their own model_name label in the EPP's metrics besides the "
                             "names the pods report (other names are counted as 'other')")
    parser.add_argument("--metrics-max-series", type=int, default=d.metrics_max_series, metavar="N",
                        help="series budget of the EPP's metrics with client- or pod-controlled labels; label sets "
                             "beyond it are counted as 'other' (default 10000; a quarter of it per metric)")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="request-path processes sharing the gRPC port and one view of the pool (default 0: "
                             "one per CPU the container is given; 1: a single process)")
    parser.add_argument("--replicas-url", default=d.replicas_url, metavar="URL",
                        help="active-active replicas: a Redis/Valkey URL (redis://host:6379/0, rediss:// for TLS) "
                             "through which replicas share in-flight counts and prefix picks, in the background; "
                             "readiness no longer waits for leadership")
    parser.add_argument("--replicas-channel", default=d.replicas_channel, metavar="NAME",
                        help="channel prefix of this pool's replicas (default epp:<namespace>/<pool>)")
    parser.add_argument("--replicas-peer-ttl", type=_duration, default=d.replicas_peer_ttl, metavar="DURATION",
                        help="a replica not heard from for this long is forgotten, its in-flight counts with it "
                             "(default 3s)")
    parser.add_argument("--v", "-v", dest="v", type=int, default=d.v, metavar="LEVEL",
                        help="log verbosity: 1 warnings, 2 default, 3 verbose, 4 debug (decision traces), 5 trace")


def options_from_args(args: argparse.Namespace) -> Options:
    values = {name: getattr(args, name) for name in Options.__dataclass_fields__ if hasattr(args, name)}
    options = Options(**values)
    if sum(bool(x) for x in (options.config_file, options.config_text, options.config_preset)) > 1:
        raise SystemExit("error: --config-file, --config-text and --config-preset are mutually exclusive")
    if options.workers < 0:
        raise SystemExit("error: --workers must be >= 0")
    if options.replicas_peer_ttl <= 0:
        raise SystemExit("error: --replicas-peer-ttl must be > 0")
    return options


def available_cpus() -> int:
    """CPUs this process may use: its affinity, bounded by the cgroup's CPU quota (rounded up),
    which is what a Kubernetes CPU limit sets."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _cgroup_quota() -> float | None:
    try:  # cgroup v2: "max 100000" or "<quota> <period>"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None
