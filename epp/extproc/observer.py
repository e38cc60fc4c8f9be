"""The response phase off the token path: a second ext_proc filter that only observes.

In the Envoy configs this project ships, the picking filter has no response phase (response
headers SKIP, body NONE), so the model's output never waits on the EPP. A second ext_proc filter
after it runs in `observability_mode`: Envoy sends it the request headers (as the picker left
them), the response headers, every response body chunk and the trailers without waiting for an
answer, and the EPP answers nothing. That is enough to learn what the predicted-latency model and
the accounting need: the first body chunk of a streamed response is its first token
(`Director.first_byte`), the body carries `usage`, and its end (or the observer stream's end)
ends the request (`Director.release`).

The picking filter keeps `response_trailer_mode: SEND`: Envoy then holds its stream open until
the response is over (it might have trailers to send), without sending it anything else, so the
picking stream's end is still the request's end and the in-flight accounting stays exact on the
EPP that picked, whatever happens to the observer. The observer adds what only the body shows.

The two streams meet through a token: when the picker has no response phase it adds
`x-epp-observe: <random token>` to the request headers (overwriting any the client sent), and
the observer's first message carries it back (`Handoff`). Only the requests whose response is
worth observing get one — every streamed request, and the others unless sampled (`UNSTREAMED_SAMPLE`) —
and the shipped Envoy configs run the observer only on requests that carry the header (the
picker's reply clears the route cache, so the route is chosen again on what it left): an observer
stream costs the EPP about as much as the pick. So a non-streamed OpenAI-API response, whose only
news is its usage, is also marked `x-epp-observe-via: access-log`, and the shipped configs report
it through Envoy's access log instead, with the same token (`epp.extproc.access_log`); a streamed
one is marked `first-token`, and where the access log will report it (the observer's response
headers carry `epp.logged`) the observer ends after the first chunk. A config without the access
log runs the observer on every marked request to its end, as before. The observer's last chunks
may be read after the picking stream ended; a request whose observer is attached (or whose
access-log entry is to come) then waits for it up to `grace` seconds before it is released. An
observer stream that lands on another EPP (several EPP endpoints balanced per stream) or comes
late finds no token and reports nothing: that request's first token and usage are not learned,
its accounting is not affected.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.api.headers import OBSERVE_TOKEN
from epp.extproc.access_log import logged

if TYPE_CHECKING:
    from epp.extproc.stream import RequestStream

log = logging.getLogger("epp.extproc")

_TOKEN_BYTES = 8  # 64 random bits: a live token cannot be guessed
_TOKEN_CHARS = 2 * _TOKEN_BYTES
DEFAULT_GRACE = 1.0  # seconds an ended pick waits for its observer's last chunks
# Non-streamed requests observed: one in this many. Every one by default: their usage is what
# token-weighted fairness charges a flow, what the reference's token metrics
# (inference_objective_input/output_tokens) count and what the output-length model learns from,
# and a sample would make all three lie. An observer stream costs the EPP about as much CPU as
# the pick, so a pool that needs the CPU more than those can sample (`Handoff(unstreamed_sample)`).
UNSTREAMED_SAMPLE = 1


class Handoff:
    """Picks whose response an observer stream reports, by token (live while the pick is)."""

    def __init__(self, grace: float = DEFAULT_GRACE, unstreamed_sample: int = UNSTREAMED_SAMPLE) -> None:
        self.grace = grace
        self.unstreamed_sample = unstreamed_sample
        self.late = 0  # observers that did not end within the grace after their pick did
        self._unstreamed = 0
        self._waiting: dict[str, RequestStream] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def wanted(self, streamed: bool) -> bool:
        """Whether to have this request's response observed: every streamed one (its first chunk
        is its first token), one non-streamed request in `unstreamed_sample`."""
        if streamed:
            return True
        self._unstreamed += 1
        return self.unstreamed_sample > 0 and self._unstreamed % self.unstreamed_sample == 0

    def expect(self, stream: RequestStream) -> str:
        """A new token for `stream`'s request, whose response an observer will see."""
        token = secrets.token_hex(_TOKEN_BYTES)
        self._waiting[token] = stream
        return token

    def claim(self, token: str) -> RequestStream | None:
        """An observer arrived with `token`: the pick it reports on, if still live."""
        if len(token) != _TOKEN_CHARS:
            return None
        return self._waiting.get(token)

    def local(self, token: str) -> RequestStream | None:
        """The live pick of this process that `token` names (`claim` may return a stand-in for
        another process's)."""
        return self._waiting.get(token)

    def picker_closed(self, stream: RequestStream, token: str) -> bool:
        """The picking stream ended. True: its observer is still reporting, or the access log
        will, keep the request open for it (up to the grace); False: release it now."""
        if not (stream.observer_attached or stream.logged) or token not in self._waiting or token in self._timers:
            return False
        self._timers[token] = asyncio.get_running_loop().call_later(self.grace, self._expire, token)
        return True

    def done(self, token: str) -> None:
        """The request ended (any way): forget its token."""
        self._waiting.pop(token, None)
        timer = self._timers.pop(token, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, token: str) -> None:
        self._timers.pop(token, None)
        stream = self._waiting.pop(token, None)
        if stream is not None:
            self.late += 1
            if self.late == 1 or self.late % 1000 == 0:  # said, not repeated per request
                log.warning("%d response(s) ended without their report within %.1f s (their usage is not counted): "
                            "an observer stream that did not end, or an access-log entry that did not come "
                            "(is Envoy's epp-response-log reaching this EPP? Envoy's "
                            "access_logs.grpc_access_log.logs_dropped counts the entries it dropped while this "
                            "EPP read them too slowly); "
                            "inference_extension_response_reports_total{outcome=\"late\"} counts them",
                            self.late, self.grace)
            stream.close_unobserved()

    def close(self) -> None:
        """The server stops: end every request still waiting for its observer."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for stream in list(self._waiting.values()):
            stream.close_unobserved()
        self._waiting.clear()


class ObserverStream:
    """One observer stream (observability mode): reports the response to its pick, answers nothing.
    Once `ended` (the response is over, or there is no pick to report to) the server ends the
    stream: Envoy keeps an observer stream open until the server does (`deferred_close_timeout`),
    and every open stream counts against the EPP cluster's concurrent-request limit."""

    def __init__(self, handoff: Handoff) -> None:
        self.handoff = handoff
        self.picker: RequestStream | None = None
        self.ended = False
        self.first_token_only = False

    def handle(self, message: pb.ProcessingRequest) -> None:
        kind = message.WhichOneof("request")
        picker = self.picker
        try:
            if kind == "request_headers":
                self._attach(message.request_headers)
                if self.picker is None:
                    self.ended = True  # nothing to report to: end the stream at once
            elif picker is None or self.ended:
                return
            elif kind == "response_headers":
                picker.response_headers_seen(message)
                # Envoy's access log will report the usage and the end: only the first token is ours.
                self.first_token_only = logged(message)
                if message.response_headers.end_of_stream:
                    self._end()
            elif kind == "response_body":
                body = message.response_body
                picker.response_chunk_seen(body.body, body.end_of_stream)
                if body.end_of_stream:
                    self._end()
                elif body.body and self.first_token_only:
                    self.ended = True  # the server ends the stream: Envoy sends it no more chunks
            elif kind == "response_trailers":
                self._end()
        except Exception:
            log.exception("internal error observing %s", kind)

    def close(self) -> None:
        """The observer stream ended: so did the response, whatever was seen of it."""
        self._end()

    def _attach(self, headers: pb.HttpHeaders) -> None:
        token = ""
        for h in headers.headers.headers:
            if h.key == OBSERVE_TOKEN:
                token = h.raw_value.decode("ascii", "replace") if h.raw_value else h.value
                break
        picker = self.handoff.claim(token) if token else None
        if picker is not None:
            self.picker = picker
            picker.observer_attached = True

    def _end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.picker is not None:
            self.picker.response_ended()

