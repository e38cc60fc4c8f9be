"""Builders for the Envoy ext_proc messages the EPP sends. Envoy-specific, nothing else here."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from epp.api.headers import (  # noqa: F401 - re-exported for the protocol code
    DESTINATION,
    DESTINATION_SERVED,
    DESTINATION_SUBSET,
    LB_NAMESPACE,
    SUBSET_NAMESPACE,
)
from epp.errors import EppError

# Chunks stay under the 64 KiB message limit some Envoys have (the reference's BodyByteLimit).
BODY_CHUNK_BYTES = 62_000

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_mutation(set_headers: dict[str, str], remove: list[str] | None = None) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE)
            for k, v in set_headers.items()
        ],
        remove_headers=remove or [],
    )


def destination_metadata(destination: str) -> struct_pb2.Struct:
    """`envoy.lb / x-gateway-destination-endpoint`, the same string as the header."""
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: destination}})
    return metadata


def request_headers_response(
    set_headers: dict[str, str], remove: list[str] | None = None, destination: str = ""
) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=header_mutation(set_headers, remove), clear_route_cache=True)
        )
    )
    if destination:
        response.dynamic_metadata.CopyFrom(destination_metadata(destination))
    return response


def empty_request_headers_response() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())


def streamed_request_body(body: bytes) -> list[pb.ProcessingResponse]:
    """The body as `StreamedBodyResponse` chunks of at most 62,000 bytes; EOS on the last one.
    An empty body still gets one (empty, EOS) chunk."""
    view = memoryview(body)
    chunks = [bytes(view[i : i + BODY_CHUNK_BYTES]) for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    last = len(chunks) - 1
    return [
        pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=i == last)
                    )
                )
            )
        )
        for i, chunk in enumerate(chunks)
    ]


def buffered_request_body(
    set_headers: dict[str, str], remove: list[str], destination: str, body: bytes | None
) -> pb.ProcessingResponse:
    """BUFFERED mode: the destination rides on the body reply (headers were answered already)."""
    common = pb.CommonResponse(header_mutation=header_mutation(set_headers, remove), clear_route_cache=True)
    if body is not None:
        common.body_mutation.CopyFrom(pb.BodyMutation(body=body))
    response = pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    response.dynamic_metadata.CopyFrom(destination_metadata(destination))
    return response


def response_headers_response(set_headers: dict[str, str]) -> pb.ProcessingResponse:
    common = pb.CommonResponse()
    if set_headers:
        common.header_mutation.CopyFrom(header_mutation(set_headers))
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))


def _varint(value: int) -> bytes:
    if value <= 0x7F:  # most lengths: one byte
        return bytes((value,))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(tag: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field: its key byte, the payload's length (varint), the payload."""
    return bytes((tag,)) + _varint(len(payload)) + payload


def _nested(tags: tuple[int, ...], parts: list[bytes | memoryview]) -> bytes:
    """Length-delimited fields nested in one another (`tags` outermost first) around `parts`,
    written with one copy of the parts (wrapping level by level would copy a body once a level)."""
    size = sum(len(part) for part in parts)
    heads: list[bytes] = []
    for tag in reversed(tags):
        head = bytes((tag,)) + _varint(size)
        heads.append(head)
        size += len(head)
    heads.reverse()
    return b"".join(heads + parts)


def _text(tag: int, text: str) -> bytes:
    """A string field; proto3 leaves an empty one out."""
    return _delimited(tag, text.encode()) if text else b""


_EOS_TRUE = b"\x10\x01"  # StreamedBodyResponse.end_of_stream (field 2, varint) = true
_OVERWRITE_WIRE = bytes((0x18, _OVERWRITE))  # HeaderValueOption.append_action (field 3, varint)
_CLEAR_ROUTE_CACHE_WIRE = b"\x28\x01"  # CommonResponse.clear_route_cache (field 5, varint) = true

