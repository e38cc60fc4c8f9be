"""The floor under the EPP's per-request and per-chunk CPU: an ext_proc server that does nothing.

It speaks the same protocol as the EPP on the same stack (grpc.aio on uvloop, one process) and
answers as little as the protocol allows, its replies written as bytes as the EPP's are: the
destination (round-robin over the endpoints it is given) after the request body, the body
re-streamed, each response chunk echoed on the reference config, nothing to an observer stream
(which, as with the EPP's default, runs for every streamed response, up to its first chunk; every
response's usage comes in the access log, whose entries it reads as the EPP does). Whatever the EPP costs above this
is its own work; this much is the price of gRPC in Python, and no optimisation of the EPP's code
goes below it.

    python -m bench.grpc_floor PORT_FILE ENDPOINT...   # writes its port to PORT_FILE, serves until killed
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.api.headers import OBSERVE_TOKEN, OBSERVE_VIA, VIA_ACCESS_LOG, VIA_FIRST_TOKEN
from epp.extproc import access_log, messages
from epp.extproc.access_log import AccessLogReceiver, logged
from epp.extproc.observer import Handoff


class Floor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.picks = 0

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 (gRPC name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        body = b""
        first_token_only = False
        async for m in requests:
            kind = m.WhichOneof("request")
            if m.observability_mode:
                if kind == "response_headers":  # as the EPP: the access log brings the rest
                    first_token_only = logged(m)
                if kind == "response_body" and (m.response_body.end_of_stream or first_token_only) \
                        or kind == "response_trailers":
                    return
                continue
            if kind == "request_body":
                body += m.request_body.body
                if m.request_body.end_of_stream:
                    self.picks += 1
                    target = self.endpoints[self.picks % len(self.endpoints)]
                    # As the EPP by default: every response is observed; Envoy's shipped config
                    # opens an observer stream for a streamed one and logs a plain one.
                    headers = {messages.DESTINATION: target, "content-length": str(len(body)), OBSERVE_TOKEN: "0" * 16}
                    headers[OBSERVE_VIA] = VIA_FIRST_TOKEN if b'"stream"' in body else VIA_ACCESS_LOG
                    yield messages.request_headers_response_wire(headers, [], target)
                    for reply in messages.streamed_request_body_wire(body):
                        yield reply
            elif kind == "response_headers":
                yield messages.response_headers_response({})
            elif kind == "response_body":
                yield messages.streamed_response_body_wire(m.response_body.body, m.response_body.end_of_stream)
            elif kind == "response_trailers":
                yield messages.response_trailers_response()


def add_to_server(floor: Floor, server: grpc.aio.Server) -> None:
    """With the EPP's serializer (`epp.extproc.server.add_to_server`): replies already written as
    bytes, as the EPP writes its request-path replies, so the floor builds no more than the EPP."""
    handler = grpc.stream_stream_rpc_method_handler(floor.Process, request_deserializer=pb.ProcessingRequest.FromString,
                                                    response_serializer=messages.serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "envoy.service.ext_proc.v3.ExternalProcessor", {"Process": handler}),))
    # The floor keeps no picks: each entry is read, finds no token and is dropped.
    access_log.add_to_server(AccessLogReceiver(SimpleNamespace(handoff=Handoff())), server)  # type: ignore[arg-type]


async def serve(port_file: Path, endpoints: list[str]) -> None:
    server = grpc.aio.server()
    add_to_server(Floor(endpoints), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(str(port))
    await server.wait_for_termination()


if __name__ == "__main__":
    import uvloop

    uvloop.run(serve(Path(sys.argv[1]), sys.argv[2:]))
