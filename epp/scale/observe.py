"""Observer streams across a pod's workers: a response is reported to the worker that picked it.

The shipped Envoy configs keep responses off the EPP and report them on a second, observing
ext_proc stream (`epp.extproc.observer`), matched to its pick by a token. With several workers
behind one port the kernel gives that stream to any of them, so a worker's tokens name it
(`MemberHandoff`: two hex digits of its member number, then the random part) and a worker that
gets an observer stream for another worker's token relays what it sees — the attachment, the
response headers, each body chunk, the end — to that worker's observation socket (`Relay`).
The owner replays them on the picking stream exactly as its own observer would, so first
tokens, usage and ends are learned whichever worker the observer landed on. Envoy's access-log
stream (`epp.extproc.access_log`) lands on one worker too; an entry for another worker's pick is
relayed the same way (`LOGGED`).

The relay is a Unix datagram socket per worker in the pod's private directory: reliable and
ordered on Linux, the owner's event loop wakes on arrival (a first token is timed when it
arrives, not on a timer), and a sender never blocks — a datagram that finds the owner's queue
full (Linux queues 10 per socket; an access-log batch relays dozens at once) waits in order and
is retried every millisecond, up to a bound beyond which it is dropped (that request's first
token or usage is not learned, as when an observer lands on another replica) and counted.
Chunks larger than one datagram are split.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.extproc.observer import Handoff

if TYPE_CHECKING:
    from epp.extproc.stream import RequestStream

log = logging.getLogger("epp.scale")

ATTACH, HEADERS, CHUNK, END, LOGGED = range(5)
_PREFIX_CHARS = 2
_RANDOM_BYTES = 8
_TOKEN_CHARS = _PREFIX_CHARS + 2 * _RANDOM_BYTES
_HEADER = struct.Struct("<BB")  # kind, end of stream (chunks)
_MAX_DATAGRAM = 60 << 10  # well under Linux's default AF_UNIX datagram limit
_LOGGED = struct.Struct("<HQ")  # an access-log report: status, response bytes (then the usage)
_MAX_BACKLOG = 4096  # datagrams waiting for one owner's queue; beyond, dropped (counted)
_RETRY_SECONDS = 0.001


def socket_path(directory: str, member: int) -> str:
    return str(Path(directory) / f"observe-{member}.sock")


class MemberHandoff(Handoff):
    """A worker's `Handoff` whose tokens name the worker; another worker's token gets a relay."""

    def __init__(self, member: int, relay: Relay) -> None:
        super().__init__()
        self.member = member
        self.prefix = f"{member:02x}"
        self.relay = relay

    def expect(self, stream: RequestStream) -> str:
        token = self.prefix + secrets.token_hex(_RANDOM_BYTES)
        self._waiting[token] = stream
        return token

    def claim(self, token: str) -> RequestStream | RelayedPicker | None:  # type: ignore[override]
        if len(token) != _TOKEN_CHARS:
            return None
        if token.startswith(self.prefix):
            return self._waiting.get(token)
        try:
            owner = int(token[:_PREFIX_CHARS], 16)
        except ValueError:
            return None
        return RelayedPicker(self.relay, owner, token)

    def local(self, token: str) -> RequestStream | None:
        return self._waiting.get(token) if token.startswith(self.prefix) else None


class RelayedPicker:
    """Stands in for another worker's picking stream: what an `ObserverStream` tells it goes there."""

    def __init__(self, relay: Relay, owner: int, token: str) -> None:
        self.relay = relay
        self.owner = owner
        self.token = token.encode()
        self._attached = False

    @property
    def observer_attached(self) -> bool:
        return self._attached

    @observer_attached.setter
    def observer_attached(self, attached: bool) -> None:
        if attached and not self._attached:
            self._attached = True
            self._send(ATTACH, b"")

    def response_headers_seen(self, message: pb.ProcessingRequest) -> dict[str, str]:
        self._send(HEADERS, message.SerializeToString())
        return {}

    def response_chunk_seen(self, chunk: bytes, end_of_stream: bool) -> bytes:
        if not chunk:
            self._send(CHUNK, b"", end_of_stream)
        for start in range(0, len(chunk), _MAX_DATAGRAM):
            piece = chunk[start:start + _MAX_DATAGRAM]
            self._send(CHUNK, piece, end_of_stream and start + _MAX_DATAGRAM >= len(chunk))
        return chunk

    def response_ended(self) -> None:
        self._send(END, b"")

    def response_logged(self, status: int, response_bytes: int, usage: bytes) -> None:
        self._send(LOGGED, _LOGGED.pack(min(status, 0xFFFF), min(response_bytes, 1 << 63)) + usage)

    def _send(self, kind: int, payload: bytes, end_of_stream: bool = False) -> None:
        self.relay.send(self.owner, _HEADER.pack(kind, int(end_of_stream)) + self.token + payload)


