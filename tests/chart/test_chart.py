"""The Helm chart with a real helm: lint, render, validate every object, and check what it says."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.config.defaults import DEFAULT_PRESET, PRESETS
from epp.config.loader import load_config
from epp.config.options import Options, add_serve_arguments, options_from_args
from epp.datastore import Datastore
from tests.chart.conftest import (
    CHART,
    by_kind,
    container,
    one,
    render,
    rules,
    run_helm,
    validate,
    value_args,
)

CUSTOM_PLUGINS = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "replicas-2": {"inferenceExtension": {"replicas": 2}},
    "monitoring": {"inferenceExtension": {"monitoring": {"interval": "30s", "prometheus": {
        "enabled": True, "extraLabels": {"release": "kube-prometheus"},
        "auth": {"enabled": True, "secretName": "epp-metrics-token"}}, "grafanaDashboard": {"enabled": True}}}},
    "istio": {"provider": {"name": "istio", "istio": {"destinationRule": {
        "trafficPolicy": {"connectionPool": {"http": {"http2MaxRequests": 1000}}}}}}},
    "gke": {"provider": {"name": "gke"}, "inferenceExtension": {"monitoring": {"prometheus": {"enabled": True}}}},
    "custom-plugins": {
        "inferenceExtension": {
            "pluginsConfigFile": "custom.yaml",
            "pluginsCustomConfig": {"custom.yaml": CUSTOM_PLUGINS},
            "flags": {"v": 3, "refresh-metrics-interval": "100ms", "secure-serving": False},
            "env": [{"name": "PYTHONFAULTHANDLER", "value": "1"}],
            "image": {"registry": "ghcr.io/acme", "tag": "v9"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
        "inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}], "modelServerType": "sglang",
                          "modelServers": {"matchLabels": {"app": "sglang", "tier": "a"}}},
        "inferenceObjectives": [{"name": "chat", "priority": 10}, {"name": "batch", "priority": -1},
                                {"name": "plain"}],
        "experimentalHttpRoute": {"enabled": True, "baseModel": "llama-3",
                                  "headerMatches": [{"name": "x-team", "value": "a"}]},
    },
}

CORE_KINDS = {"ServiceAccount", "ConfigMap", "Role", "RoleBinding", "Service", "Deployment", "InferencePool"}


def serve_options(deployment: dict[str, Any]) -> Options:
    """The Deployment's command line, parsed by `epp serve`'s own parser: no unknown or bad flag."""
    epp = container(deployment, "epp")
    assert epp["command"] == ["epp", "serve"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    return options_from_args(parser.parse_args(epp["args"]))


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest, helm: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[
        str, list[dict[str, Any]]]:
    name = request.param
    return name, render(helm, tmp_path_factory.mktemp(name), VALUE_SETS[name])


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint(helm: str, tmp_path: Path, name: str) -> None:
    values = value_args(VALUE_SETS[name], tmp_path)
    result = run_helm(helm, "lint", "--strict", str(CHART), "--namespace", "llm", *values)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_object_validates(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    assert CORE_KINDS <= {d["kind"] for d in docs}
    for doc in docs:
        validate(doc)
        assert doc["metadata"].get("namespace") == "llm", doc["metadata"]["name"]


def test_deployment_runs_epp_serve_for_the_pool(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    deployment = one(docs, "Deployment", "r1-epp")
    options = serve_options(deployment)
    assert (options.pool_name, options.pool_namespace, options.pool_group) == ("r1", "llm",
                                                                             "inference.networking.k8s.io")
    assert (options.grpc_port, options.grpc_health_port, options.metrics_port) == (9002, 9003, 9090)
    pod = deployment["spec"]["template"]["spec"]
    epp = container(deployment, "epp")
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in epp["env"]}
    assert env["NAMESPACE"] == "metadata.namespace" and env["POD_NAME"] == "metadata.name"
    assert epp["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert epp["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert epp["securityContext"]["allowPrivilegeEscalation"] is False
    assert epp["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    assert {p["containerPort"] for p in epp["ports"]} >= {9002, 9003, 9090}
    if name == "replicas-2":
        assert options.ha_enable_leader_election and deployment["spec"]["replicas"] == 2
        assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    else:
        assert not options.ha_enable_leader_election
        assert deployment["spec"]["strategy"]["type"] == "Recreate"


def test_plugin_config_is_mounted_and_loads(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    deployment = one(docs, "Deployment")
    options = serve_options(deployment)
    [configmap] = [c for c in by_kind(docs, "ConfigMap") if not c["metadata"]["name"].endswith("-dashboard")]
    mounts = {m["name"]: m["mountPath"] for m in container(deployment, "epp")["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    [config_volume] = [n for n, v in volumes.items()
                       if v.get("configMap", {}).get("name") == configmap["metadata"]["name"]]
    assert mounts[config_volume] == "/config"
    filename = options.config_file.removeprefix("/config/")
    assert filename in configmap["data"]
    for text in configmap["data"].values():  # every file the chart ships is a valid EndpointPickerConfig
        load_config(text, Datastore())
    default = yaml.safe_load(configmap["data"]["default-plugins.yaml"])
    extractor = next(p for p in default["plugins"] if p["type"] == "core-metrics-extractor")
    assert extractor["parameters"]["defaultEngine"] == ("sglang" if name == "custom-plugins" else "vllm")


def test_pool_points_at_the_epp_service(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    pool = one(docs, "InferencePool", "r1")
    service = one(docs, "Service", "r1-epp")
    ref = pool["spec"]["endpointPickerRef"]
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ref["name"] == service["metadata"]["name"] and ref["kind"] == "Service"
    assert ref["port"]["number"] == ports["grpc-ext-proc"]["port"] == 9002
    assert ref["failureMode"] == "FailOpen"
    assert ports["http-metrics"]["port"] == 9090
    deployment = one(docs, "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    if name == "custom-plugins":
        assert pool["spec"]["selector"]["matchLabels"] == {"app": "sglang", "tier": "a"}
        assert [p["number"] for p in pool["spec"]["targetPorts"]] == [8000, 8001]
    else:
        assert pool["spec"]["selector"]["matchLabels"] == {"app": "vllm"}


def test_rbac_is_exactly_what_the_epp_uses(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    roles = {r["metadata"]["name"]: rules(r) for r in by_kind(docs, "Role")}
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    assert roles["r1-epp"] == {
        ("", "pods", "get"), ("", "pods", "list"), ("", "pods", "watch"),
        ("inference.networking.k8s.io", "inferencepools", "get"),
        ("inference.networking.k8s.io", "inferencepools", "list"),
        ("inference.networking.k8s.io", "inferencepools", "watch"),
        ("inference.networking.x-k8s.io", "inferenceobjectives", "get"),
        ("inference.networking.x-k8s.io", "inferenceobjectives", "list"),
        ("inference.networking.x-k8s.io", "inferenceobjectives", "watch"),
    }
    if name == "replicas-2":
        assert roles["r1-epp-leader-election"] == {
            ("coordination.k8s.io", "leases", "get"), ("coordination.k8s.io", "leases", "create"),
            ("coordination.k8s.io", "leases", "update"), ("", "events", "create"),
        }
    else:
        assert "r1-epp-leader-election" not in roles
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    for binding in by_kind(docs, "RoleBinding"):
        assert binding["roleRef"]["name"] in roles
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "llm"}]


def test_monitoring_objects(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    service = one(docs, "Service")
    if name == "monitoring":
        monitor = one(docs, "ServiceMonitor")
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        [endpoint] = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "30s")
        assert endpoint["bearerTokenSecret"] == {"name": "epp-metrics-token", "key": "token"}
        deployment = one(docs, "Deployment")
        options = serve_options(deployment)
        mounts = {m["mountPath"]: m["name"] for m in container(deployment, "epp")["volumeMounts"]}
        assert mounts[str(Path(options.metrics_bearer_token_file).parent)] == "metrics-token"
        dashboard = next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard"))
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(dashboard["data"]["epp.json"]) == json.loads((CHART / "dashboards" / "epp.json").read_text())
    elif name == "gke":
        monitor = one(docs, "PodMonitoring")
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        assert not by_kind(docs, "ServiceMonitor")
    else:
        assert not by_kind(docs, "ServiceMonitor") and not by_kind(docs, "PodMonitoring")
        assert not [c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]


def test_provider_objects(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    kinds = {d["kind"] for d in docs}
    if name == "istio":
        rule = one(docs, "DestinationRule")
        assert rule["spec"]["host"] == "r1-epp.llm.svc.cluster.local"
        assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}
        assert rule["spec"]["trafficPolicy"]["connectionPool"]["http"]["http2MaxRequests"] == 1000
    else:
        assert "DestinationRule" not in kinds
    if name == "gke":
        for kind in ("HealthCheckPolicy", "GCPBackendPolicy"):
            policy = one(docs, kind)
            assert policy["spec"]["targetRef"] == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                   "name": "r1"}
        health = one(docs, "HealthCheckPolicy")["spec"]["default"]["config"]["httpHealthCheck"]
        assert health == {"requestPath": "/health", "port": 8000}
    else:
        assert not {"HealthCheckPolicy", "GCPBackendPolicy"} & kinds


def test_custom_values_render_through(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    if name != "custom-plugins":
        assert not by_kind(docs, "InferenceObjective") and not by_kind(docs, "HTTPRoute")
        return
    deployment = one(docs, "Deployment")
    options = serve_options(deployment)
    assert (options.v, options.refresh_metrics_interval, options.secure_serving) == (3, 0.1, False)
    epp = container(deployment, "epp")
    assert epp["image"] == "ghcr.io/acme/epp:v9"
    assert {"name": "PYTHONFAULTHANDLER", "value": "1"} in epp["env"]
    assert deployment["spec"]["template"]["spec"]["tolerations"][0]["key"] == "gpu"
    objectives = {o["metadata"]["name"]: o["spec"] for o in by_kind(docs, "InferenceObjective")}
    assert objectives["chat"]["priority"] == 10 and objectives["batch"]["priority"] == -1
    assert "priority" not in objectives["plain"]
    assert all(o["poolRef"]["name"] == "r1" for o in objectives.values())
    route = one(docs, "HTTPRoute")
    [rule] = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "r1"}]
    headers = {h["name"]: h["value"] for h in rule["matches"][0]["headers"]}
    assert headers == {"x-team": "a", "X-Gateway-Base-Model-Name": "llama-3"}
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"


@pytest.mark.parametrize(("values", "message"), [
    ({"inferencePool": {"modelServers": {"matchLabels": None}}}, "matchLabels is required"),
    ({"inferenceExtension": {"pluginsConfigFile": "missing.yaml"}}, "missing.yaml"),
    ({"provider": {"name": "aws"}}, "provider"),
    ({"inferencePool": {"modelServerType": "llamacpp"}}, "modelServerType"),
    ({"inferenceExtension": {"failureMode": "Sometimes"}}, "failureMode"),
    ({"inferenceExtension": {"profile": "fastest"}}, "/inferenceExtension/profile"),  # the values schema
    ({"inferenceExtension": {"profile": "weighted", "maxNumSeqs": 8}}, "inferenceExtension.maxNumSeqs"),
], ids=["no-selector", "missing-config-file", "unknown-provider", "unknown-engine", "bad-failure-mode",
        "unknown-profile", "max-num-seqs-without-prediction"])
def test_bad_values_fail_with_a_clear_message(helm: str, tmp_path: Path, values: dict[str, Any], message: str) -> None:
    result = run_helm(helm, "template", "r1", str(CHART), *value_args(values, tmp_path))
    assert result.returncode != 0
    assert message in result.stderr


def test_a_tgi_pool_gets_the_tgi_engine(helm: str, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, {"inferencePool": {"modelServerType": "tgi", "targetPorts": [{"number": 80}],
                                                     "modelServers": {"matchLabels": {"app": "tgi"}}}})
    [configmap] = [c for c in by_kind(docs, "ConfigMap") if not c["metadata"]["name"].endswith("-dashboard")]
    text = configmap["data"]["default-plugins.yaml"]
    extractor = next(p for p in yaml.safe_load(text)["plugins"] if p["type"] == "core-metrics-extractor")
    assert extractor["parameters"]["defaultEngine"] == "tgi"
    assert load_config(text, Datastore()).extractor.default_engine == "tgi"  # type: ignore[union-attr]
    assert one(docs, "InferencePool")["spec"]["targetPorts"] == [{"number": 80}]


def default_plugins(docs: list[dict[str, Any]]) -> str:
    [configmap] = [c for c in by_kind(docs, "ConfigMap") if not c["metadata"]["name"].endswith("-dashboard")]
    return str(configmap["data"]["default-plugins.yaml"])


@pytest.mark.parametrize("profile", sorted(PRESETS))
def test_the_chart_renders_the_epps_own_profiles(helm: str, tmp_path: Path, profile: str) -> None:
    """A Helm install gets what `epp serve` without a config runs (predicted latency), not the
    weighted sum it replaced; the other presets are one value away."""
    values = None if profile == DEFAULT_PRESET else {"inferenceExtension": {"profile": profile}}
    text = default_plugins(render(helm, tmp_path, values))
    rendered = yaml.safe_load(text)
    extractor = next(p for p in rendered["plugins"] if p["type"] == "core-metrics-extractor")
    assert extractor.pop("parameters") == {"defaultEngine": "vllm"}  # the pool's engine, added by the chart
    assert rendered == yaml.safe_load(PRESETS[profile])
    load_config(text, Datastore())


def test_the_servers_max_num_seqs_reaches_the_slot_wait(helm: str, tmp_path: Path) -> None:
    text = default_plugins(render(helm, tmp_path, {"inferenceExtension": {"maxNumSeqs": 8}}))
    producer = next(p for p in yaml.safe_load(text)["plugins"] if p["type"] == "predicted-latency-producer")
    assert producer["parameters"] == {"maxNumSeqs": 8}
    assert load_config(text, Datastore()).plugins["predicted-latency-producer"].prior.max_num_seqs == 8
