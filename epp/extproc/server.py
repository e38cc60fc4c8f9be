"""The ext_proc gRPC service: one `RequestStream` per `Process` stream."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.extproc import access_log, messages
from epp.extproc.observer import Handoff, ObserverStream
from epp.extproc.stream import RequestStream
from epp.requestcontrol.director import Director

log = logging.getLogger("epp.extproc")

DEFAULT_MAX_BODY_BYTES = 32 << 20


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, director: Director, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 debug_header: bool = False) -> None:
        self.director = director
        self.max_body_bytes = max_body_bytes
        self.debug_header = debug_header
        self.active_streams = 0
        # Called before each pick: brings the datastore up to date (the scraper process's board).
        self.refresh: Callable[[], object] | None = None
        self.handoff = Handoff()  # picks whose response an observer stream (or the access log) reports
        self.access_log = access_log.AccessLogReceiver(self)

    async def Process(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """A picking stream (answers every message), or an observer stream (observability mode:
        reports the response to its pick, answers nothing); the first message tells which."""
        stream: RequestStream | None = None
        observer: ObserverStream | None = None
        self.active_streams += 1
        try:
            async for message in request_iterator:
                if observer is not None:
                    observer.handle(message)
                    if observer.ended:
                        return  # end the stream: Envoy holds an observer stream open until we do
                    continue
                if stream is None:
                    if message.observability_mode:
                        observer = ObserverStream(self.handoff)
                        observer.handle(message)
                        if observer.ended:
                            return
                        continue
                    stream = RequestStream(self.director, self.max_body_bytes, self.debug_header, self.refresh,
                                           self.handoff)
                for response in await stream.handle(message):
                    yield response
                    if not isinstance(response, bytes) and response.HasField("immediate_response"):
                        return
        finally:
            # Runs on normal end, client cancel (CancelledError) and errors alike.
            if stream is not None:
                stream.close()
            if observer is not None:
                observer.close()
            self.active_streams -= 1

    def close(self) -> None:
        """End the requests still waiting for an observer (the server is stopping)."""
        self.handoff.close()


class ResponseReports(Collector):
    """`inference_extension_response_reports_total{outcome}`: how the responses kept off the token
    path were reported (`epp.extproc.observer`, `epp.extproc.access_log`)."""

    def __init__(self, extproc: ExternalProcessor) -> None:
        self.extproc = extproc

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "inference_extension_response_reports",
            "Responses reported off the token path, by outcome: logged (an access-log entry reached its pick), "
            "unmatched (an access-log entry whose pick had ended, or is another replica's), late (a pick that "
            "ended without its observer's end or its access-log entry within the grace: its usage not counted).",
            labels=["outcome"])
        access_log_receiver = self.extproc.access_log
        family.add_metric(["logged"], float(access_log_receiver.reported))
        family.add_metric(["unmatched"], float(access_log_receiver.unmatched))
        family.add_metric(["late"], float(self.extproc.handoff.late))
        yield family


def add_to_server(servicer: ExternalProcessor, server: grpc.aio.Server) -> None:
    """As the generated `add_ExternalProcessorServicer_to_server`, with a serializer that also
    takes replies already serialised (`messages.streamed_response_body_wire`); and the access-log
    service beside it (`epp.extproc.access_log`)."""
    access_log.add_to_server(servicer.access_log, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.Process, request_deserializer=pb.ProcessingRequest.FromString,
        response_serializer=messages.serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "envoy.service.ext_proc.v3.ExternalProcessor", {"Process": handler}),))
