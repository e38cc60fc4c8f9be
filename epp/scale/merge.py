"""One /metrics and one admin status for a pod of several workers.

Every worker keeps its own registry (its requests, its scheduling times); the supervisor fetches
each one's exposition and adds them up, so the pod exposes exactly the reference's metric names
once. Counters, histograms and summaries add (their `_created` takes the earliest). Gauges are of
two kinds: a worker's own quantity (requests it has running, requests queued in its flow
control) adds; a view of the pool (a pod's queue or KV use, an endpoint's in-flight count, which
every worker folds pool-wide already, saturation, index size) is the same in every worker up to
the moment each read it, and the pod reports the largest (for ages: the oldest).

The admin status: endpoints and saturation from one worker (each sees the whole pool), queues
from whoever holds them (the dispatcher), decisions from all, newest first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from epp.admin.v1 import admin_pb2

# Gauges that count something each worker holds on its own: the pod's value is their sum.
SUMMED_GAUGES = frozenset({
    "inference_objective_running_requests",
    "inference_extension_flow_control_queue_size",
    "inference_extension_flow_control_queue_bytes",
})
_ADDED = ("counter", "histogram", "summary", "gaugehistogram")


def _rule(family: Metric) -> str:
    if family.type in _ADDED or family.name in SUMMED_GAUGES:
        return "sum"
    if family.name.endswith("_created"):
        return "min"
    return "max"


def merge_families(expositions: Iterable[str]) -> list[Metric]:
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in expositions:
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            rule = _rule(family)
            table = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = table.get(key)
                if old is None:
                    table[key] = sample.value
                elif rule == "sum":
                    table[key] = old + sample.value
                elif rule == "min":
                    table[key] = min(old, sample.value)
                else:
                    table[key] = max(old, sample.value)
    for name, family in merged.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return list(merged.values())


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_expositions(expositions: Iterable[str]) -> bytes:
    """The text exposition of the expositions' sum (see the module's rules)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merge_families(expositions)))
    return generate_latest(registry)


def merge_status(statuses: list[admin_pb2.Status], *, ready: bool, decisions: int) -> admin_pb2.Status:
    """The pod's status from its members' (the first that lists endpoints gives the pool view)."""
    if not statuses:
        return admin_pb2.Status(ready=ready)
    base = next((s for s in statuses if s.endpoints), statuses[0])
    out = admin_pb2.Status()
    out.CopyFrom(base)
    out.ready = ready
    out.requests_total = sum(s.requests_total for s in statuses)
    out.uptime_seconds = max(s.uptime_seconds for s in statuses)
    out.flow_control_enabled = any(s.flow_control_enabled for s in statuses)
    del out.queues[:]
    del out.decisions[:]
    for status in statuses:
        out.queues.extend(status.queues)
    newest = sorted((d for s in statuses for d in s.decisions), key=lambda d: -d.time)[:decisions]
    out.decisions.extend(newest)
    return out
