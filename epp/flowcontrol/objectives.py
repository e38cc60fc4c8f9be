"""InferenceObjective manifests from a file (`--objectives-file`): the priority classes.

A request names its objective in `x-gateway-inference-objective`; the objective's
`spec.priority` places it in a band (unset means 0; negative means sheddable). This reads the
same manifests a cluster would hold (`inference.networking.x-k8s.io/v1alpha2`, kind
`InferenceObjective`) so one file serves both static and Kubernetes setups; the Kubernetes
watcher feeds the same datastore API (`Datastore.set_objective`).

The file holds one or more YAML documents, each an InferenceObjective or a list of them
(`kind: List` / `InferenceObjectiveList` with `items`). Objectives whose `spec.poolRef.name`
names another pool than ours are skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from epp.params import ConfigError
from epp.datastore import Datastore

API_VERSION = "inference.networking.x-k8s.io/v1alpha2"
KIND = "InferenceObjective"
_LIST_KINDS = ("List", "InferenceObjectiveList")


def parse_objectives(text: str, *, source: str = "objectives", pool_name: str = "") -> dict[str, int | None]:
    """Objective name -> priority (None when unset). Raises ConfigError naming the document and field."""
    try:
        documents = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    found: dict[str, int | None] = {}
    for d, doc in enumerate(documents):
        if doc is None:
            continue
        where = f"{source}: document {d + 1}"
        if not isinstance(doc, dict):
            raise ConfigError(f"{where}: must be a mapping")
        if doc.get("kind") in _LIST_KINDS:
            items = doc.get("items")
            if not isinstance(items, list):
                raise ConfigError(f"{where}.items: must be a list")
            entries = [(f"{where}.items[{i}]", item) for i, item in enumerate(items)]
        else:
            entries = [(where, doc)]
        for path, entry in entries:
            name, priority, pool = _objective(entry, path)
            if pool_name and pool and pool != pool_name:
                continue
            if name in found:
                raise ConfigError(f"{path}.metadata.name: duplicate objective {name!r}")
            found[name] = priority
    return found


def _objective(entry: Any, path: str) -> tuple[str, int | None, str]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{path}: must be a mapping")
    if entry.get("apiVersion") != API_VERSION:
        raise ConfigError(f"{path}.apiVersion: must be {API_VERSION!r}, got {entry.get('apiVersion')!r}")
    if entry.get("kind") != KIND:
        raise ConfigError(f"{path}.kind: must be {KIND!r}, got {entry.get('kind')!r}")
    metadata = entry.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.metadata.name: required")
    spec = entry.get("spec") or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}.spec: must be a mapping")
    priority = spec.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ConfigError(f"{path}.spec.priority: must be an integer, got {priority!r}")
    pool_ref = spec.get("poolRef") or {}
    pool = pool_ref.get("name", "") if isinstance(pool_ref, dict) else ""
    return name, priority, pool if isinstance(pool, str) else ""


def load_objectives_file(path: str | Path, datastore: Datastore, *, pool_name: str = "") -> int:
    """Load a file's objectives into the datastore; returns how many were loaded."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read objectives: {exc}") from None
    objectives = parse_objectives(text, source=str(path), pool_name=pool_name)
    for name, priority in objectives.items():
        datastore.set_objective(name, priority)
    return len(objectives)
