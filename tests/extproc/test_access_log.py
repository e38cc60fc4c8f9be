"""Non-streamed responses reported by Envoy's access log (`epp/extproc/access_log.py`), on a real
gRPC server: the picking stream as the shipped Envoy configs run it, and the access-log stream
as Envoy's gRPC access logger sends it (the real Envoy's is in tests/e2e/test_envoy.py)."""

from __future__ import annotations

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import struct_pb2

from tests.conftest import channel_to, running_picker
from tests.extproc.client import ExtProcClient, body_msg, set_headers
from tests.extproc.test_observer import TOKEN, inflight, observed, picker_headers, until

VIA = "x-epp-observe-via"
USAGE = b'{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}'


def output_tokens(picker) -> float | None:  # type: ignore[no-untyped-def]
    return picker.metrics.registry.get_sample_value(
        "inference_objective_output_tokens_sum", {"model_name": "other", "target_model_name": "other"})


async def plain_pick(channel: grpc.aio.Channel, **headers: str) -> tuple[ExtProcClient, dict[str, str]]:
    client = ExtProcClient(channel)
    await client.send(picker_headers(**headers), body_msg(orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": 3})))
    reply, _ = await client.recv(2)
    return client, set_headers(reply)


def entry(token: str, usage: bytes | None = USAGE, status: int = 200) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    if token:
        e.request.request_headers[TOKEN] = token
    e.response.response_code.value = status
    e.response.response_body_bytes = 512
    if usage is not None:
        e.common_properties.metadata.filter_metadata["epp"].CopyFrom(
            struct_pb2.Struct(fields={"usage": struct_pb2.Value(string_value=usage.decode())}))
    return e


async def log(channel: grpc.aio.Channel, *entries: accesslog_pb2.HTTPAccessLogEntry) -> None:
    """One access-log stream, as Envoy opens it: an identifier, then batches of entries."""
    first = als_pb2.StreamAccessLogsMessage(identifier=als_pb2.StreamAccessLogsMessage.Identifier(
        node=base_pb2.Node(id="envoy"), log_name="epp"))
    first.http_logs.log_entry.extend(entries)
    await als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(iter([first]))


async def test_a_plain_response_is_reported_by_the_access_log_and_leaves_the_pod_at_its_end() -> None:
    """A non-streamed request is marked for the access log (no observer): its pod's share ends
    with the picking stream, its usage (token metrics, fairness) when the entry comes."""
    async with running_picker() as picker, channel_to(picker) as channel:
        client, upstream = await plain_pick(channel, **{VIA: "spoofed"})
        assert upstream[VIA] == "access-log" and len(upstream[TOKEN]) == 16
        await client.close()
        await until(lambda: inflight(picker) == 0, "the pod's share ended with the picking stream")
        assert len(picker.extproc.handoff) == 1 and not output_tokens(picker)  # the usage is still to come
        await log(channel, entry(upstream[TOKEN]))
        await until(lambda: len(picker.extproc.handoff) == 0, "the access log's report")
        assert output_tokens(picker) == 3.0
        assert (picker.extproc.access_log.reported, picker.extproc.access_log.unmatched) == (1, 0)
        assert picker.extproc.handoff.late == 0


async def test_an_entry_that_names_no_live_pick_or_carries_garbage_changes_nothing() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client, upstream = await plain_pick(channel)
        token = upstream[TOKEN]
        await log(channel, entry(""), entry("0" * 16), entry("x" * 5000), entry(token[:-1] + "g"))
        assert picker.extproc.access_log.unmatched == 4 and len(picker.extproc.handoff) == 1
        await client.close()
        await until(lambda: inflight(picker) == 0, "the pod's share")
        # Garbage where the usage goes: the request ends, nothing is counted from it.
        await log(channel, entry(token, b'{"prompt_tokens": "lots", "completion_tokens": -1}' + b" " * 5000))
        await until(lambda: len(picker.extproc.handoff) == 0, "the report")
        assert not output_tokens(picker)


async def test_a_report_that_never_comes_is_waited_for_only_the_grace(caplog) -> None:  # type: ignore[no-untyped-def]
    async with running_picker() as picker, channel_to(picker) as channel:
        picker.extproc.handoff.grace = 0.05
        client, upstream = await plain_pick(channel)
        await client.close()
        await until(lambda: len(picker.extproc.handoff) == 0, "the end after the grace")
        assert picker.extproc.handoff.late == 1 and inflight(picker) == 0
        assert "epp-response-log" in caplog.text  # said once, with what to check
        await log(channel, entry(upstream[TOKEN]))  # too late: dropped
        assert picker.extproc.access_log.unmatched == 1 and not output_tokens(picker)


async def test_an_envoy_config_without_the_access_log_still_observes_plain_responses() -> None:
    """An older shipped config runs the observer on every marked request, whatever
    `x-epp-observe-via` says: the observer reports the plain response as before."""
    async with running_picker() as picker, channel_to(picker) as channel:
        client, upstream = await plain_pick(channel)
        observer = ExtProcClient(channel)
        from tests.extproc.client import headers_msg, request_headers, response_body_msg, response_headers_msg

        await observer.send(observed(headers_msg(request_headers(**{TOKEN: upstream[TOKEN]}))),
                            observed(response_headers_msg({":status": "200", "content-type": "application/json"})))
        stream = picker.extproc.handoff.claim(upstream[TOKEN])
        assert stream is not None
        await until(lambda: stream.observer_attached, "attached")
        await client.close()
        await observer.send(observed(response_body_msg(b'{"choices":[],"usage":' + USAGE + b"}", eos=True)))
        await until(lambda: len(picker.extproc.handoff) == 0 and inflight(picker) == 0, "the observed end")
        assert output_tokens(picker) == 3.0 and picker.extproc.handoff.late == 0
        observer.cancel()


async def test_a_streamed_request_is_observed_for_its_first_token_and_a_client_cannot_mark_it() -> None:
    """A streamed request is marked `first-token`, whatever the client sent: its observer
    reports the first token; where the access log reports the rest (the observer's messages
    carry the Lua filter's `epp.logged`), the observer ends after the first chunk and the log's
    entry brings the usage and ends the request."""
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        body = orjson.dumps({"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True})
        await client.send(picker_headers(**{VIA: "access-log"}), body_msg(body))
        reply, _ = await client.recv(2)
        upstream = set_headers(reply)
        assert upstream[VIA] == "first-token" and len(upstream[TOKEN]) == 16
        from tests.extproc.client import headers_msg, request_headers, response_body_msg, response_headers_msg

        observer = ExtProcClient(channel)
        headers = observed(response_headers_msg({":status": "200", "content-type": "text/event-stream"}))
        headers.metadata_context.filter_metadata["epp"].CopyFrom(
            struct_pb2.Struct(fields={"logged": struct_pb2.Value(string_value="1")}))
        await observer.send(observed(headers_msg(request_headers(**{TOKEN: upstream[TOKEN]}))), headers,
                            observed(response_body_msg(b'data: {"choices":[{"text":"a"}]}\n\n')))
        assert [r async for r in observer.call] == []  # the EPP ended the observer after the first token
        stream = picker.extproc.handoff.claim(upstream[TOKEN])
        assert stream is not None and stream.record is not None and stream.record.first_byte > 0
        await client.close()
        await until(lambda: inflight(picker) == 0, "the pod's share ended with the picking stream")
        assert len(picker.extproc.handoff) == 1
        await log(channel, entry(upstream[TOKEN]))
        await until(lambda: len(picker.extproc.handoff) == 0, "the access log's report")
        assert output_tokens(picker) == 3.0 and picker.extproc.handoff.late == 0


def test_the_pods_share_ends_once_whether_the_usage_comes_with_the_end_or_after() -> None:
    """`Director.response_over` then `release`: in flight and the ledger drop once (a second
    drop would hide behind the floor at zero, so a request still running there is counted)."""
    import asyncio
    import random

    from epp.api.request import Api, InferenceRequest
    from epp.api.response import Usage
    from epp.core import build_core
    from epp.datastore import Datastore, EndpointMetrics, EndpointSpec

    store = Datastore(clock=lambda: 100.0)
    endpoint = store.upsert(EndpointSpec(name="pod-0", ip="10.0.0.1", port=8000))
    endpoint.update_metrics(EndpointMetrics(cache_block_size=16, cache_num_blocks=20_000, update_time=99.99))
    core = build_core(store, None, tick=0.05, seed=1)

    def plain(prompt: str) -> InferenceRequest:
        return InferenceRequest(request_id=f"r{random.random()}", api=Api.COMPLETIONS, model="m", target_model="m",
                                body={"model": "m", "prompt": prompt}, prompt=prompt.encode(), max_tokens=10)

    async def two() -> tuple[object, object]:
        return (await core.director.handle_request(plain("first")))[1], (await core.director.handle_request(plain("second")))[1]

    first, second = asyncio.run(two())
    assert endpoint.inflight_requests == 2 and endpoint.load.requests == 2
    core.director.response_over(first)  # type: ignore[arg-type]
    core.director.response_over(first)  # type: ignore[arg-type]
    assert endpoint.inflight_requests == 1 and endpoint.load.requests == 1
    samples = store.models.get("m").samples
    core.director.release(first, Usage.of(5, 7))  # type: ignore[arg-type]  # the usage, later
    assert endpoint.inflight_requests == 1 and endpoint.load.requests == 1  # not dropped again
    assert store.models.get("m").samples == samples + 1  # the usage was learned
    core.director.response_over(second)  # type: ignore[arg-type]
    core.director.release(second)  # type: ignore[arg-type]
    core.director.release(second)  # type: ignore[arg-type]
    assert endpoint.inflight_requests == 0 and endpoint.load.requests == 0
