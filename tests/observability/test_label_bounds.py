"""A client or a pod cannot grow the EPP's own metrics: model names, fairness ids, priorities and
pod names are bounded label values, and every request is still counted exactly."""

from __future__ import annotations

import aiohttp
import orjson
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from epp.api.request import Api, InferenceRequest, parse_request
from epp.api.response import Usage
from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.observability.labels import MAX_LABEL_CHARS, OTHER, LabelLimits
from epp.observability.metrics import EppMetrics
from epp.runner import EndpointPicker
from tests.conftest import channel_to, running_picker
from tests.extproc.client import ExtProcClient, body_msg, headers_msg, request_headers

MIB = 1 << 20
SERVED = "meta-llama/Llama-3.1-8B-Instruct"
ADAPTER = "sql-lora"


def total(text: str, family: str, **labels: str) -> float:
    """Sum of a family's samples (counters: `_total`; histograms: `_count`) matching `labels`."""
    out = 0.0
    for fam in text_string_to_metric_families(text):
        if fam.name != family:
            continue
        for s in fam.samples:
            if s.name.endswith(("_total", "_count")) or fam.type == "gauge":
                if all(s.labels.get(k) == v for k, v in labels.items()):
                    out += s.value
    return out


def label_values(text: str, family: str, label: str) -> set[str]:
    return {s.labels[label] for fam in text_string_to_metric_families(text) if fam.name == family
            for s in fam.samples if label in s.labels}


def request(model: str, *, fairness: str = "default-flow", priority: int = 0, target: str = "") -> InferenceRequest:
    return InferenceRequest(request_id="r", api=Api.COMPLETIONS, model=model,
                            target_model=target or model, body={"model": model}, fairness_id=fairness,
                            priority=priority, body_size=100)


async def serve_through_the_director(picker: EndpointPicker, model: str, fairness: str = "") -> None:
    """One request through the real request path below the Envoy protocol: parse, admission,
    scheduling, accounting, release with usage."""
    headers = {"x-gateway-inference-fairness-id": fairness} if fairness else {}
    req = parse_request(orjson.dumps({"model": model, "prompt": "hello", "max_tokens": 4}),
                        path="/v1/completions", request_id="r", headers=headers)
    _, record = await picker.director.handle_request(req)
    picker.director.release(record, Usage(prompt_tokens=2, completion_tokens=4, total_tokens=6), 120)


async def scrape(picker: EndpointPicker) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{picker.metrics_port}/metrics") as r:
            assert r.status == 200
            return await r.text()


async def test_ten_thousand_new_model_names_leave_metrics_small_and_counts_exact() -> None:
    async with running_picker(metrics_model_names="configured-model") as picker:
        pod = picker.datastore.endpoints()[0]
        pod.metrics = EndpointMetrics(models=frozenset({SERVED}), active_models=frozenset({ADAPTER}), update_time=1.0)
        before = len((await scrape(picker)).encode())
        names = [f"{i:05d}-" + "x" * 194 for i in range(10_000)]  # 200 characters each, never served
        for name in names:
            await serve_through_the_director(picker, name)
        for name in (SERVED, ADAPTER, "configured-model"):
            await serve_through_the_director(picker, name)
        text = await scrape(picker)
    size = len(text.encode())
    assert size < MIB, size
    assert size < before + 256 * 1024  # the folded series, not one set per name
    # every request counted, exactly: 10,000 under "other", each served name under its own
    assert total(text, "inference_objective_request") == 10_003
    assert total(text, "inference_objective_request", model_name=OTHER, target_model_name=OTHER) == 10_000
    for name in (SERVED, ADAPTER, "configured-model"):
        assert total(text, "inference_objective_request", model_name=name) == 1
        assert total(text, "inference_objective_request_duration_seconds", model_name=name) == 1
    assert total(text, "inference_objective_request_duration_seconds") == 10_003
    assert total(text, "inference_objective_output_tokens") == 10_003
    assert total(text, "inference_extension_scheduler_attempts", status="success") == 10_003
    assert label_values(text, "inference_objective_request", "model_name") == {
        OTHER, SERVED, ADAPTER, "configured-model"}
    assert total(text, "inference_objective_running_requests") == 0
    assert total(text, "inference_extension_metric_labels_folded", metric="inference_objective_request_total",
                 label="model_name", reason="unknown_model") == 10_000


def test_a_one_mebibyte_name_is_folded_even_past_the_parser() -> None:
    """The parser rejects such a name (below); the metrics bound it anyway, as a second wall."""
    datastore = Datastore()
    metrics = EppMetrics(datastore)
    huge = "m" * MIB
    datastore.upsert(EndpointSpec("pod", "10.0.0.1", 8000)).metrics = EndpointMetrics(models=frozenset({huge}))
    req = request(huge)
    metrics.request_received(req)
    metrics.running_changed(huge, +1)
    metrics.scheduled(req, datastore.endpoints()[0], 0.001)
    metrics.flow_queue_changed("default-flow", 0, huge, huge, 1, 100)
    metrics.flow_queue_changed("default-flow", 0, huge, huge, -1, -100)
    metrics.flow_request_done("default-flow", 0, huge, huge, "Dispatched", 0.01)
    metrics.request_finished(req, Usage(1, 1, 2), 10, 0.5)
    metrics.request_error(req, "Internal")
    metrics.running_changed(huge, -1)
    text = generate_latest(metrics.registry).decode()
    assert len(text) < 64 * 1024
    assert "m" * MAX_LABEL_CHARS not in text
    assert total(text, "inference_objective_request", model_name=OTHER) == 1
    assert total(text, "inference_extension_metric_labels_folded", metric="inference_objective_request_total",
                 reason="too_long") == 2  # model and target


