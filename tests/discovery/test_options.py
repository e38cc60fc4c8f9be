"""`epp serve` flags → the right discovery, namespace and apiserver configuration."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from epp.config.options import Options, add_serve_arguments, options_from_args
from epp.discovery.kubeclient import KubeConfigError, api_client, resolve_namespace
from epp.discovery.kubernetes import KubernetesDiscovery
from epp.discovery.static import StaticDiscovery
from epp.runner import EndpointPicker, discovery_from_options
from tests.conftest import NO_SCRAPE
from tests.discovery.fakeapi import FakeApiServer, pod


def parse(*argv: str) -> Options:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return options_from_args(parser.parse_args(list(argv)))


def test_flags_parse() -> None:
    o = parse("--endpoint-selector", "app=vllm", "--endpoint-target-ports", "8000,8001", "--kubeconfig", "/k",
              "--ha-enable-leader-election", "--ha-lease-duration", "30s", "--ha-renew-deadline", "20s",
              "--ha-retry-period", "500ms", "--pool-group", "example.com")
    assert (o.endpoint_selector, o.endpoint_target_ports, o.kubeconfig) == ("app=vllm", "8000,8001", "/k")
    assert o.ha_enable_leader_election and (o.ha_lease_duration, o.ha_renew_deadline, o.ha_retry_period) == (
        30.0, 20.0, 0.5)
    assert o.pool_group == "example.com"
    d = parse()
    assert d.pool_group == "inference.networking.k8s.io" and not d.ha_enable_leader_election
    assert (d.ha_lease_duration, d.ha_renew_deadline, d.ha_retry_period) == (15.0, 10.0, 2.0)


def test_endpoint_source_rules(kubeconfig: str) -> None:
    with pytest.raises(SystemExit, match="mutually exclusive"):
        discovery_from_options(Options(pool_name="p", endpoint_selector="app=x", kubeconfig=kubeconfig))
    with pytest.raises(SystemExit, match="--pool-name"):
        discovery_from_options(Options())
    with pytest.raises(SystemExit, match="target ports"):
        discovery_from_options(Options(endpoint_selector="app=x", kubeconfig=kubeconfig))
    with pytest.raises(SystemExit, match="selector"):
        discovery_from_options(Options(endpoint_selector="app", endpoint_target_ports="8000", kubeconfig=kubeconfig))
    static = discovery_from_options(Options(static_endpoints="127.0.0.1:8000", pool_name="p"))
    assert isinstance(static, StaticDiscovery)  # static endpoints win; the pool name is a label there
    kube = discovery_from_options(Options(pool_name="p", kubeconfig=kubeconfig))
    assert isinstance(kube, KubernetesDiscovery) and kube.pool_name == "p" and kube.namespace == "default"


def test_namespace_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NAMESPACE", raising=False)
    assert resolve_namespace("") == "default"
    monkeypatch.setenv("NAMESPACE", "from-env")
    assert resolve_namespace("") == "from-env"
    assert resolve_namespace("flag") == "flag"


def test_kubeconfig_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kubeconfig: str,
                            fake: FakeApiServer) -> None:
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBECONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(KubeConfigError, match="no Kubernetes configuration"):
        api_client()
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    assert api_client().configuration.host == fake.url
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    assert api_client(kubeconfig).configuration.host == fake.url  # the flag wins
    with pytest.raises(KubeConfigError, match="cannot use"):
        api_client(str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="error: cannot use"):
        discovery_from_options(Options(pool_name="p", kubeconfig=str(tmp_path / "missing")))


def test_leader_election_flags_are_checked(kubeconfig: str) -> None:
    from epp.discovery.leader import leader_elector

    with pytest.raises(SystemExit, match="renew deadline"):
        leader_elector(pool_namespace="", pool_name="p", kubeconfig=kubeconfig, lease_duration=5.0,
                       renew_deadline=10.0, retry_period=2.0)
    elector = leader_elector(pool_namespace="ns", pool_name="p", kubeconfig=kubeconfig, lease_duration=15.0,
                             renew_deadline=10.0, retry_period=2.0)
    assert elector.name == "epp-ns-p.gateway-api-inference-extension.sigs.k8s.io" and elector.namespace == "ns"


async def test_standalone_mode_from_flags(fake: FakeApiServer, kubeconfig: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "vllm-epp-5d8c7b9f4-abcde")
    monkeypatch.setenv("NAMESPACE", "default")
    fake.uninstall("inferencepools")
    fake.uninstall("inferenceobjectives")
    fake.apply(pod("vllm-0", "127.0.1.1", {"app": "vllm"}))
    options = Options(grpc_port=0, grpc_health_port=0, metrics_port=0, bind_address="127.0.0.1", secure_serving=False,
                      config_text=NO_SCRAPE, endpoint_selector="app=vllm", endpoint_target_ports="8000,8002",
                      kubeconfig=kubeconfig)
    picker = EndpointPicker(options)
    await picker.start()
    try:
        assert picker.ready()
        assert picker.datastore.pool.name == "vllm-epp"
        assert sorted(ep.name for ep in picker.datastore.endpoints()) == ["vllm-0-rank-0", "vllm-0-rank-1"]
    finally:
        await picker.stop(grace=0)
