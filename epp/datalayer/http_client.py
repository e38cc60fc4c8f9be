"""A keep-alive HTTP/1.1 GET for scraping: one connection per pod, one request at a time.

The scraper polls every pod twenty times a second; a general client's per-request machinery
(aiohttp's session, request and response objects, cookie and redirect handling, a task and a
timeout context per request) cost ~100 µs of CPU per poll here, three times the polling itself.
This client is an asyncio protocol over `httptools` (llhttp, the C parser Node.js uses) driven by
callbacks: a request prepared once is written, the body is gathered as it arrives, and `done` is
called once with the page or the failure; a timer bounds the whole poll. Anything unusual (a
status other than 200, a body over the limit, a parse error, a timeout, a closed connection)
fails the poll with `FetchFailed` (or TimeoutError) and drops the connection, so the next poll
starts clean.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import httptools

_MAX_HEADER_BYTES = 64 << 10

Done = Callable[[bytes | None, BaseException | None], None]


class FetchFailed(Exception):
    """A poll that got no page; the message is short and stable (it becomes the scrape error)."""


@dataclass(slots=True, frozen=True)
class Target:
    """Where one pod's page is: `scheme://host:port/path` (host an IP, maybe IPv6), and the query
    string asked with it (the series wanted: not part of `url`, which logs show)."""

    scheme: str
    host: str
    port: int
    path: str
    query: str = ""

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"

    def request(self) -> bytes:
        host = f"[{self.host}]" if ":" in self.host else self.host
        # Plain text only (no protobuf/OpenMetrics negotiation), uncompressed: decompressing
        # ~50 KB twenty times a second costs more CPU than the bytes cost on a pod network.
        target = self.path
        if self.query:
            target += ("&" if "?" in target else "?") + self.query
        return (f"GET {target} HTTP/1.1\r\nHost: {host}:{self.port}\r\n"
                "Accept: text/plain;version=0.0.4\r\nAccept-Encoding: identity\r\n"
                "User-Agent: epp-scraper\r\n\r\n").encode("latin-1")


def client_ssl_context(verify: bool) -> ssl.SSLContext:
    """TLS for https pods: with `verify` False (insecureSkipVerify, the default) any certificate."""
    ctx = ssl.create_default_context()
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class _Protocol(asyncio.Protocol):
    """One connection. `begin` arms it for the next response; `client.finished` gets the outcome,
    after the parser has returned (never from inside one of its callbacks)."""

    def __init__(self, client: PageClient) -> None:
        self.client = client
        self.max_body = client.max_body
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.busy = False
        self.closed = False
        self.chunks: list[bytes] = []
        self.size = 0
        self.header_bytes = 0
        self.reason = b""
        self.outcome: tuple[bytes | None, BaseException | None] | None = None
        self.keep_alive = True

    # -- asyncio --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            self.close()  # nothing was asked: a confused server
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # A callback's own FetchFailed comes back wrapped in a parser error.
            cause = exc.__context__
            self.outcome = (None, cause if isinstance(cause, FetchFailed) else FetchFailed(f"bad HTTP response: {exc}"))
        outcome = self.outcome
        if outcome is not None:
            self.outcome = None
            self.busy = False
            if outcome[1] is not None or not self.keep_alive:
                self.close()
            self.client.finished(self, *outcome)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.busy:
            self.busy = False
            self.client.finished(self, None, FetchFailed("connection closed by the server"))

    # -- httptools callbacks --

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > _MAX_HEADER_BYTES:
            raise FetchFailed("response headers too large")
        if len(name) == 14 and name.lower() == b"content-length" and value.isdigit() and int(value) > self.max_body:
            raise FetchFailed(f"response too large ({int(value)} bytes > {self.max_body})")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.max_body:
            raise FetchFailed(f"response too large (> {self.max_body} bytes)")
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.keep_alive = self.parser.should_keep_alive()
        self.chunks = []
        if status != 200:
            reason = self.reason.decode("latin-1", "replace").strip()[:60]
            self.outcome = (None, FetchFailed(f"HTTP {status} {reason}".rstrip()))
        else:
            self.outcome = (body, None)

    # -- ours --

    def begin(self, request: bytes) -> None:
        self.busy = True
        self.chunks = []
        self.size = self.header_bytes = 0
        self.reason = b""
        self.outcome = None
        self.transport.write(request)  # type: ignore[union-attr]

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class PageClient:
    """Fetches one pod's page over a kept-alive connection (reconnecting when it is lost)."""

    def __init__(self, target: Target, *, timeout: float, max_body: int,
                 ssl_context: ssl.SSLContext | None = None, timed: bool = True) -> None:
        self.target = target
        self.timeout = timeout
        # False: the owner keeps the time (one timer for many clients) and calls `expire`.
        self.timed = timed
        self.max_body = max_body
        self.ssl_context = ssl_context if target.scheme == "https" else None
        self._request = target.request()
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._done: Done | None = None

    @property
    def busy(self) -> bool:
        return self._done is not None

    def retarget(self, target: Target) -> None:
        """Ask for `target` from the next GET on (same server: the connection is kept)."""
        self.target = target
        self._request = target.request()

    def get(self, done: Done) -> None:
        """Start one GET on the running loop. `done(body, None)` or `done(None, error)` is called
        exactly once, later, from the loop (the error a FetchFailed or a TimeoutError, after
        `timeout`, or when the owner says so with `expire` if the client is not `timed`)."""
        if self._done is not None:
            raise RuntimeError("a GET is already in progress")
        loop = asyncio.get_running_loop()
        self._done = done
        if self.timed:
            self._timer = loop.call_later(self.timeout, self.expire)
        protocol = self._protocol
        if protocol is not None and not protocol.closed:
            protocol.begin(self._request)
        else:
            self._connecting = loop.create_task(self._connect())

    async def _connect(self) -> None:
        target = self.target
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await loop.create_connection(
                lambda: _Protocol(self), target.host, target.port, ssl=self.ssl_context,
                server_hostname=target.host if self.ssl_context is not None else None)
        except asyncio.CancelledError:
            return  # closed (timeout or stop) while connecting; `close` reported it
        except ssl.SSLError as exc:
            self._finish(None, FetchFailed(f"TLS: {exc.reason or exc}"))
        except OSError as exc:
            self._finish(None, FetchFailed(f"cannot connect: {exc.strerror or exc}"))
        else:
            self._connecting = None
            if self._done is None:  # expired meanwhile
                protocol.close()
                return
            self._protocol = protocol
            protocol.begin(self._request)

    def finished(self, protocol: _Protocol, body: bytes | None, error: BaseException | None) -> None:
        """From the protocol: its response (or failure) is in."""
        if protocol is self._protocol:
            self._finish(body, error)

    def expire(self) -> None:
        """The GET in progress took too long: `done(None, TimeoutError())` (nothing if none is)."""
        self._timer = None
        if self._done is not None:
            self._finish(None, TimeoutError())

    def _finish(self, body: bytes | None, error: BaseException | None) -> None:
        done, self._done = self._done, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if error is not None:
            self._drop()  # a late answer must not become the next poll's
        if done is not None:
            done(body, error)

    def _drop(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            protocol.busy = False
            protocol.close()
        task, self._connecting = self._connecting, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def close(self) -> asyncio.Task[None] | None:
        """Drop the connection and any GET in progress (whose `done` is not called). Returns a
        connection attempt that was cancelled, for the caller to await if it must."""
        task = self._connecting
        self._done = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._drop()
        return task if task is not None and not task.done() else None
