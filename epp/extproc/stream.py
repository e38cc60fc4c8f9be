"""One ext_proc stream = one HTTP request: a small state machine from headers to accounting.

Request side (FULL_DUPLEX_STREAMED, the primary mode): the headers reply is held until the body
has fully arrived; then one headers reply carries the destination and the body is re-streamed in
chunks. BUFFERED: headers are answered at once and the destination rides on the body reply.
Header-only requests are answered on the headers message.

Response side: headers and body are observed to read `usage`; the request's accounting is
released exactly once, at the end of the response or when the stream ends for any reason.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.api.headers import OBSERVE_TOKEN, OBSERVE_VIA, PATH_HEADERS, REQUEST_ID, VIA_ACCESS_LOG, VIA_FIRST_TOKEN
from epp.api.request import InferenceRequest, api_for_path, parse_request
from epp.api.response import ResponseObserver, observer_for, rewrite_model_name
from epp.errors import Code, EppError
from epp.extproc import messages
from epp.extproc.access_log import logged
from epp.extproc.observer import Handoff
from epp.observability.trace import DEBUG_HEADER
from epp.requestcontrol.director import Decision, Director, RequestRecord

log = logging.getLogger("epp.extproc")

_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
BUFFERED_MODES = (_Mode.BUFFERED, _Mode.BUFFERED_PARTIAL)
NONE_MODE = _Mode.NONE



def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    """Lower-cased header map; `raw_value` wins over `value`, as in the reference."""
    out: dict[str, str] = {}
    for h in message.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _struct_field(request: pb.ProcessingRequest, namespace: str, key: str):  # -> protobuf Value | None
    metadata = request.metadata_context.filter_metadata
    if namespace not in metadata:
        return None
    fields = metadata[namespace].fields
    return fields[key] if key in fields else None


def _subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The proxy's subset hint: a list of "ip:port" (or one comma-separated string); None if absent."""
    value = _struct_field(request, messages.SUBSET_NAMESPACE, messages.DESTINATION_SUBSET)
    if value is None:
        return None
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    if kind == "string_value":
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    return []


