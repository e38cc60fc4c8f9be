"""The request path's replies written as bytes (`messages.*_wire`) are exactly the messages the
builders make: the same bytes, and the same message when parsed back."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.api.headers import OBSERVE_TOKEN, REQUEST_ID
from epp.extproc import messages

HEADER_SETS = [
    ({messages.DESTINATION: "10.0.0.1:8000"}, [], "10.0.0.1:8000"),
    ({messages.DESTINATION: "10.0.0.1:8000,10.0.0.2:8000", "content-length": "1234"}, [], "10.0.0.1:8000,10.0.0.2:8000"),
    ({messages.DESTINATION: "[fd00::1]:8000", "content-length": "7", REQUEST_ID: "5f0c-ä-✓",
      OBSERVE_TOKEN: "0123456789abcdef"}, [f"{messages.DESTINATION}-fallback", OBSERVE_TOKEN], "[fd00::1]:8000"),
    ({"x-long": "v" * 300, "x-empty": ""}, ["r" * 200], ""),  # lengths past one varint byte; no destination
    ({}, [], ""),
]


@pytest.mark.parametrize(("set_headers", "remove", "destination"), HEADER_SETS)
def test_request_headers_reply_bytes_equal_the_message(set_headers: dict[str, str], remove: list[str],
                                                       destination: str) -> None:
    message = messages.request_headers_response(set_headers, remove, destination)
    wire = messages.request_headers_response_wire(set_headers, remove, destination)
    assert pb.ProcessingResponse.FromString(wire) == message
    assert wire == message.SerializeToString(deterministic=True)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 61_999, 62_000, 62_001, 200_000])
def test_streamed_request_body_chunks_equal_the_messages(size: int) -> None:
    body = bytes(i % 251 for i in range(size))
    built = messages.streamed_request_body(body)
    wire = messages.streamed_request_body_wire(body)
    assert len(wire) == len(built)
    for raw, message in zip(wire, built):
        assert pb.ProcessingResponse.FromString(raw) == message
        assert raw == message.SerializeToString(deterministic=True)
