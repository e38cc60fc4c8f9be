"""The response phase off the token path (`epp/extproc/observer.py`), on a real gRPC server.

The picking stream is configured as the shipped Envoy configs do (request body FULL_DUPLEX,
response body NONE); a second stream in observability mode reports the response, as Envoy's
observer filter does. No test waits on a wall-clock time except the bounded `until`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from tests.conftest import channel_to, running_picker
from tests.extproc.client import (
    ExtProcClient,
    Mode,
    body_msg,
    headers_msg,
    request_headers,
    response_body_msg,
    response_headers_msg,
    set_headers,
)

TOKEN = "x-epp-observe"
SSE = (b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
       b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}\n\ndata: [DONE]\n\n')


def picker_headers(**extra: str) -> pb.ProcessingRequest:
    msg = headers_msg(request_headers(**extra))
    msg.protocol_config.request_body_mode = Mode.FULL_DUPLEX_STREAMED
    msg.protocol_config.response_body_mode = Mode.NONE
    return msg


def observed(message: pb.ProcessingRequest) -> pb.ProcessingRequest:
    message.observability_mode = True
    return message


def inflight(picker) -> int:  # type: ignore[no-untyped-def]
    return sum(ep.inflight_requests for ep in picker.datastore.endpoints())


async def until(condition: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def pick(channel, **headers: str) -> tuple[ExtProcClient, dict[str, str]]:  # type: ignore[no-untyped-def]
    client = ExtProcClient(channel)
    body = orjson.dumps({"model": "m", "prompt": "hello", "max_tokens": 2, "stream": True})
    await client.send(picker_headers(**headers), body_msg(body))
    reply, _ = await client.recv(2)
    return client, set_headers(reply)


async def test_the_observer_reports_first_token_usage_and_end_and_is_never_answered() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client, upstream = await pick(channel, **{TOKEN: "0123456789abcdef"})  # a client's is replaced
        token = upstream[TOKEN]
        assert len(token) == 16 and token != "0123456789abcdef"
        observer = ExtProcClient(channel)
        headers = request_headers(**{TOKEN: token, "x-gateway-destination-endpoint": upstream[
            "x-gateway-destination-endpoint"]})
        await observer.send(observed(headers_msg(headers)),
                            observed(response_headers_msg({":status": "200", "content-type": "text/event-stream"})))
        record = picker.extproc.handoff.claim(token)
        assert record is not None
        await until(lambda: record.observer_attached, "the observer attached")
        assert record.record is not None and not record.record.first_byte
        await observer.send(observed(response_body_msg(SSE[0])))
        await until(lambda: record.record.first_byte > 0, "the first token time")  # type: ignore[union-attr]
        await client.close()  # Envoy ends the picking stream with the response; the observer is still reading
        await observer.send(observed(response_body_msg(SSE[1])))
        assert inflight(picker) == 1
        await observer.send(observed(response_body_msg(SSE[2])), observed(response_body_msg(b"", eos=True)))
        await until(lambda: inflight(picker) == 0, "the release at the observed end")
        assert len(picker.extproc.handoff) == 0
        assert picker.metrics.registry.get_sample_value(
            "inference_objective_output_tokens_sum", {"model_name": "other", "target_model_name": "other"}) == 2.0
        await observer.close()
        assert [r async for r in observer.call] == []  # observability mode: nothing is ever answered


async def test_without_an_observer_the_picking_streams_end_releases() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client, upstream = await pick(channel)
        assert TOKEN in upstream and inflight(picker) == 1
        await client.close()
        await until(lambda: inflight(picker) == 0, "the release")
        assert len(picker.extproc.handoff) == 0


async def test_an_observer_that_never_ends_is_waited_for_only_the_grace() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        picker.extproc.handoff.grace = 0.05
        client, upstream = await pick(channel)
        observer = ExtProcClient(channel)
        await observer.send(observed(headers_msg(request_headers(**{TOKEN: upstream[TOKEN]}))))
        stream = picker.extproc.handoff.claim(upstream[TOKEN])
        assert stream is not None
        await until(lambda: stream.observer_attached, "attached")
        await client.close()
        await until(lambda: inflight(picker) == 0, "the release after the grace")
        assert picker.extproc.handoff.late == 1 and len(picker.extproc.handoff) == 0
        observer.cancel()


async def test_an_unknown_or_malformed_token_attaches_to_nothing() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client, upstream = await pick(channel)
        for bogus in ("0" * 16, "short", "x" * 5000, ""):
            observer = ExtProcClient(channel)
            await observer.send(observed(headers_msg(request_headers(**({TOKEN: bogus} if bogus else {})))))
            assert [r async for r in observer.call] == []  # the EPP ends a stream it has nothing to report to
            assert await observer.call.code() == grpc.StatusCode.OK
        assert inflight(picker) == 1  # the real pick is untouched
        await client.close()
        await until(lambda: inflight(picker) == 0, "the release")


async def test_with_the_response_through_the_picker_no_token_is_issued() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        body = orjson.dumps({"model": "m", "prompt": "hello", "max_tokens": 2})
        await client.send(headers_msg(request_headers(**{TOKEN: "0123456789abcdef"}), mode=Mode.FULL_DUPLEX_STREAMED),
                          body_msg(body))
        reply, _ = await client.recv(2)
        assert TOKEN not in set_headers(reply)
        assert TOKEN in list(reply.request_headers.response.header_mutation.remove_headers)  # never passed on
        await client.close()
        await until(lambda: inflight(picker) == 0, "the release")


async def test_every_request_is_observed_unless_plain_ones_are_sampled() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        async def marks() -> list[tuple[bool, bool]]:
            marked = []
            for i in range(16):
                client = ExtProcClient(channel)
                body = orjson.dumps({"model": "m", "prompt": f"hello {i}", "max_tokens": 2, "stream": i % 2 == 0})
                await client.send(picker_headers(), body_msg(body))
                reply, _ = await client.recv(2)
                marked.append((i % 2 == 0, TOKEN in set_headers(reply)))
                await client.close()
            return marked

        marked = await marks()  # the default: usage of every response counts (metrics, fairness)
        assert all(has for _, has in marked)
        picker.extproc.handoff.unstreamed_sample = 8
        marked = await marks()
        assert all(has for streamed, has in marked if streamed)
        assert sum(has for streamed, has in marked if not streamed) == 1  # 8 plain ones: one observed
        await until(lambda: inflight(picker) == 0 and len(picker.extproc.handoff) == 0, "the releases")


def test_the_wire_form_of_a_streamed_response_chunk_is_the_message_serialised() -> None:
    from epp.extproc import messages

    for chunk in (b"", b"x", b"y" * 127, b"z" * 128, b"w" * 70_000):
        for eos in (False, True):
            wire = messages.streamed_response_body_wire(chunk, eos)
            assert wire == messages.streamed_response_body(chunk, eos).SerializeToString()
            assert pb.ProcessingResponse.FromString(wire) == messages.streamed_response_body(chunk, eos)