class Relay:
    """This worker's observation socket (it receives the others' relays) and its sending side."""

    def __init__(self, directory: str, member: int) -> None:
        self.directory = directory
        self.member = member
        self.handoff: MemberHandoff | None = None
        self.sent = 0
        self.received = 0
        self.dropped = 0  # datagrams that found the owner's backlog full or its socket gone
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)
        self._transport: asyncio.DatagramTransport | None = None
        # Per owner, in order, what its queue would not take yet: Linux queues only
        # net.unix.max_dgram_qlen (10) datagrams per socket, and an access-log batch relays dozens.
        self._backlog: dict[int, deque[bytes]] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._logged: Callable[[bool], None] | None = None

    async def start(self, handoff: MemberHandoff, logged: Callable[[bool], None] | None = None) -> None:
        """Receive on this worker's socket; `logged(matched)` counts each relayed access-log entry
        (whether it found its pick here: one of another replica's whose token happens to name
        this worker does not)."""
        self.handoff = handoff
        self._logged = logged
        path = socket_path(self.directory, self.member)
        with contextlib.suppress(FileNotFoundError):  # a dead predecessor's
            os.unlink(path)
        inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        inbox.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # a burst of relayed chunks
        inbox.bind(path)
        inbox.setblocking(False)
        self._transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Inbox(self), sock=inbox)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._backlog.clear()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._out.close()

    def send(self, owner: int, datagram: bytes) -> None:
        """To `owner`'s socket, after what is waiting for it; a datagram its queue does not take
        now waits (bounded: `_MAX_BACKLOG`, then dropped) and is retried every millisecond."""
        waiting = self._backlog.get(owner)
        if waiting:
            if len(waiting) >= _MAX_BACKLOG:
                self.dropped += 1
            else:
                waiting.append(datagram)
            return
        try:
            self._out.sendto(datagram, socket_path(self.directory, owner))
            self.sent += 1
        except BlockingIOError:  # its queue is full: retry shortly
            self._backlog[owner] = deque([datagram])
            self._schedule_retry()
        except OSError:  # the owner is restarting: this observation is lost
            self.dropped += 1

    def _schedule_retry(self) -> None:
        if self._retry is None and self._transport is not None:
            self._retry = asyncio.get_running_loop().call_later(_RETRY_SECONDS, self._flush)

    def _flush(self) -> None:
        self._retry = None
        for owner, waiting in list(self._backlog.items()):
            path = socket_path(self.directory, owner)
            while waiting:
                try:
                    self._out.sendto(waiting[0], path)
                except BlockingIOError:
                    break
                except OSError:  # gone: everything waiting for it is lost
                    self.dropped += len(waiting)
                    waiting.clear()
                    break
                waiting.popleft()
                self.sent += 1
            if not waiting:
                del self._backlog[owner]
        if self._backlog:
            self._schedule_retry()

    def received_datagram(self, data: bytes) -> None:
        handoff = self.handoff
        if handoff is None or len(data) < _HEADER.size + _TOKEN_CHARS:
            return
        kind, end_of_stream = _HEADER.unpack_from(data)
        token = data[_HEADER.size:_HEADER.size + _TOKEN_CHARS].decode("ascii", "replace")
        payload = data[_HEADER.size + _TOKEN_CHARS:]
        stream = handoff.local(token)
        if kind == LOGGED and self._logged is not None:
            self._logged(stream is not None)
        if stream is None:
            return  # already ended (or never ours)
        self.received += 1
        try:
            if kind == ATTACH:
                stream.observer_attached = True
            elif kind == HEADERS:
                message = pb.ProcessingRequest()
                message.ParseFromString(payload)
                stream.response_headers_seen(message)
            elif kind == CHUNK:
                stream.response_chunk_seen(payload, bool(end_of_stream))
            elif kind == END:
                stream.response_ended()
            elif kind == LOGGED and len(payload) >= _LOGGED.size:
                status, response_bytes = _LOGGED.unpack_from(payload)
                stream.response_logged(status, response_bytes, payload[_LOGGED.size:])
        except Exception:  # a relayed observation must never break the picking stream
            log.exception("replaying a relayed observation failed")


class _Inbox(asyncio.DatagramProtocol):
    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def datagram_received(self, data: bytes, addr: object) -> None:
        self.relay.received_datagram(data)
