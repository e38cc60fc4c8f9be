"""The chart's precise prefix-cache values: rendered by a real helm, every object validated, and
the rendered plugin configuration loaded by the EPP's own loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from epp.config.loader import load_config
from epp.datastore import Datastore
from tests.chart.conftest import CHART, by_kind, container, one, render, run_helm, validate, value_args
from tests.precise.helpers import MODEL_DIR


def values(**precise: Any) -> dict[str, Any]:
    return {"inferenceExtension": {"precisePrefixCache": {"enabled": True, "modelName": "tiny", **precise}}}


CENTRAL = values(tokenizer={"configMap": "tiny-tokenizer"})
DISCOVERY = {"inferenceExtension": {"replicas": 3, "precisePrefixCache": {
    "enabled": True, "mode": "discovery", "socketPort": 5557, "replayPort": 5558, "modelName": "tiny",
    "evictionForesight": False,
    "tokenizer": {"persistentVolumeClaim": "models", "subPath": "tiny"}}}}


def plugin_config(docs: list[dict[str, Any]]) -> str:
    [configmap] = [c for c in by_kind(docs, "ConfigMap") if not c["metadata"]["name"].endswith("-dashboard")]
    return configmap["data"]["default-plugins.yaml"]


def loads(text: str) -> Any:
    return load_config(text.replace("path: /tokenizer", f"path: '{MODEL_DIR}'"), Datastore())


def test_central_mode(helm: str, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, CENTRAL)
    for doc in docs:
        validate(doc)
    deployment = one(docs, "Deployment")
    epp = container(deployment, "epp")
    assert {"name": "zmq-kv-events", "containerPort": 5557, "protocol": "TCP"} in epp["ports"]
    ports = {p["name"]: p for p in one(docs, "Service")["spec"]["ports"]}
    assert ports["zmq-kv-events"]["port"] == 5557
    mounts = {m["name"]: m for m in epp["volumeMounts"]}
    assert mounts["tokenizer"]["mountPath"] == "/tokenizer" and mounts["tokenizer"]["readOnly"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tokenizer"]["configMap"]["name"] == "tiny-tokenizer"
    config = loads(plugin_config(docs))
    producer = config.plugins["precise-prefix-cache-producer"]
    assert producer.config.events.zmq_endpoint == "tcp://*:5557" and producer.config.speculative
    assert producer.config.eviction_foresight
    assert config.plugins["predicted-latency-producer"].prefix_producer is producer  # the cache credit
    assert "approx-prefix-cache-producer" not in config.plugins


def test_discovery_mode_with_replicas(helm: str, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, DISCOVERY)
    for doc in docs:
        validate(doc)
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    epp = container(deployment, "epp")
    assert "zmq-kv-events" not in {p["name"] for p in epp["ports"]}
    mounts = {m["name"]: m for m in epp["volumeMounts"]}
    assert mounts["tokenizer"]["subPath"] == "tiny"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tokenizer"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    producer = loads(plugin_config(docs)).plugins["precise-prefix-cache-producer"]
    assert not producer.config.eviction_foresight  # as the values asked
    events = producer.config.events
    assert not events.central and events.sockets.port == 5557 and events.replay.port == 5558


def test_remote_tokenizer_only(helm: str, tmp_path: Path) -> None:
    docs = render(helm, tmp_path, values(tokenizer={"vllmUrl": "http://vllm.llm:8000"}))
    token = loads(plugin_config(docs)).plugins["token-producer"]
    assert token.vllm_url == "http://vllm.llm:8000" and token.local is None
    assert "tokenizer" not in {m["name"] for m in container(one(docs, "Deployment"), "epp")["volumeMounts"]}


@pytest.mark.parametrize("bad, message", [
    (values(), "needs a tokenizer"),
    ({"inferenceExtension": {"replicas": 2, **values(tokenizer={"configMap": "t"})["inferenceExtension"]}},
     "mode=central takes one replica"),
    (values(tokenizer={"configMap": "a", "persistentVolumeClaim": "b"}), "exclusive"),
    (values(mode="both", tokenizer={"configMap": "a"}), "mode"),
])
def test_bad_values_fail_with_a_message(helm: str, tmp_path: Path, bad: dict[str, Any], message: str) -> None:
    result = run_helm(helm, "template", "r1", str(CHART), "--namespace", "llm", *value_args(bad, tmp_path))
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_lint(helm: str, tmp_path: Path) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), "--namespace", "llm", *value_args(DISCOVERY, tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