async def test_a_model_name_over_1_kib_is_a_400() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        for size, status in ((1024, 0), (1025, 400), (MIB, 400)):
            client = ExtProcClient(channel)
            await client.send(headers_msg(request_headers()),
                              body_msg(orjson.dumps({"model": "m" * size, "prompt": "hi"})))
            (reply,) = await client.recv(1)
            assert reply.immediate_response.status.code == status, size
            if status:
                assert b"model name too long: " in reply.immediate_response.body
                assert b"at most 1024" in reply.immediate_response.body
            await client.close()


def test_fairness_ids_priorities_and_pod_names_are_bounded() -> None:
    datastore = Datastore()
    limits = LabelLimits(fairness_ids=10, priorities=5, endpoints=8)
    metrics = EppMetrics(datastore, known_models=["m"], limits=limits)
    for i in range(10_000):
        fairness = f"tenant-{i}"
        metrics.flow_queue_changed(fairness, i % 50, "m", "m", 1, 10)
        metrics.flow_enqueue_duration(fairness, i % 50, "Enqueued", 0.0001)
        metrics.flow_request_done(fairness, i % 50, "m", "m", "Dispatched", 0.01)
        metrics.flow_queue_changed(fairness, i % 50, "m", "m", -1, -10)
        metrics.request_received(request("m", fairness=fairness, priority=i % 50))
        pod = datastore.upsert(EndpointSpec(f"pod-{i}", "10.0.0.1", 8000 + i % 1000, namespace=f"ns-{i}"))
        metrics.scheduled(request("m"), pod, 0.001)
        datastore.remove(pod.address)  # pod churn: a rolling restart
    text = generate_latest(metrics.registry).decode()
    assert len(text) < MIB
    fairness_ids = label_values(text, "inference_extension_flow_control_request_queue_duration_seconds", "fairness_id")
    assert len(fairness_ids) == 11 and OTHER in fairness_ids
    assert len(label_values(text, "inference_objective_request", "priority")) == 6
    assert len(label_values(text, "inference_extension_scheduler_attempts", "pod_name")) <= 9
    assert total(text, "inference_extension_flow_control_request_queue_duration_seconds") == 10_000
    assert total(text, "inference_extension_scheduler_attempts") == 10_000
    assert total(text, "inference_extension_flow_control_queue_size") == 0  # every flow left


def test_the_series_budget_folds_known_names_too_and_counts_stay_exact() -> None:
    datastore = Datastore()
    served = frozenset(f"adapter-{i}" for i in range(500))
    datastore.upsert(EndpointSpec("pod", "10.0.0.1", 8000)).metrics = EndpointMetrics(active_models=served)
    metrics = EppMetrics(datastore, limits=LabelLimits(series=2_000))
    for name in sorted(served):
        req = request(name)
        metrics.request_received(req)
        metrics.request_finished(req, Usage(1, 1, 2), 10, 0.5)
    text = generate_latest(metrics.registry).decode()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    # the budget, plus one folded label set per family (~300 lines for these eight), the folded
    # counter itself and the families without guarded labels
    assert len(lines) < 2_000 + 500
    assert total(text, "inference_objective_request") == 500
    assert total(text, "inference_objective_request_duration_seconds") == 500
    folded = total(text, "inference_extension_metric_labels_folded", metric="inference_objective_request_total",
                   label="model_name")
    by_budget = total(text, "inference_extension_metric_labels_folded", metric="inference_objective_request_total",
                      label="model_name", reason="series_budget")
    kept = total(text, "inference_objective_request") - total(text, "inference_objective_request", model_name=OTHER)
    assert by_budget > 0 and kept > 0 and folded + kept == 500
    assert label_values(text, "inference_objective_request", "priority") == {"0"}  # a priority is kept


def test_a_running_model_keeps_its_label_until_it_is_back_at_zero() -> None:
    """The gauge goes up and down under the same label even if the name becomes known between."""
    datastore = Datastore()
    metrics = EppMetrics(datastore)
    metrics.running_changed("late", +1)  # not served yet: under "other"
    datastore.upsert(EndpointSpec("pod", "10.0.0.1", 8000)).metrics = EndpointMetrics(models=frozenset({"late"}))
    metrics.known_models.refresh = 0.0
    metrics.running_changed("late", +1)  # same model still running: same label
    metrics.running_changed("late", -1)
    metrics.running_changed("late", -1)
    registry = metrics.registry
    assert registry.get_sample_value("inference_objective_running_requests", {"model_name": OTHER}) == 0
    assert registry.get_sample_value("inference_objective_running_requests", {"model_name": "late"}) is None
    metrics.running_changed("late", +1)  # a new run: now it is known
    assert registry.get_sample_value("inference_objective_running_requests", {"model_name": "late"}) == 1
