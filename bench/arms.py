"""The routers under comparison ("arms"), each started in front of the same pod addresses.

- `epp*`: Envoy + this EPP (ext_proc), as a gateway would run it; the EPP is its own process so
  its CPU can be read and it does not share a GIL with anything else.
- `envoy-rr`: Envoy alone, round-robin over the pods: the gateway without a picker.
- `sglang-*`: the SGLang model gateway (`smg launch`, package sglang-router) with a policy.
- `vllm-*`: vLLM's router (package vllm-router) with a policy.

Peers are optional: `available()` says whether an arm's program is installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import epp_command, free_ports, start_process, stop_process, wait_http
from epp.local.envoy import EnvoyConfig, EnvoyProcess

CONFIGS = Path(__file__).parent / "configs"


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    kind: str  # "epp" | "envoy-rr" | "sglang" | "vllm"
    policy: str = ""
    epp_config: str = ""  # file under bench/configs/ ("" = the EPP's built-in default)
    response_body_mode: str = "NONE"  # this project's Envoy config; FULL_DUPLEX_STREAMED: the reference's
    note: str = ""


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("epp", "epp", note="Envoy + EPP, default config (predicted latency), the Envoy config this project ships "
                           "(responses reported to an observer filter, never waiting on the EPP)"),
    Arm("epp-streamed", "epp", response_body_mode="FULL_DUPLEX_STREAMED",
        note="Envoy + EPP, default config, the reference's Envoy config (every response chunk through the EPP)"),
    Arm("epp-weighted", "epp", epp_config="weighted.yaml",
        note="Envoy + EPP with the 'weighted' preset (the previous default)"),
    Arm("epp-reference", "epp", epp_config="reference-default.yaml",
        note="Envoy + EPP with the reference EPP's default profile (no in-flight scorer)"),
    Arm("envoy-rr", "envoy-rr", note="Envoy alone, round-robin"),
    Arm("sglang-cache_aware", "sglang", "cache_aware", note="smg launch --policy cache_aware (defaults)"),
    Arm("sglang-round_robin", "sglang", "round_robin"),
    Arm("sglang-power_of_two", "sglang", "power_of_two"),
    Arm("vllm-cache_aware", "vllm", "cache_aware", note="vllm-router --policy cache_aware (defaults)"),
    Arm("vllm-power_of_two", "vllm", "power_of_two"),
    Arm("vllm-sticky_least_loaded", "vllm", "sticky_least_loaded"),
    Arm("vllm-round_robin", "vllm", "round_robin"),
    Arm("vllm-kv_aware", "vllm", "kv_aware", note="no KV-event source here: falls back to its non-affinity policy"),
)}


def arm(name: str) -> Arm:
    """A named arm, or `epp:<file>` for an EPP with a config file from bench/configs/."""
    if name in ARMS:
        return ARMS[name]
    if name.startswith("epp:"):
        path = name[4:]
        return Arm(f"epp:{Path(path).stem}", "epp", epp_config=path, note=f"Envoy + EPP with `{path}`")
    raise ValueError(f"unknown arm {name!r}; known: {', '.join(ARMS)}, epp:<config file>")


def program(kind: str) -> str | None:
    """Path of a peer router's executable (next to this Python first, then PATH)."""
    name = {"sglang": "smg", "vllm": "vllm-router"}.get(kind)
    if name is None:
        return sys.executable
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def available(a: Arm) -> bool:
    return program(a.kind) is not None


@dataclass(slots=True)
class RunningArm:
    arm: Arm
    url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    envoy: EnvoyProcess | None = None
    epp_pid: int | None = None

    def close(self) -> None:
        if self.envoy is not None:
            self.envoy.close()
            self.envoy = None
        for p in self.procs:
            stop_process(p)
        self.procs.clear()


def start_arm(a: Arm, pods: list[str], tag: str) -> RunningArm:
    """Start `a` in front of `pods` ("host:port"); the caller must `close()` it."""
    running = RunningArm(a, "")
    try:
        if a.kind == "epp":
            _start_epp(running, pods, tag)
        elif a.kind == "envoy-rr":
            listen, admin = free_ports(2)
            envoy = EnvoyProcess(EnvoyConfig(listen, admin, 0, with_ext_proc=False, upstreams=tuple(pods)))
            running.envoy = envoy
            envoy.start()
            running.url = envoy.url
        elif a.kind in ("sglang", "vllm"):
            _start_peer(running, pods, tag)
        else:
            raise ValueError(f"unknown arm kind {a.kind!r}")
    except BaseException:
        running.close()
        raise
    return running


def _start_epp(running: RunningArm, pods: list[str], tag: str) -> None:
    a = running.arm
    grpc_port, health, metrics, listen, admin = free_ports(5)
    args = ["serve", "--static-endpoints", ",".join(pods), "--grpc-port", str(grpc_port),
            "--grpc-health-port", str(health), "--metrics-port", str(metrics),
            "--bind-address", "127.0.0.1", "--v", "1"]
    if a.epp_config:
        args += ["--config-file", str(CONFIGS / a.epp_config)]
    proc = start_process(epp_command(*args), f"{tag}-epp")
    running.procs.append(proc)
    running.epp_pid = proc.pid
    wait_http(f"http://127.0.0.1:{metrics}/metrics", proc=proc)
    envoy = EnvoyProcess(EnvoyConfig(listen, admin, grpc_port, epp_tls=True,
                                     response_body_mode=a.response_body_mode))
    running.envoy = envoy
    envoy.start()
    running.url = envoy.url
    time.sleep(0.3)  # a few scrapes, so the first picks see the pods' metrics


def _start_peer(running: RunningArm, pods: list[str], tag: str) -> None:
    a = running.arm
    exe = program(a.kind)
    if exe is None:
        raise FileNotFoundError(f"{a.kind} router not installed (make bench-deps)")
    port, prom = free_ports(2)
    workers = [f"http://{p}" for p in pods]
    if a.kind == "sglang":
        cmd = [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
               "--policy", a.policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
               "--log-level", "warn"]
    else:
        cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
               "--policy", a.policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
               "--log-level", "warning"]
    proc = start_process(cmd, f"{tag}-{a.name}")
    running.procs.append(proc)
    running.url = f"http://127.0.0.1:{port}"
    wait_http(f"{running.url}/health", timeout=60, proc=proc)
    _wait_routable(running.url, proc)


def _wait_routable(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Peers answer /health before their workers are registered; wait until /v1/models routes."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.HTTPError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never routed /v1/models")
