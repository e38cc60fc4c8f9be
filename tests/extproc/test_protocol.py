"""The Endpoint Picker protocol (gie-epp §1) against a real gRPC server with Envoy's message types."""

from __future__ import annotations

import asyncio
import dataclasses

import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import grpc
from tests.conftest import channel_to, running_picker
from tests.extproc.client import (
    ExtProcClient,
    Mode,
    body_msg,
    destination_metadata,
    headers_msg,
    removed_headers,
    request_headers,
    response_body_msg,
    response_headers_msg,
    set_headers,
    streamed_body,
)

ENDPOINTS = {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}


def completion(prompt: str = "hello world", **extra) -> bytes:  # type: ignore[no-untyped-def]
    return orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 5, **extra})


def inflight(picker) -> int:  # type: ignore[no-untyped-def]
    return sum(ep.inflight_requests for ep in picker.datastore.endpoints())


async def test_full_duplex_destination_in_header_and_metadata() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        body = completion()
        await client.send(headers_msg(request_headers()), body_msg(body[:10], eos=False), body_msg(body[10:]))
        hdr, bod = await client.recv(2)
        headers = set_headers(hdr)
        assert headers["x-gateway-destination-endpoint"] in ENDPOINTS
        assert destination_metadata(hdr) == headers["x-gateway-destination-endpoint"]
        assert headers["content-length"] == str(len(body))
        assert hdr.request_headers.response.clear_route_cache
        forwarded, _, eos = streamed_body([bod])
        assert forwarded == body and eos
        await client.close()


async def test_large_body_is_restreamed_in_62000_byte_chunks() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        body = completion("x" * 200_000)
        await client.send(headers_msg(request_headers()))
        for i in range(0, len(body), 16_384):
            await client.send(body_msg(body[i : i + 16_384], eos=i + 16_384 >= len(body)))
        replies = await client.recv(1 + 4)
        assert set_headers(replies[0])["content-length"] == str(len(body))
        forwarded, sizes, eos = streamed_body(replies[1:])
        assert forwarded == body and eos
        assert max(sizes) <= 62_000 and sizes[:-1] == [62_000] * 3
        await client.close()


async def test_request_id_generated_when_missing_and_kept_when_sent() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()), body_msg(completion()))
        generated = set_headers((await client.recv(2))[0]).get("x-request-id", "")
        assert len(generated) == 36
        client2 = ExtProcClient(channel)
        await client2.send(headers_msg(request_headers(x_request_id="abc")), body_msg(completion()))
        assert "x-request-id" not in set_headers((await client2.recv(2))[0])


async def test_client_destination_headers_never_pass_as_sent() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        spoofed = request_headers(**{"x-gateway-destination-endpoint": "6.6.6.6:80",
                                     "x-gateway-destination-endpoint-served": "6.6.6.6:80",
                                     "x-gateway-destination-endpoint-fallback": "6.6.6.6:80"})
        await client.send(headers_msg(spoofed), body_msg(completion()))
        hdr = (await client.recv(2))[0]
        assert set_headers(hdr)["x-gateway-destination-endpoint"] in ENDPOINTS
        assert set(removed_headers(hdr)) == {"x-gateway-destination-endpoint-served",
                                             "x-gateway-destination-endpoint-fallback"}


@pytest.mark.parametrize(
    ("path", "body", "status", "text"),
    [
        ("/v1/completions", b"{not json", 400, "error unmarshaling request body"),
        ("/v1/completions", b'{"model": "m", "prompt": "\xff\xfe"}', 400, "error unmarshaling request body"),
        ("/v1/completions", b"[1, 2]", 400, "not a JSON object"),
        ("/v1/completions", b'{"prompt": "hi"}', 400, "model not found in request body"),
        ("/v1/completions", b'{"model": 7, "prompt": "hi"}', 400, "model not found in request body"),
        ("/v1/completions", b'{"model": "m"}', 400, "must have valid prompt field"),
        ("/v1/chat/completions", b'{"model": "m", "prompt": "hi"}', 400, "must have valid messages field"),
        ("/v1/unknown", b'{"model": "m", "messages": []}', 400, "must have valid prompt field"),
    ],
)
async def test_bad_bodies_get_400_with_a_clear_message(path: str, body: bytes, status: int, text: str) -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers(path)), body_msg(body))
        (reply,) = await client.recv(1)
        assert reply.immediate_response.status.code == status
        assert reply.immediate_response.body.decode().startswith("inference error: BadRequest - ")
        assert text in reply.immediate_response.body.decode()
        assert inflight(picker) == 0


