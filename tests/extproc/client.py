"""A tiny ext_proc client speaking real Envoy messages to a real gRPC server, as Envoy would."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

Mode = processing_mode_pb2.ProcessingMode


def headers_msg(headers: dict[str, str], eos: bool = False, *, mode: int | None = None,
                subset: list[str] | str | None = None) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
            ),
            end_of_stream=eos,
        )
    )
    if mode is not None:
        msg.protocol_config.request_body_mode = mode
        msg.protocol_config.response_body_mode = mode
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return msg


def body_msg(body: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=eos))


def response_headers_msg(headers: dict[str, str], served: str = "", eos: bool = False) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]),
            end_of_stream=eos,
        )
    )
    if served:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-served": served})
        msg.metadata_context.filter_metadata["envoy.lb"].CopyFrom(s)
    return msg


def response_body_msg(body: bytes, eos: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=eos))


def request_headers(path: str = "/v1/completions", **extra: str) -> dict[str, str]:
    h = {":method": "POST", ":path": path, ":authority": "gw", "content-type": "application/json"}
    h.update({k.replace("_", "-"): v for k, v in extra.items()})
    return h


class ExtProcClient:
    """One bidirectional stream: send messages, read the replies they cause."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = pb_grpc.ExternalProcessorStub(channel)
        self.queue: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        self.call = self.stub.Process(self._requests())

    async def _requests(self):  # type: ignore[no-untyped-def]
        while True:
            msg = await self.queue.get()
            if msg is None:
                return
            yield msg

    async def send(self, *messages: pb.ProcessingRequest) -> None:
        for m in messages:
            await self.queue.put(m)

    async def recv(self, n: int = 1, timeout: float = 10.0) -> list[pb.ProcessingResponse]:
        out = []
        for _ in range(n):
            out.append(await asyncio.wait_for(self.call.read(), timeout))
        return out

    async def close(self) -> None:
        await self.queue.put(None)

    def cancel(self) -> None:
        self.call.cancel()


def set_headers(response: pb.ProcessingResponse, which: str = "request_headers") -> dict[str, str]:
    common = getattr(response, which).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def removed_headers(response: pb.ProcessingResponse, which: str = "request_headers") -> list[str]:
    return list(getattr(response, which).response.header_mutation.remove_headers)


def destination_metadata(response: pb.ProcessingResponse) -> str:
    return response.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value


def streamed_body(responses: Iterable[pb.ProcessingResponse], which: str = "request_body") -> tuple[bytes, list[int], bool]:
    chunks, sizes, eos = [], [], False
    for r in responses:
        sr = getattr(r, which).response.body_mutation.streamed_response
        chunks.append(sr.body)
        sizes.append(len(sr.body))
        eos = sr.end_of_stream
    return b"".join(chunks), sizes, eos