# Every request's replies on the FULL_DUPLEX_STREAMED path, written as bytes: building the nested
# messages (and the destination's Struct through protobuf's Python `update`) cost more than the
# rest of the reply path, and these shapes never change. Tests check each equals the message
# builders' serialisation (tests/extproc/test_wire.py).


def _streamed_body_wire(tag: int, chunk: bytes | memoryview, end_of_stream: bool) -> bytes:
    """ProcessingResponse.<request_body (3) | response_body (4)> > BodyResponse.response (1) >
    CommonResponse.body_mutation (3) > BodyMutation.streamed_response (3) > StreamedBodyResponse
    {body (1), end_of_stream (2)}."""
    parts: list[bytes | memoryview] = [b"\x0a" + _varint(len(chunk)), chunk] if len(chunk) else []  # proto3
    if end_of_stream:  # leaves an empty bytes field out
        parts.append(_EOS_TRUE)
    return _nested((tag, 0x0A, 0x1A, 0x1A), parts)


def streamed_response_body_wire(chunk: bytes, end_of_stream: bool) -> bytes:
    """`streamed_response_body(chunk, end_of_stream)` already serialised: the token path sends one
    per response chunk, and four nested message objects built and serialised per chunk cost more
    than writing the bytes."""
    return _streamed_body_wire(0x22, chunk, end_of_stream)


def streamed_request_body_wire(body: bytes) -> list[bytes]:
    """`streamed_request_body(body)`, each chunk already serialised."""
    view = memoryview(body)
    chunks = [view[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [view]
    last = len(chunks) - 1
    return [_streamed_body_wire(0x1A, chunk, i == last) for i, chunk in enumerate(chunks)]


def _header_mutation_wire(set_headers: dict[str, str], remove: list[str]) -> bytes:
    """HeaderMutation {set_headers (1): HeaderValueOption {header (1): HeaderValue {key (1),
    raw_value (3)}, append_action (3)}, remove_headers (2)}."""
    out = [_delimited(0x0A, _delimited(0x0A, _text(0x0A, k) + _text(0x1A, v)) + _OVERWRITE_WIRE)
           for k, v in set_headers.items()]
    out += [_delimited(0x12, name.encode()) for name in remove]
    return b"".join(out)


def _destination_metadata_wire(destination: str) -> bytes:
    """`destination_metadata(destination)`: Struct {fields (1): {"envoy.lb": Value {struct_value
    (5): Struct {fields: {"x-gateway-destination-endpoint": Value {string_value (3)}}}}}}."""
    inner = _delimited(0x0A, _text(0x0A, DESTINATION) + _delimited(0x12, _delimited(0x1A, destination.encode())))
    return _delimited(0x0A, _text(0x0A, LB_NAMESPACE) + _delimited(0x12, _delimited(0x2A, inner)))


def request_headers_response_wire(set_headers: dict[str, str], remove: list[str], destination: str = "") -> bytes:
    """`request_headers_response(set_headers, remove, destination)` already serialised:
    ProcessingResponse {request_headers (1): HeadersResponse {response (1): CommonResponse
    {header_mutation (2), clear_route_cache (5)}}, dynamic_metadata (8)}."""
    common = _delimited(0x12, _header_mutation_wire(set_headers, remove)) + _CLEAR_ROUTE_CACHE_WIRE
    out = _delimited(0x0A, _delimited(0x0A, common))
    if destination:
        out += _delimited(0x42, _destination_metadata_wire(destination))
    return out


def serialize(response: pb.ProcessingResponse | bytes) -> bytes:
    """The gRPC response serializer: messages, or bytes already serialised."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def streamed_response_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
                )
            )
        )
    )


def buffered_response_body(body: bytes | None) -> pb.ProcessingResponse:
    common = pb.CommonResponse()
    if body is not None:
        common.body_mutation.CopyFrom(pb.BodyMutation(body=body))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))


def response_trailers_response() -> pb.ProcessingResponse:
    return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def immediate_response(error: EppError) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.http_status),
            headers=header_mutation({"content-type": "text/plain; charset=utf-8"}),
            body=error.body(),
            details=error.reason,
        )
    )