async def test_body_over_the_limit_gets_413_and_nothing_is_held() -> None:
    async with running_picker(max_request_body_bytes=1000) as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()), body_msg(b"x" * 600, eos=False), body_msg(b"x" * 600, eos=False))
        (reply,) = await client.recv(1)
        assert reply.immediate_response.status.code == 413


async def test_no_endpoints_is_503() -> None:
    async with running_picker(static_endpoints="") as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()), body_msg(completion()))
        (reply,) = await client.recv(1)
        assert reply.immediate_response.status.code == 503
        assert b"failed to find endpoint candidates" in reply.immediate_response.body


async def test_subset_hint_restricts_candidates() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        for _ in range(6):
            client = ExtProcClient(channel)
            await client.send(headers_msg(request_headers(), subset=["10.0.0.2:8000"]), body_msg(completion()))
            assert set_headers((await client.recv(2))[0])["x-gateway-destination-endpoint"] == "10.0.0.2:8000"
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers(), subset=["10.0.0.3"]), body_msg(completion()))
        assert set_headers((await client.recv(2))[0])["x-gateway-destination-endpoint"] == "10.0.0.3:8000"
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers(), subset=[]), body_msg(completion()))
        assert (await client.recv(1))[0].immediate_response.status.code == 503
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers(), subset=["192.168.9.9:8000"]), body_msg(completion()))
        assert (await client.recv(1))[0].immediate_response.status.code == 503


async def test_header_only_request_gets_a_destination_at_once() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg({":method": "GET", ":path": "/v1/models"}, eos=True))
        (reply,) = await client.recv(1)
        dest = set_headers(reply)["x-gateway-destination-endpoint"]
        assert dest in ENDPOINTS and destination_metadata(reply) == dest
        assert inflight(picker) == 1
        await client.close()
        await asyncio.sleep(0.2)
        assert inflight(picker) == 0


async def test_header_only_request_without_endpoints_is_500() -> None:
    async with running_picker(static_endpoints="") as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg({":method": "GET", ":path": "/v1/models"}, eos=True))
        (reply,) = await client.recv(1)
        assert reply.immediate_response.status.code == 500
        assert b"no pods available in datastore" in reply.immediate_response.body


async def test_buffered_mode_answers_headers_then_routes_on_the_body_reply() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers(), mode=Mode.BUFFERED))
        (hdr,) = await client.recv(1)
        assert hdr.HasField("request_headers") and not hdr.request_headers.response.header_mutation.set_headers
        await client.send(body_msg(completion()))
        (bod,) = await client.recv(1)
        headers = set_headers(bod, "request_body")
        assert headers["x-gateway-destination-endpoint"] in ENDPOINTS
        assert destination_metadata(bod) == headers["x-gateway-destination-endpoint"]


async def test_model_rewrite_header_changes_body_and_is_undone_on_the_response() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers(**{"x-gateway-model-name-rewrite": "big-model"})),
                          body_msg(completion()))
        hdr, bod = await client.recv(2)
        forwarded, _, _ = streamed_body([bod])
        assert orjson.loads(forwarded)["model"] == "big-model"
        assert set_headers(hdr)["content-length"] == str(len(forwarded))
        await client.send(response_headers_msg({":status": "200", "content-type": "application/json"}),
                          response_body_msg(b'{"model":"big-model","usage":{"prompt_tokens":3,"completion_tokens":5}}', eos=True))
        _, rbody = await client.recv(2)
        out, _, eos = streamed_body([rbody], "response_body")
        assert b'"model":"m"' in out and eos