class RequestStream:
    def __init__(self, director: Director, max_body_bytes: int, debug_header: bool = False,
                 refresh: Callable[[], object] | None = None, handoff: Handoff | None = None) -> None:
        self.director = director
        self.refresh = refresh
        self.handoff = handoff
        self.token = ""  # set when an observer stream reports this request's response
        self.observer_attached = False
        self.logged = False  # ... or Envoy's access log (`epp.extproc.access_log`), after its end
        self.max_body_bytes = max_body_bytes
        self.debug_header = debug_header
        self.request_body_mode = FULL_DUPLEX
        self.response_body_mode = FULL_DUPLEX
        self.headers: dict[str, str] = {}
        self.request_id = ""
        self.generated_request_id = False
        self.subset: list[str] | None = None
        self.chunks: list[bytes] = []  # the request body as it arrived, joined once at its end
        self.body_bytes = 0
        self.request: InferenceRequest | None = None
        self.record: RequestRecord | None = None
        self.observer: ResponseObserver | None = None
        self.response_status = 0

    # -- dispatch --

    async def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse | bytes]:
        """The replies to one message (messages, or `bytes` already serialised on the token path)."""
        kind = message.WhichOneof("request")
        try:
            if message.HasField("protocol_config"):
                self.request_body_mode = message.protocol_config.request_body_mode
                self.response_body_mode = message.protocol_config.response_body_mode
            if kind == "request_headers":
                return self._on_request_headers(message)
            if kind == "request_body":
                return await self._on_request_body(message)
            if kind == "request_trailers":
                return []  # the reference sends no reply to request trailers
            if kind == "response_headers":
                return self._on_response_headers(message)
            if kind == "response_body":
                return self._on_response_body(message)
            if kind == "response_trailers":
                self._finish()
                return [messages.response_trailers_response()]
            return []
        except EppError as error:
            return [self._fail(error)]
        except Exception:
            log.exception("internal error handling %s for request %s", kind, self.request_id)
            return [self._fail(EppError(Code.INTERNAL, "internal error", reason="internal"))]

    def close(self) -> None:
        """The stream ended (normally, by cancel or by error): release whatever is still held,
        or, if an observer stream is still reporting the response, once it has ended."""
        record = self.record
        if self.token and self.handoff is not None and record is not None and not record.released:
            if self.logged:
                self.director.response_over(record)  # the pod is done with it; its usage comes later
            if self.handoff.picker_closed(self, self.token):
                return
        self._finish()

    def close_unobserved(self) -> None:
        """Its observer did not end in time (or the EPP stops): end the request now."""
        self._finish()

    # -- request path --

    def _on_request_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse | bytes]:
        self.headers = _headers(message.request_headers)
        self.request_id = self.headers.get(REQUEST_ID, "")
        if not self.request_id:
            self.request_id = str(uuid.uuid4())
            self.generated_request_id = True
        self.subset = _subset_hint(message)
        if message.request_headers.end_of_stream:
            return [self._pick_headers_only()]
        if self.request_body_mode in BUFFERED_MODES:
            return [messages.empty_request_headers_response()]
        if self.request_body_mode != FULL_DUPLEX:
            raise EppError(Code.INTERNAL, "unsupported request body mode; use FULL_DUPLEX_STREAMED or BUFFERED",
                           reason="unsupported_mode")
        return []  # held until the body is complete

    async def _on_request_body(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse | bytes]:
        chunk = message.request_body.body
        if self.body_bytes + len(chunk) > self.max_body_bytes:
            self.chunks.clear()
            raise EppError(Code.PAYLOAD_TOO_LARGE, f"request body larger than {self.max_body_bytes} bytes",
                           reason="body_too_large")
        if chunk:
            self.chunks.append(chunk)
            self.body_bytes += len(chunk)
        if not message.request_body.end_of_stream:
            if self.request_body_mode in BUFFERED_MODES:
                raise EppError(Code.PAYLOAD_TOO_LARGE, "request body exceeds the proxy's buffer", reason="body_too_large")
            return []
        # One copy at most: a body that came in one message (the usual case) is used as it is.
        raw = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        decision = await self._decide(raw)
        body = decision.body if decision.body is not None else raw
        destination = ",".join(ep.address for ep in decision.targets)
        set_headers, remove = self._upstream_headers(destination, body)
        if self.request is not None:  # picked: the body goes on in the replies, not in memory
            self.request.drop_payload()
        if self.request_body_mode in BUFFERED_MODES:
            return [messages.buffered_request_body(set_headers, remove, destination, decision.body)]
        return [
            messages.request_headers_response_wire(set_headers, remove, destination),
            *messages.streamed_request_body_wire(body),
        ]

    async def _decide(self, raw: bytes) -> Decision:
        headers = self.headers
        path = next((headers[name] for name in PATH_HEADERS if headers.get(name)), "/v1/completions")
        request = parse_request(raw, path=path, request_id=self.request_id, headers=headers)
        request.subset = self.subset
        self.request = request
        if self.refresh is not None:
            self.refresh()
        # If this stream is cancelled while the request waits (flow control) or right after its
        # dispatch, the director releases the pick itself; once assigned, close() releases it.
        decision, self.record = await self.director.handle_request(request)
        return decision

    def _pick_headers_only(self) -> bytes:
        path = next((self.headers[name] for name in PATH_HEADERS if self.headers.get(name)), "")
        self.request = InferenceRequest(
            request_id=self.request_id, api=api_for_path(path), model="", target_model="", body=None,
            headers=self.headers, subset=self.subset,
        )
        decision, self.record = self.director.handle_headers_only(self.request)
        destination = ",".join(ep.address for ep in decision.targets)
        set_headers, remove = self._upstream_headers(destination, None)
        return messages.request_headers_response_wire(set_headers, remove, destination)

    def _upstream_headers(self, destination: str, body: bytes | None) -> tuple[dict[str, str], list[str]]:
        """Destination, content-length and a generated request id; client-sent
        `x-gateway-destination-endpoint*` headers are overwritten or removed, never passed on."""
        set_headers = {messages.DESTINATION: destination}
        if body:
            set_headers["content-length"] = str(len(body))
        if self.generated_request_id:
            set_headers[REQUEST_ID] = self.request_id
        remove = [k for k in self.headers if k.startswith(messages.DESTINATION) and k != messages.DESTINATION]
        request = self.request
        if (self.handoff is not None and self.response_body_mode == NONE_MODE and self.record is not None
                and request is not None and request.body is not None and self.handoff.wanted(request.stream)):
            self.token = self.handoff.expect(self)  # no response phase here: an observer reports it
            set_headers[OBSERVE_TOKEN] = self.token
            if not request.api.native:  # usage in its body's `usage` object
                if request.stream:  # the observer for its first token, the log (if any) the rest
                    set_headers[OBSERVE_VIA] = VIA_FIRST_TOKEN
                else:
                    self.logged = True
                    set_headers[OBSERVE_VIA] = VIA_ACCESS_LOG
        elif OBSERVE_TOKEN in self.headers:
            remove.append(OBSERVE_TOKEN)
        if OBSERVE_VIA in self.headers and OBSERVE_VIA not in set_headers:
            remove.append(OBSERVE_VIA)
        return set_headers, remove

    # -- response path --

    def _on_response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        extra = self.response_headers_seen(message)
        if self.debug_header and self.record is not None and self.record.decision is not None:
            extra[DEBUG_HEADER] = self.record.decision.compact()
        if message.response_headers.end_of_stream:
            self._finish()
        return [messages.response_headers_response(extra)]

    def response_headers_seen(self, message: pb.ProcessingRequest) -> dict[str, str]:
        """The response headers (here, or reported by an observer stream): status, streaming,
        the served endpoint; returns the headers plugins want added (an observer cannot)."""
        if self.observer is not None:
            return {}  # seen already (the picker's response headers, then its observer's)
        if self.token and logged(message):
            self.logged = True  # Envoy's access log will report its usage and end (`access_log`)
        headers = _headers(message.response_headers)
        status = headers.get(":status", "200")
        self.response_status = int(status) if status.isdigit() else 0
        streaming = "text/event-stream" in headers.get("content-type", "") or bool(self.request and self.request.stream)
        self.observer = observer_for(self.request, headers, streaming)
        served_value = _struct_field(message, messages.LB_NAMESPACE, messages.DESTINATION_SERVED)
        served = served_value.string_value if served_value is not None else ""
        return self.director.on_response_headers(self.record, served) if self.record else {}

    def _on_response_body(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse | bytes]:
        body = message.response_body
        chunk = self.response_chunk_seen(body.body, body.end_of_stream)
        if self.response_body_mode == FULL_DUPLEX:
            return [messages.streamed_response_body_wire(chunk, body.end_of_stream)]
        changed = chunk is not body.body
        return [messages.buffered_response_body(chunk if changed else None)]

    def response_chunk_seen(self, chunk: bytes, end_of_stream: bool) -> bytes:
        """A response body chunk (here, or reported by an observer stream): the first one is the
        first token, every one feeds `usage`; returns it with the model name rewritten back."""
        record = self.record
        if record is not None and record.released:
            return chunk
        if self.observer is None:
            self.observer = observer_for(self.request, {}, bool(self.request and self.request.stream))
        if record is not None and not record.first_byte and chunk:
            self.director.first_byte(record)
        self.observer.feed(chunk)
        request = self.request
        if request is not None and request.model_rewritten and chunk:
            rewritten = rewrite_model_name(chunk, request.target_model, request.model)
            if rewritten != chunk:
                chunk = rewritten
        if end_of_stream:
            self._finish()
        return chunk

    def response_ended(self) -> None:
        """The observer stream saw the response end (or ended itself)."""
        self._finish()

    def response_logged(self, status: int, response_bytes: int, usage: bytes) -> None:
        """Envoy's access log reported the response (`epp.extproc.access_log`): its status, its
        size and its `usage` object as the body carried it (empty: none found)."""
        record = self.record
        if record is None or record.released:
            return
        self.response_status = status
        if self.observer is None:  # no observer saw its headers (a plain response)
            self.director.on_response_headers(record, "")
        observer = observer_for(self.request, {}, False)
        if usage:
            observer.feed(b'{"usage":' + usage + b"}")
        observer.bytes_seen = response_bytes
        self.observer = observer
        self._finish()

    # -- endings --

    def _finish(self) -> None:
        if self.token and self.handoff is not None:
            self.handoff.done(self.token)
        record = self.record
        if record is None or record.released:
            return
        usage = self.observer.finish() if self.observer else None
        if self.response_status >= 400 and not record.error_code:
            record.error_code = Code.MODEL_SERVER_ERROR.value
            if self.director.metrics and self.request is not None and self.request.body is not None:
                self.director.metrics.request_error(self.request, record.error_code)
        self.director.release(record, usage, self.observer.bytes_seen if self.observer else 0)

    def _fail(self, error: EppError) -> pb.ProcessingResponse:
        if self.record is not None:
            self.record.error_code = error.code.value
        if self.director.metrics and self.request is not None and self.request.body is not None:
            self.director.metrics.request_error(self.request, error.code.value)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s ended with %d: %s", self.request_id, error.http_status, error.message)
        self._finish()
        return messages.immediate_response(error)

