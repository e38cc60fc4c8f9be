"""Responses' usage reported by Envoy's access log instead of an observer stream.

An observer stream (`epp.extproc.observer`) costs the EPP about as much CPU as the pick: a stream
and three messages per request, for a non-streamed response whose only news is its `usage` (its
first byte is its last, and the picking stream's end is already its end), and a message per chunk
of a streamed one, of which only the first (its first token) must be timed as it comes. So for
an OpenAI API's request (usage in the body's `usage` object) the picker marks the request
`x-epp-observe-via` beside its token: `access-log` for a non-streamed one, which the shipped
Envoy configs then do not observe at all, `first-token` for a streamed one. A Lua filter marks the
stream's dynamic metadata `epp.logged` as the response starts (the observer forwards it: the EPP
ends a streamed response's observer after its first chunk), reads the `usage` object off the end
of the body as it passes (never buffering it), and Envoy's gRPC access log sends one entry per
such request to this service on the EPP's own port, batched (`buffer_flush_interval`): one
message carries every entry of its interval. About 0.3 ms of EPP CPU per plain request less, and
a streamed one's chunks no longer reach the EPP (BENCHMARKS.md). An Envoy config without the
Lua filter and the log runs the observer on every marked request to its end, as before.

The pod's share of the request ends when the picking stream does (`Director.response_over`);
what needs the usage (token fairness, the token metrics, the output-length model) waits for the
entry up to the handoff's grace, and goes on without it after (counted as late). An entry whose
token names no live pick is counted and dropped: the pick ended without it, or it is another
replica's. Nothing in an entry is trusted beyond its token: the usage is parsed by the same
bounded reader as a body's.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from epp.api.headers import OBSERVE_TOKEN

if TYPE_CHECKING:
    from epp.extproc.server import ExternalProcessor

log = logging.getLogger("epp.extproc")

METADATA_NAMESPACE = "epp"  # the Lua filter's dynamic metadata (`epp/local/envoy.py`)
USAGE_KEY = "usage"
LOGGED_KEY = "logged"  # set as the response starts: the access log will report it
_MAX_USAGE_BYTES = 4096  # the Lua filter keeps the body's last 2 KiB; a usage object is ~150 bytes


def logged(message: object) -> bool:
    """Whether an ext_proc message carries the Lua filter's mark (`epp.logged`: the access log
    will report this response), forwarded by the observer filter's `metadata_options`."""
    metadata = message.metadata_context.filter_metadata  # type: ignore[attr-defined]
    return METADATA_NAMESPACE in metadata and LOGGED_KEY in metadata[METADATA_NAMESPACE].fields


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    """`envoy.service.accesslog.v3.AccessLogService` on the EPP's gRPC port."""

    def __init__(self, extproc: ExternalProcessor) -> None:
        self.extproc = extproc  # its handoff is read per entry: `epp serve --workers` swaps it in
        # Entries that reached a live pick, and those with none to report to. One for another
        # worker of the pod is counted by that worker when it arrives there (`relayed`).
        self.reported = 0
        self.unmatched = 0

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],  # noqa: N802
                               context: grpc.aio.ServicerContext) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                try:
                    self.report(entry)
                except Exception:  # one bad entry must not end the stream (and lose the others)
                    log.exception("reading an access-log entry failed")
        return als_pb2.StreamAccessLogsResponse()

    def relayed(self, matched: bool) -> None:
        """An entry another worker of the pod received for a pick of this one's arrived."""
        if matched:
            self.reported += 1
        else:
            self.unmatched += 1

    def report(self, entry: object) -> None:
        """One `HTTPAccessLogEntry`: to the pick its token names."""
        token = entry.request.request_headers.get(OBSERVE_TOKEN, "")  # type: ignore[attr-defined]
        handoff = self.extproc.handoff
        picker = handoff.claim(token) if token else None
        if picker is None:
            self.unmatched += 1
            return
        usage = b""
        metadata = entry.common_properties.metadata.filter_metadata  # type: ignore[attr-defined]
        if METADATA_NAMESPACE in metadata:
            fields = metadata[METADATA_NAMESPACE].fields
            if USAGE_KEY in fields:
                usage = fields[USAGE_KEY].string_value.encode()
                if len(usage) > _MAX_USAGE_BYTES:
                    usage = b""
        response = entry.response  # type: ignore[attr-defined]
        if handoff.local(token) is picker:  # (not a stand-in for another worker's pick)
            self.reported += 1
        picker.response_logged(response.response_code.value, response.response_body_bytes, usage)


def add_to_server(receiver: AccessLogReceiver, server: grpc.aio.Server) -> None:
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(receiver, server)