async def test_streamed_response_is_echoed_and_accounting_returns_to_zero() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()), body_msg(completion(stream=True)))
        await client.recv(2)
        assert inflight(picker) == 1
        events = [b'data: {"choices":[{"text":"a"}],"usage":null}\n\n',
                  b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\ndata: [DONE]\n\n']
        await client.send(response_headers_msg({":status": "200", "content-type": "text/event-stream"}))
        await client.recv(1)
        await client.send(response_body_msg(events[0]))
        (r1,) = await client.recv(1)
        assert streamed_body([r1], "response_body")[0] == events[0]
        await client.send(response_body_msg(events[1], eos=True))
        (r2,) = await client.recv(1)
        assert streamed_body([r2], "response_body") == (events[1], [len(events[1])], True)
        assert inflight(picker) == 0
        assert sum(ep.inflight_tokens for ep in picker.datastore.endpoints()) == 0


async def test_a_negative_token_limit_leaves_no_inflight_tokens_behind() -> None:
    """Two requests on one pod, the second with `max_tokens: -3`, ending in pick order: counted as
    sent, the pod's in-flight tokens were left at 3 (the engine rejects such a limit itself)."""
    async with running_picker(static_endpoints="10.0.0.1:8000") as picker, channel_to(picker) as channel:
        clients = []
        for body in (completion(stream=True), completion(stream=True, max_tokens=-3)):
            client = ExtProcClient(channel)
            await client.send(headers_msg(request_headers()), body_msg(body))
            await client.recv(2)
            clients.append(client)
        done = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\ndata: [DONE]\n\n'
        for client in clients:
            await client.send(response_headers_msg({":status": "200", "content-type": "text/event-stream"}))
            await client.recv(1)
            await client.send(response_body_msg(done, eos=True))
            await client.recv(1)
        assert inflight(picker) == 0
        assert sum(ep.inflight_tokens for ep in picker.datastore.endpoints()) == 0


async def test_a_huge_token_limit_counts_up_to_the_pods_longest_sequence() -> None:
    """`max_tokens: 2^20` on a pod whose vLLM says a max_model_len of 1,024 (its cache_config_info)
    holds at most 1,024 tokens there, as the engine stops its output: the pod's in-flight tokens
    (the token-load scorer's and the token-mode concurrency detector's signal) are not swollen by
    one client's number, and return to zero at the end."""
    async with running_picker(static_endpoints="10.0.0.1:8000") as picker, channel_to(picker) as channel:
        (ep,) = picker.datastore.endpoints()
        ep.metrics = dataclasses.replace(ep.metrics, max_model_len=1024)
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()), body_msg(completion(stream=True, max_tokens=1 << 20)))
        await client.recv(2)
        assert 0 < ep.inflight_tokens <= 1024
        done = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\ndata: [DONE]\n\n'
        await client.send(response_headers_msg({":status": "200", "content-type": "text/event-stream"}))
        await client.recv(1)
        await client.send(response_body_msg(done, eos=True))
        await client.recv(1)
        assert inflight(picker) == 0 and ep.inflight_tokens == 0


async def test_client_disconnect_after_pick_leaves_no_inflight_count() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()), body_msg(completion()))
        await client.recv(2)
        assert inflight(picker) == 1
        client.cancel()
        for _ in range(50):
            if inflight(picker) == 0:
                break
            await asyncio.sleep(0.05)
        assert inflight(picker) == 0
        assert picker.extproc.active_streams == 0


async def test_client_disconnect_mid_body_leaves_nothing() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()), body_msg(b'{"model": "m", "pro', eos=False))
        await asyncio.sleep(0.1)
        client.cancel()
        for _ in range(50):
            if picker.extproc.active_streams == 0:
                break
            await asyncio.sleep(0.05)
        assert picker.extproc.active_streams == 0 and inflight(picker) == 0


