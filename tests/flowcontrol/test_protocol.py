"""Flow control through the real gRPC ext_proc server, driven with Envoy's message types:
queueing and late dispatch, 429 on capacity, 503 on TTL, a client leaving while queued, the vLLM
`priority` body mutation, legacy shedding and the flow-control metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson

from epp.flowcontrol.flow_admission import FlowControlAdmission
from epp.runner import EndpointPicker
from tests.conftest import channel_to, running_picker
from tests.extproc.client import (
    ExtProcClient,
    body_msg,
    headers_msg,
    request_headers,
    response_body_msg,
    response_headers_msg,
    set_headers,
    streamed_body,
)

ONE_POD = "10.0.0.1:8000"

CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- {type: concurrency-detector, parameters: {maxConcurrency: 1}}
- type: round-robin-fairness-policy
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
saturationDetector: {pluginRef: concurrency-detector}
dataLayer: {sources: []}
flowControl:
  defaultPriorityBand: {fairnessPolicyRef: round-robin-fairness-policy}
"""

OBJECTIVES = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: chat}
spec: {priority: 10}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1}
"""


def completion(prompt: str = "hello world") -> bytes:
    return orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 5})


def admission(picker: EndpointPicker) -> FlowControlAdmission:
    assert isinstance(picker.admission, FlowControlAdmission)
    return picker.admission


def inflight(picker: EndpointPicker) -> int:
    return sum(ep.inflight_requests for ep in picker.datastore.endpoints())


def sample(picker: EndpointPicker, name: str, **labels: str) -> float:
    if name.startswith("inference_extension_flow_control_") and "cycle" not in name and "enqueue" not in name:
        labels["inference_pool"] = picker.datastore.pool.name
    value = picker.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def until(condition: Callable[[], bool], what: str = "condition") -> None:
    for _ in range(400):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def send(channel, headers: dict[str, str] | None = None, body: bytes | None = None) -> ExtProcClient:  # type: ignore[no-untyped-def]
    client = ExtProcClient(channel)
    await client.send(headers_msg(request_headers(**(headers or {}))), body_msg(body or completion()))
    return client


async def picked(client: ExtProcClient) -> tuple[str, bytes]:
    header_reply, body_reply = await client.recv(2)
    forwarded, _, _ = streamed_body([body_reply])
    return set_headers(header_reply)["x-gateway-destination-endpoint"], forwarded


async def respond(client: ExtProcClient, usage: dict[str, int] | None = None) -> None:
    """The model server answers and the response ends: the request's accounting is released."""
    body = orjson.dumps({"choices": [{"text": "hi"}], "usage": usage or {"prompt_tokens": 3, "completion_tokens": 2}})
    await client.send(response_headers_msg({":status": "200", "content-type": "application/json"}),
                      response_body_msg(body, eos=True))
    await client.recv(2)
    await client.close()


async def test_a_queued_request_is_dispatched_when_the_first_one_finishes() -> None:
    async with running_picker(static_endpoints=ONE_POD, config_text=CONFIG,  # dataLayer off: name the model
                              metrics_model_names="m") as picker, channel_to(picker) as channel:
        first = await send(channel, {"x_gateway_inference_fairness_id": "a"})
        assert (await picked(first))[0] == ONE_POD
        second = await send(channel, {"x_gateway_inference_fairness_id": "b"})
        await until(lambda: len(admission(picker).controller) == 1, "the second request to queue")
        assert sample(picker, "inference_extension_flow_control_queue_size", fairness_id="b", priority="0",
                      model_name="m", target_model_name="m") == 1
        assert inflight(picker) == 1
        await respond(first)
        assert (await picked(second))[0] == ONE_POD
        assert len(admission(picker).controller) == 0
        await respond(second)
        await until(lambda: inflight(picker) == 0 and admission(picker).controller.inflight == 0)
        assert sample(picker, "inference_extension_flow_control_request_queue_duration_seconds_count",
                      fairness_id="b", priority="0", outcome="Dispatched",
                      model_name="m", target_model_name="m") == 1


async def test_a_full_band_rejects_with_429() -> None:
    config = CONFIG.replace("defaultPriorityBand: {", "defaultPriorityBand: {maxRequests: 1, ")
    async with running_picker(static_endpoints=ONE_POD, config_text=config) as picker, channel_to(picker) as channel:
        first = await send(channel)
        await picked(first)
        await send(channel)
        await until(lambda: len(admission(picker).controller) == 1)
        third = await send(channel)
        [reply] = await third.recv(1)
        assert reply.immediate_response.status.code == 429
        assert reply.immediate_response.body.decode().startswith(
            "inference error: ResourceExhausted - request rejected by flow control: priority band 0 is full "
            "(maxRequests 1)")
        assert sample(picker, "inference_extension_flow_control_rejections_total", reason="band_capacity",
                      priority="0") == 1


