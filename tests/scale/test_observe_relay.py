"""An observer stream that lands on another worker than the pick's: what it sees is relayed to the
picking worker over its observation socket (real Unix datagram sockets) and replayed there."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.api.headers import OBSERVE_TOKEN
from epp.extproc.access_log import AccessLogReceiver
from epp.extproc.observer import ObserverStream
from epp.scale.observe import MemberHandoff, Relay

from .helpers import wait_for


class Picker:
    """Records what an observer reports, as a picking `RequestStream` would act on it."""

    def __init__(self) -> None:
        self.observer_attached = False
        self.seen: list[tuple[str, object]] = []

    def response_headers_seen(self, message: pb.ProcessingRequest) -> dict[str, str]:
        self.seen.append(("headers", message.response_headers.headers.headers[0].key))
        return {}

    def response_chunk_seen(self, chunk: bytes, end_of_stream: bool) -> bytes:
        self.seen.append(("chunk", (len(chunk), end_of_stream)))
        return chunk

    def response_ended(self) -> None:
        self.seen.append(("end", None))

    def response_logged(self, status: int, response_bytes: int, usage: bytes) -> None:
        self.seen.append(("logged", (status, response_bytes, usage)))


def message(**kind: object) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(observability_mode=True, **kind)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def two_workers(tmp_path: Path) -> AsyncIterator[tuple[list[Relay], list[MemberHandoff]]]:
    """Two workers' observation sockets and handoffs, started; closed at the end."""
    relays = [Relay(str(tmp_path), m) for m in range(2)]
    handoffs = [MemberHandoff(m, relays[m]) for m in range(2)]
    for relay, handoff in zip(relays, handoffs):
        await relay.start(handoff)
    try:
        yield relays, handoffs
    finally:
        for relay in relays:
            relay.close()


async def test_an_observer_on_another_worker_reports_to_the_picking_one(tmp_path: Path) -> None:
    async with two_workers(tmp_path) as (relays, handoffs):
        picker = Picker()
        token = handoffs[0].expect(picker)  # type: ignore[arg-type]  # worker 0 picked
        assert token.startswith("00") and handoffs[1].local(token) is None
        observer = ObserverStream(handoffs[1])  # worker 1 got the observer stream
        observer.handle(message(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=OBSERVE_TOKEN, raw_value=token.encode())]))))
        assert not observer.ended
        observer.handle(message(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]))))
        big = b"x" * (150 << 10)  # split over several datagrams, in order
        observer.handle(message(response_body=pb.HttpBody(body=b"data: first\n\n")))
        observer.handle(message(response_body=pb.HttpBody(body=big, end_of_stream=True)))
        await wait_for(lambda: ("end", None) in picker.seen, timeout=5, what="the relayed end")
        assert picker.observer_attached
        chunks = [v for k, v in picker.seen if k == "chunk"]
        assert picker.seen[0] == ("headers", ":status")
        assert chunks[0] == (13, False) and sum(n for n, _ in chunks[1:]) == len(big) and chunks[-1][1]
        assert relays[1].dropped == 0 and relays[0].received == len(picker.seen) + 1  # + the attachment


async def test_a_token_of_a_worker_that_is_gone_is_dropped_not_raised(tmp_path: Path) -> None:
    relay = Relay(str(tmp_path), 1)
    handoff = MemberHandoff(1, relay)
    await relay.start(handoff)
    try:
        observer = ObserverStream(handoff)
        observer.handle(message(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=OBSERVE_TOKEN, raw_value=b"07" + b"ab" * 8)]))))
        observer.handle(message(response_body=pb.HttpBody(body=b"data", end_of_stream=True)))
        await asyncio.sleep(0)
        assert relay.dropped >= 1  # worker 7 has no socket: the observation is lost, counted
    finally:
        relay.close()


async def test_an_access_log_entry_on_another_worker_reports_to_the_picking_one(tmp_path: Path) -> None:
    """Envoy's access-log stream lands on one worker; an entry for another's pick is relayed."""
    from types import SimpleNamespace

    from envoy.data.accesslog.v3 import accesslog_pb2
    from google.protobuf import struct_pb2

    relays = [Relay(str(tmp_path), m) for m in range(2)]
    handoffs = [MemberHandoff(m, relays[m]) for m in range(2)]
    receivers = [AccessLogReceiver(SimpleNamespace(handoff=h)) for h in handoffs]  # type: ignore[arg-type]
    for relay, handoff, receiver in zip(relays, handoffs, receivers):
        await relay.start(handoff, receiver.relayed)
    try:
        picker = Picker()
        token = handoffs[0].expect(picker)  # type: ignore[arg-type]  # worker 0 picked

        def entry(token: str) -> accesslog_pb2.HTTPAccessLogEntry:
            entry = accesslog_pb2.HTTPAccessLogEntry()
            entry.request.request_headers[OBSERVE_TOKEN] = token
            entry.response.response_code.value = 200
            entry.response.response_body_bytes = 1234
            entry.common_properties.metadata.filter_metadata["epp"].CopyFrom(
                struct_pb2.Struct(fields={"usage": struct_pb2.Value(string_value=usage)}))
            return entry

        usage = '{"prompt_tokens":5,"completion_tokens":2}'
        receivers[1].report(entry(token))  # worker 1 gets the access-log stream
        await wait_for(lambda: bool(picker.seen), timeout=5, what="the relayed report")
        assert picker.seen == [("logged", (200, 1234, usage.encode()))]
        # Counted once, by the worker whose pick it reached.
        assert [(r.reported, r.unmatched) for r in receivers] == [(1, 0), (0, 0)]
        # Another replica's pick whose token happens to name worker 0: unmatched, where it was looked for.
        receivers[1].report(entry("00" + "ab" * 8))
        await wait_for(lambda: receivers[0].unmatched == 1, timeout=5, what="the relayed entry counted")
        assert [(r.reported, r.unmatched) for r in receivers] == [(1, 1), (0, 0)]
    finally:
        for relay in relays:
            relay.close()


async def test_a_batch_of_entries_for_another_worker_arrives_whole(tmp_path: Path) -> None:
    """An access-log batch relays dozens of reports at once, more than a Unix datagram socket
    queues (10 on Linux): what does not fit waits and follows, in order; none is dropped."""
    async with two_workers(tmp_path) as (relays, handoffs):
        pickers = [Picker() for _ in range(64)]
        tokens = [handoffs[0].expect(p) for p in pickers]  # type: ignore[arg-type]
        for i, token in enumerate(tokens):
            relayed = handoffs[1].claim(token)
            assert relayed is not None
            relayed.response_logged(200, i, b"{}")
        await wait_for(lambda: all(p.seen for p in pickers), timeout=5, what="every relayed report")
        assert [p.seen[0][1][1] for p in pickers] == list(range(64))
        assert relays[1].dropped == 0 and relays[0].received == 64