async def test_a_burst_spreads_across_equal_endpoints() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        clients = []
        picks = []
        for i in range(30):
            client = ExtProcClient(channel)
            await client.send(headers_msg(request_headers()), body_msg(completion(f"unique prompt {i} " * 3)))
            picks.append(set_headers((await client.recv(2))[0])["x-gateway-destination-endpoint"])
            clients.append(client)
        counts = {ep: picks.count(ep) for ep in ENDPOINTS}
        assert min(counts.values()) >= 8, counts


async def test_conformance_config_routes_by_test_header() -> None:
    config = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-based-testing-filter
- type: destination-endpoint-served-verifier
schedulingProfiles:
- name: conformance-profile
  plugins:
  - pluginRef: header-based-testing-filter
dataLayer:
  sources: []
"""
    async with running_picker(config_text=config) as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers(**{"test-epp-endpoint-selection": "10.0.0.3:8000,10.0.0.1"})),
                          body_msg(completion()))
        hdr, _ = await client.recv(2)
        assert set_headers(hdr)["x-gateway-destination-endpoint"] in {"10.0.0.3:8000", "10.0.0.1:8000"}
        await client.send(response_headers_msg({":status": "200"}, served="10.0.0.3:8000"))
        (rh,) = await client.recv(1)
        assert set_headers(rh, "response_headers")["x-conformance-test-served-endpoint"] == "10.0.0.3:8000"

        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()), body_msg(completion()))
        (reply,) = await client.recv(1)
        assert reply.immediate_response.status.code == 429


async def test_sheddable_request_is_429_when_pool_is_saturated() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        picker.datastore.set_objective("batch", -1)
        client = ExtProcClient(channel)  # never-scraped endpoints count as saturated
        await client.send(headers_msg(request_headers(**{"x-gateway-inference-objective": "batch"})), body_msg(completion()))
        (reply,) = await client.recv(1)
        assert reply.immediate_response.status.code == 429
        assert b"system saturated, sheddable request dropped" in reply.immediate_response.body
        client = ExtProcClient(channel)  # priority >= 0 is never shed
        await client.send(headers_msg(request_headers()), body_msg(completion()))
        assert len(await client.recv(2)) == 2


async def test_health_service_names() -> None:
    async with running_picker() as picker:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.health_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ("liveness", "readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor"):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            picker.datastore.synced = False
            reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_a_picked_request_lets_go_of_its_body_and_still_learns_from_its_usage() -> None:
    """Once picked and sent on, a request keeps neither its parsed body nor its prompt (twice its
    body, for as long as it runs); what is read later (the prompt's length, for the chars-per-token
    the model learns from the usage) is kept."""
    async with running_picker() as picker, channel_to(picker) as channel:
        director = picker.core.director
        records = []
        handle = director.handle_request

        async def spy(request):  # type: ignore[no-untyped-def]
            decision, record = await handle(request)
            records.append(record)
            return decision, record

        director.handle_request = spy  # type: ignore[method-assign]
        prompt = "lighthouse " * 4_000  # 44,000 characters
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()), body_msg(completion(prompt)))
        hdr, bod = await client.recv(2)
        assert streamed_body([bod])[0] == completion(prompt)  # sent on whole
        (record,) = records
        request = record.request
        assert (request.body, request.prompt, request.prompt_chars) == ({}, b"", len(prompt))
        assert request.prompt_tokens_estimate == len(prompt) // 4
        await client.send(response_headers_msg({":status": "200", "content-type": "application/json"}),
                          response_body_msg(b'{"usage":{"prompt_tokens":8000,"completion_tokens":5}}', eos=True))
        await client.recv(2)
        assert inflight(picker) == 0
        stats = picker.datastore.models.get("m")
        # 44,000 characters in 8,000 tokens: learned from the length kept (a dropped prompt's 0 would
        # have taught nothing, leaving the prior 4.0)
        assert stats.samples == 1 and stats.chars_per_token == 5.5
        assert stats.prompt_tokens(len(prompt)) == 8000
