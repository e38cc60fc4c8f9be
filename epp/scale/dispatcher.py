"""Flow control across workers: one process holds the pod's queues and makes their picks.

Why the dispatcher picks too, rather than only ordering: the flow controller's contract is a
synchronous, accounted pick per dispatch — the next dispatch of the same cycle must see where the
previous one went (the in-flight guard counts dispatches per endpoint since its last scrape,
batch slots keep each flow's requests per endpoint) — so the pick has to happen where the queues
are. The dispatcher is therefore an `EndpointPicker` without an ext_proc server: its director,
with the configured `FlowControlAdmission` and `FlowController` as they are, decides every
request with a body exactly as a single-process EPP would, so fairness and priority hold however
many workers take the gateway's streams. The workers keep the protocol work (HTTP/2 and
protobuf, bodies in and out, parsing, watching responses for usage), header-only requests (a
random pick needs no queue), and their share of the pod's view through the shared table.

A worker's `RemoteDirector` hands each parsed request to the dispatcher over a Unix socket
(msgpack frames, one connection per worker) and waits for the decision; it reports the first
byte and the end of the response, and a cancel if the client leaves first. The dispatcher's
director accounts and releases them as its own (its rows of the shared table), and releases
every request of a worker whose connection drops (the worker died): nothing stays counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any

import msgspec

from epp.api.request import InferenceRequest
from epp.api.response import Usage
from epp.datastore import Endpoint, EndpointSpec, split_host_port
from epp.errors import Code, EppError
from epp.observability.trace import DecisionRecord
from epp.requestcontrol.director import Decision, Director, RequestRecord

log = logging.getLogger("epp.scale")

_FRAME = struct.Struct("<I")
SUBMIT, DECIDED, FAILED, FIRST_BYTE, RELEASE, CANCEL, OVER = range(7)
# A frame is [kind, request id, ...]; a request and a usage travel as their own msgpack bytes,
# decoded straight into their types.
_encode = msgspec.msgpack.Encoder().encode
_request = msgspec.msgpack.Decoder(InferenceRequest)
_usage = msgspec.msgpack.Decoder(Usage)


async def _read(reader: asyncio.StreamReader, limit: int) -> list[Any] | None:
    try:
        (length,) = _FRAME.unpack(await reader.readexactly(_FRAME.size))
        if length > limit:
            raise ValueError(f"frame of {length} bytes over the limit {limit}")
        return msgspec.msgpack.decode(await reader.readexactly(length))
    except asyncio.IncompleteReadError:
        return None


def _write(writer: asyncio.StreamWriter, message: list[Any]) -> None:
    payload = _encode(message)
    writer.write(_FRAME.pack(len(payload)) + payload)


# -- the worker's side --


@dataclass(slots=True, eq=False)
class RemoteRecord(RequestRecord):
    """A request the dispatcher decided and accounts; the worker only reports its life."""

    remote_id: int = 0


@dataclass(slots=True)
class RemoteDecisionRecord(DecisionRecord):
    """The dispatcher's decision line, for the debug response header."""

    line: str = ""

    def compact(self, limit: int = 4) -> str:
        return self.line


class RemoteDirector(Director):
    """The director a worker's ext_proc server talks to when the pod has flow control: requests
    with a body go to the dispatcher; header-only requests and response headers stay local."""

    def __init__(self, local: Director, socket_path: str, *, counted: Any = None,
                 max_frame_bytes: int = 256 << 20) -> None:
        super().__init__(local.datastore, local.scheduler, local.admission, pre_request=local.pre_request,
                         response_received=local.response_received, response_complete=local.response_complete,
                         metrics=local.metrics, subset_filter=local.subset_filter, trace=local.trace)
        self.shared = local.shared
        self.socket_path = socket_path
        self.counted = counted  # called per request handed over (the pod's per-member metric)
        self.max_frame_bytes = max_frame_bytes
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[list[Any]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connecting: asyncio.Lock | None = None

    async def _connection(self) -> asyncio.StreamWriter:
        if self._writer is not None and not self._writer.is_closing():
            return self._writer
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is None or self._writer.is_closing():
                try:
                    reader, self._writer = await asyncio.open_unix_connection(self.socket_path)
                except OSError as exc:
                    raise EppError(Code.SERVICE_UNAVAILABLE, "flow control is not available (its dispatcher "
                                   "process is not running)", reason="dispatcher_down") from exc
                self._reader_task = asyncio.get_running_loop().create_task(self._replies(reader, self._writer))
        return self._writer

    async def _replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (message := await _read(reader, self.max_frame_bytes)) is not None:
                future = self._pending.get(message[1])
                if future is not None and not future.done():
                    future.set_result(message)
        except Exception:
            log.exception("reading the dispatcher's replies failed")
        finally:
            writer.close()
            if self._writer is writer:
                self._writer = None
            lost = EppError(Code.SERVICE_UNAVAILABLE, "the flow-control dispatcher went away", reason="dispatcher_down")
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(lost)

    async def handle_request(self, request: InferenceRequest) -> tuple[Decision, RequestRecord]:
        writer = await self._connection()
        rid = next(self._ids)
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        if self.counted is not None:
            self.counted()
        try:
            _write(writer, [SUBMIT, rid, _encode(request)])
            reply = await future
        except asyncio.CancelledError:  # the client left while queued or being decided
            self._send([CANCEL, rid])
            raise
        finally:
            self._pending.pop(rid, None)
        if reply[0] == FAILED:
            _, _, code, message, reason = reply
            raise EppError(Code(code), message, reason=reason)
        _, _, addresses, body, line = reply
        targets = [self._endpoint(address) for address in addresses]
        record = RemoteRecord(request=request, endpoint=targets[0], start=self.datastore.clock(),
                              admitted=True, remote_id=rid)
        if line:
            record.decision = RemoteDecisionRecord(request.request_id, 0.0, request.model, request.target_model,
                                                   request.objective, request.fairness_id, request.priority,
                                                   "picked", line=line)
        return Decision(targets=targets, body=body), record

    def _endpoint(self, address: str) -> Endpoint:
        """This worker's endpoint for the dispatcher's pick (discovery may lag by a moment)."""
        found = self.datastore.get(address)
        if found is not None:
            return found
        ip, port = split_host_port(address)
        return Endpoint(EndpointSpec(name=address, ip=ip, port=port))

    def _send(self, message: list[Any]) -> None:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            _write(writer, message)

    def first_byte(self, record: RequestRecord) -> None:
        if not isinstance(record, RemoteRecord):
            return super().first_byte(record)
        if record.first_byte or record.released:
            return
        record.first_byte = self.datastore.clock()
        self._send([FIRST_BYTE, record.remote_id])

    def response_over(self, record: RequestRecord) -> None:
        if not isinstance(record, RemoteRecord):
            return super().response_over(record)
        if record.released or record.over:
            return
        record.over = True
        self._send([OVER, record.remote_id])

    def release(self, record: RequestRecord, usage: Usage | None = None, response_bytes: int = 0) -> None:
        if not isinstance(record, RemoteRecord):
            return super().release(record, usage, response_bytes)
        if record.released:
            return
        record.released = True
        self._send([RELEASE, record.remote_id, _encode(usage) if usage is not None else None, response_bytes,
                    record.error_code])

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)


