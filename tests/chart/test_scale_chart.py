"""The chart's scale values: workers per pod and active-active replicas (an existing Redis/Valkey
URL, a Secret holding it, or a bundled Valkey), rendered by a real helm, every object validated,
and the EPP's command line parsed by `epp serve`'s own parser."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.chart.conftest import by_kind, container, one, render, run_helm, validate, value_args
from tests.chart.test_chart import serve_options

WORKERS = {"inferenceExtension": {"workers": 4, "resources": {"requests": {"cpu": "4"}, "limits": {"cpu": "4"}}}}
EXISTING = {"inferenceExtension": {"replicas": 3, "activeActive": {
    "enabled": True, "url": "redis://valkey.infra.svc:6379/0", "peerTTL": "5s", "channel": "epp:team-a"}}}
SECRET = {"inferenceExtension": {"replicas": 2, "activeActive": {
    "enabled": True, "urlSecret": {"name": "epp-redis", "key": "url"}}}}
BUNDLED = {"inferenceExtension": {"replicas": 2, "workers": 2, "activeActive": {
    "enabled": True, "bundled": {"enabled": True}}}}


def env(deployment: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container(deployment, "epp")["env"]}


@pytest.mark.parametrize("values", [WORKERS, EXISTING, SECRET, BUNDLED], ids=["workers", "existing", "secret",
                                                                                "bundled"])
def test_lint_and_validate(helm: str, tmp_path: Path, values: dict[str, Any]) -> None:
    result = run_helm(helm, "lint", "--strict", str(Path(__file__).resolve().parents[2] / "charts" / "inferencepool"),
                      "--namespace", "llm", *value_args(values, tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    for doc in render(helm, tmp_path, values):
        validate(doc)


def test_workers(helm: str, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, WORKERS)
    deployment = one(docs, "Deployment")
    assert serve_options(deployment).workers == 4
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"  # the workers' shared segment
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(deployment, "epp")["volumeMounts"]
    default = one(render(helm, tmp_path / "d", {}), "Deployment")
    assert serve_options(default).workers == 1
    assert "dshm" not in {v["name"] for v in default["spec"]["template"]["spec"]["volumes"]}


def test_active_active_with_an_existing_server(helm: str, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, EXISTING)
    deployment = one(docs, "Deployment")
    options = serve_options(deployment)
    assert options.replicas_url == "$(EPP_REPLICAS_URL)"  # Kubernetes expands it from the env
    assert env(deployment)["EPP_REPLICAS_URL"]["value"] == "redis://valkey.infra.svc:6379/0"
    assert (options.replicas_channel, options.replicas_peer_ttl) == ("epp:team-a", 5.0)
    assert not options.ha_enable_leader_election  # every replica serves
    assert deployment["spec"]["replicas"] == 3 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    roles = {r["metadata"]["name"] for r in by_kind(docs, "Role")}
    assert roles == {"r1-epp"}  # no Lease RBAC without leader election; nothing new needed
    assert not [d for d in docs if d["metadata"]["name"].endswith("-valkey")]


def test_active_active_url_from_a_secret(helm: str, tmp_path: Path) -> None:
    deployment = one(render(helm, tmp_path, SECRET), "Deployment")
    assert env(deployment)["EPP_REPLICAS_URL"]["valueFrom"] == {"secretKeyRef": {"name": "epp-redis", "key": "url"}}


def test_active_active_with_a_bundled_valkey(helm: str, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, BUNDLED)
    epp = one(docs, "Deployment", "r1-epp")
    store = one(docs, "Deployment", "r1-epp-valkey")
    service = one(docs, "Service", "r1-epp-valkey")
    assert env(epp)["EPP_REPLICAS_URL"]["value"] == "redis://r1-epp-valkey.llm.svc:6379/0"
    assert service["spec"]["selector"] == store["spec"]["selector"]["matchLabels"]
    # The EPP's selectors never match the store's pod, nor the store's the EPP's.
    epp_selector = epp["spec"]["selector"]["matchLabels"].items()
    assert not epp_selector <= store["spec"]["template"]["metadata"]["labels"].items()
    assert not store["spec"]["selector"]["matchLabels"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    assert one(docs, "Service", "r1-epp")["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    valkey = container(store, "valkey")
    assert valkey["args"][:2] == ["--save", ""] and valkey["securityContext"]["readOnlyRootFilesystem"]


def test_active_active_needs_a_server(helm: str, tmp_path: Path) -> None:
    values = {"inferenceExtension": {"activeActive": {"enabled": True}}}
    result = run_helm(helm, "template", "r1", str(Path(__file__).resolve().parents[2] / "charts" / "inferencepool"),
                      "--namespace", "llm", *value_args(values, tmp_path))
    assert result.returncode != 0 and "activeActive needs url" in result.stderr


def test_workers_need_the_discovery_mode_of_kv_events(helm: str, tmp_path: Path) -> None:
    values = {"inferenceExtension": {"workers": 2, "precisePrefixCache": {
        "enabled": True, "mode": "central", "modelName": "tiny", "tokenizer": {"configMap": "tiny"}}}}
    result = run_helm(helm, "template", "r1", str(Path(__file__).resolve().parents[2] / "charts" / "inferencepool"),
                      "--namespace", "llm", *value_args(values, tmp_path))
    assert result.returncode != 0 and "mode discovery" in result.stderr