async def test_a_request_that_waits_past_its_ttl_gets_503() -> None:
    config = CONFIG + "  defaultRequestTTL: 150ms\n"
    async with running_picker(static_endpoints=ONE_POD, config_text=config) as picker, channel_to(picker) as channel:
        first = await send(channel)
        await picked(first)
        second = await send(channel)
        [reply] = await second.recv(1)
        assert reply.immediate_response.status.code == 503
        assert reply.immediate_response.body.decode().startswith(
            "inference error: ServiceUnavailable - request timed out in queue after")
        assert len(admission(picker).controller) == 0 and admission(picker).controller.queued_bytes == 0
        assert inflight(picker) == 1  # only the first, still running


async def test_a_client_that_leaves_while_queued_leaves_nothing_behind() -> None:
    async with running_picker(static_endpoints=ONE_POD, config_text=CONFIG) as picker, channel_to(picker) as channel:
        first = await send(channel)
        await picked(first)
        waiting = [await send(channel, {"x_gateway_inference_fairness_id": f"user{i}"}) for i in range(3)]
        controller = admission(picker).controller
        await until(lambda: len(controller) == 3, "three queued")
        for client in waiting:
            client.cancel()
        await until(lambda: len(controller) == 0 and picker.extproc.active_streams == 1, "the queue to empty")
        assert controller.queued_bytes == 0 and controller.band(0).flows.keys() == {"default-flow"}
        assert sample(picker, "inference_extension_flow_control_queue_size", fairness_id="user0", priority="0",
                      model_name="m", target_model_name="m") == 0
        assert sample(picker, "inference_extension_flow_control_rejections_total", reason="cancelled",
                      priority="0") == 3
        await respond(first)
        await until(lambda: inflight(picker) == 0 and controller.inflight == 0 and picker.extproc.active_streams == 0)
        assert controller.band(0).flows == {}


async def test_vllm_priority_is_written_into_the_forwarded_body(tmp_path) -> None:  # type: ignore[no-untyped-def]
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text(OBJECTIVES)
    config = CONFIG.replace("maxConcurrency: 1", "maxConcurrency: 10") + "  vllmPriority: {bandStride: 100}\n"
    async with running_picker(static_endpoints=ONE_POD, config_text=config,
                              objectives_file=str(objectives)) as picker, channel_to(picker) as channel:
        seen = []
        for objective, user in (("chat", "a"), ("chat", "a"), ("chat", "b"), ("batch", "c"), ("", "a")):
            headers = {"x_gateway_inference_fairness_id": user}
            if objective:
                headers["x_gateway_inference_objective"] = objective
            client = await send(channel, headers)
            header_reply, body_reply = await client.recv(2)
            forwarded, _, _ = streamed_body([body_reply])
            assert set_headers(header_reply)["content-length"] == str(len(forwarded))
            body = orjson.loads(forwarded)
            assert body["prompt"] == "hello world" and body["model"] == "m"
            seen.append(body["priority"])
        # chat (priority 10) → -1000 + the user's place; batch (-1) → +100; no objective → band 0.
        assert seen == [-1000, -999, -1000, 100, 0]


async def test_without_vllm_priority_the_body_is_forwarded_untouched() -> None:
    async with running_picker(static_endpoints=ONE_POD, config_text=CONFIG) as picker, channel_to(picker) as channel:
        body = b'{"model": "m",   "prompt": "spacing kept", "max_tokens": 5}'
        client = await send(channel, body=body)
        assert (await picked(client))[1] == body


async def test_legacy_admission_sheds_sheddable_requests_with_429_when_saturated(tmp_path) -> None:  # type: ignore[no-untyped-def]
    objectives = tmp_path / "objectives.yaml"
    objectives.write_text(OBJECTIVES)
    # No flow control; no metrics are scraped, so the utilization detector counts the pool as full.
    async with running_picker(objectives_file=str(objectives)) as picker, channel_to(picker) as channel:
        client = await send(channel, {"x_gateway_inference_objective": "batch"})
        [reply] = await client.recv(1)
        assert reply.immediate_response.status.code == 429
        assert b"system saturated, sheddable request dropped" in reply.immediate_response.body
        chat = await send(channel, {"x_gateway_inference_objective": "chat"})
        await picked(chat)
        assert sample(picker, "inference_extension_flow_control_rejections_total", reason="saturated",
                      priority="-1") == 1
        assert sample(picker, "inference_extension_flow_control_pool_saturation") == 1.0


async def test_stopping_ends_queued_requests_with_503() -> None:
    async with running_picker(static_endpoints=ONE_POD, config_text=CONFIG) as picker, channel_to(picker) as channel:
        first = await send(channel)
        await picked(first)
        second = await send(channel)
        await until(lambda: len(admission(picker).controller) == 1)
        await admission(picker).stop()
        [reply] = await second.recv(1)
        assert reply.immediate_response.status.code == 503
        assert b"shutting down" in reply.immediate_response.body