# -- the dispatcher's side --


class _Worker:
    """One worker's connection: its requests being decided, and those decided and not ended."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.deciding: dict[int, asyncio.Task[None]] = {}
        self.records: dict[int, RequestRecord] = {}


class DispatchServer:
    """Serves the workers' `RemoteDirector`s with the pod's one director (and its queues)."""

    def __init__(self, director: Director, socket_path: str, *, max_body_bytes: int,
                 debug_header: bool = False) -> None:
        self.director = director
        self.debug_header = debug_header
        self.socket_path = socket_path
        self.max_frame_bytes = 2 * max_body_bytes + (1 << 20)  # the body and its parse, with headers
        self._server: asyncio.AbstractServer | None = None
        self._workers: set[_Worker] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # a dead predecessor's socket
            os.unlink(self.socket_path)
        self._server = await asyncio.start_unix_server(self._serve, self.socket_path)

    async def stop(self, grace: float = 1.0) -> None:
        """No new workers; requests being decided get up to `grace` seconds (the admission's stop
        then ends those still queued, and `close` the connections)."""
        if self._server is not None:
            self._server.close()
        deciding = [task for worker in self._workers for task in worker.deciding.values()]
        if deciding and grace > 0:
            await asyncio.wait(deciding, timeout=grace)

    async def close(self) -> None:
        await asyncio.sleep(0)  # let the last replies go out
        for worker in list(self._workers):
            worker.writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        worker = _Worker(writer)
        self._workers.add(worker)
        try:
            while (message := await _read(reader, self.max_frame_bytes)) is not None:
                self._handle(worker, message)
        except Exception:
            log.exception("a worker's connection to the dispatcher failed")
        finally:
            self._workers.discard(worker)
            self._drop(worker)
            writer.close()

    def _handle(self, worker: _Worker, message: list[Any]) -> None:
        kind, rid = message[0], message[1]
        if kind == SUBMIT:
            request = _request.decode(message[2])
            worker.deciding[rid] = asyncio.get_running_loop().create_task(self._decide(worker, rid, request))
        elif kind == CANCEL:
            task = worker.deciding.pop(rid, None)
            if task is not None:
                task.cancel()
            record = worker.records.pop(rid, None)
            if record is not None:  # decided, but the client left before the worker heard
                record.error_code = "Cancelled"
                self.director.release(record)
        elif kind == FIRST_BYTE:
            record = worker.records.get(rid)
            if record is not None:
                self.director.first_byte(record)
        elif kind == OVER:
            record = worker.records.get(rid)
            if record is not None:
                self.director.response_over(record)
        elif kind == RELEASE:
            record = worker.records.pop(rid, None)
            if record is not None:
                usage = _usage.decode(message[2]) if message[2] is not None else None
                if message[4]:
                    record.error_code = message[4]
                self.director.release(record, usage, message[3])

    async def _decide(self, worker: _Worker, rid: int, request: InferenceRequest) -> None:
        try:
            decision, record = await self.director.handle_request(request)
        except EppError as error:
            _write(worker.writer, [FAILED, rid, error.code.value, error.message, error.reason])
            return
        except asyncio.CancelledError:  # the director released whatever it had accounted
            return
        except Exception:
            log.exception("deciding a worker's request failed")
            _write(worker.writer, [FAILED, rid, Code.INTERNAL.value, "internal error", "internal"])
            return
        finally:
            worker.deciding.pop(rid, None)
        worker.records[rid] = record
        line = record.decision.compact() if self.debug_header and record.decision is not None else ""
        _write(worker.writer, [DECIDED, rid, [ep.address for ep in decision.targets], decision.body, line])

    def _drop(self, worker: _Worker) -> None:
        """A worker went away: end what it had here, so no queue entry or in-flight count stays."""
        for task in worker.deciding.values():
            task.cancel()
        for record in worker.records.values():
            record.error_code = "Cancelled"
            self.director.release(record)
        if worker.records:
            log.warning("a worker's connection closed: released its requests", extra={"requests": len(worker.records)})
        worker.deciding.clear()
        worker.records.clear()
