"""The Grafana dashboard shipped with the chart is valid and queries only metrics the EPP exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import running_picker

DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "inferencepool" / "dashboards" / "epp.json"
_METRIC = re.compile(r"\b(inference_[a-z0-9_]+)\b(?!\s*=)")  # not label names
_SUFFIX = re.compile(r"_(bucket|sum|count|total)$")

FLOW_CONTROL = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}, {pluginRef: prefix-cache-scorer}]
flowControl: {}
"""


def queried_metrics(dashboard: dict) -> set[str]:
    names = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            names |= {_SUFFIX.sub("", m) for m in _METRIC.findall(target["expr"])}
    for variable in dashboard["templating"]["list"]:
        names |= {_SUFFIX.sub("", m) for m in _METRIC.findall(str(variable.get("query", "")))}
    return names


def test_dashboard_is_valid_grafana_json() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24


async def test_every_queried_metric_is_exported() -> None:
    wanted = queried_metrics(json.loads(DASHBOARD.read_text()))
    assert len(wanted) > 15
    async with running_picker(config_text=FLOW_CONTROL) as picker:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{picker.metrics_port}/metrics") as r:
                text = await r.text()
    exported = {_SUFFIX.sub("", f.name) for f in text_string_to_metric_families(text)}
    assert wanted <= exported, sorted(wanted - exported)
