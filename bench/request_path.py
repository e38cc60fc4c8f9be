"""The request path's CPU per request, against the gRPC floor, without Envoy or pods.

    python -m bench.request_path                        # 10 and 100 endpoints, ~1 min
    python -m bench.request_path --endpoints 10 --profile 25

A server process runs either the EPP's ext_proc servicer over the default config (`build_core`,
as `epp serve` builds it, with metrics and the decision trace; the endpoints' metrics are
republished every 50 ms, as the scraper's board would) or `bench.grpc_floor`'s servicer, which
answers the same messages and does nothing else. A client process (this one) sends each request
as Envoy does on the shipped config (protocol config and ~10 headers, then the ~200-token body
in one message; then, as the observer filter, a streamed response on a stream of its own, or, as
the access log, a plain one's entry, batched every 20 ms) over C concurrent streams. The server's own CPU time (/proc) per request is the
figure; `÷ floor` is the EPP's over the floor's measured in the same run, alternating, so the
machine's other load mostly cancels. `--profile N` also runs the EPP server under cProfile and
prints its top N functions by own time (cProfile slows Python calls: use it for where, not how
much).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import pstats
import random
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from bench.common import MODEL, REPO, cpu_seconds, log, machine_load, start_process, stop_process

_Mode = processing_mode_pb2.ProcessingMode


# --------------------------------------------------------------------------- server


def _epp_servicer(endpoints: int) -> tuple[pb_grpc.ExternalProcessorServicer, object]:
    """The default config's request path over `endpoints` endpoints, and a function that
    republishes their metrics (fresh, slightly moved), as the scraper process's board does."""
    from epp.core import build_core
    from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
    from epp.extproc.server import ExternalProcessor
    from epp.observability.metrics import EppMetrics
    from epp.observability.trace import DecisionTrace

    rng = random.Random(3)
    datastore = Datastore()
    core = build_core(datastore, None, tick=0.05, metrics=EppMetrics(datastore), trace=DecisionTrace())
    pods = [datastore.upsert(EndpointSpec(f"pod-{i}", f"10.1.{i // 250}.{i % 250}", 8000)) for i in range(endpoints)]

    def publish() -> None:
        for ep in pods:
            ep.update_metrics(EndpointMetrics(
                waiting_queue_size=rng.randint(0, 2), running_requests=rng.randint(0, 20),
                kv_cache_usage=rng.random() * 0.6, models=frozenset({MODEL}), cache_block_size=16,
                cache_num_blocks=4096, update_time=datastore.clock()))

    publish()
    return ExternalProcessor(core.director), publish


async def _serve(kind: str, endpoints: int, port_file: Path, profile: Path | None) -> None:
    publish = None
    if kind == "epp":
        from epp.extproc.server import add_to_server

        servicer, publish = _epp_servicer(endpoints)
    else:
        from bench.grpc_floor import Floor

        servicer = Floor([f"10.1.0.{i}:8000" for i in range(endpoints)])
    server = grpc.aio.server()
    if kind == "epp":
        add_to_server(servicer, server)  # type: ignore[arg-type]
    else:
        from bench.grpc_floor import add_to_server as add_floor

        add_floor(servicer, server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    if kind == "epp":
        from epp.runner import tune_collector

        tune_collector()  # as `epp serve` does
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    profiler = cProfile.Profile() if profile is not None else None
    if profiler is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, profiler.enable)
    port_file.write_text(str(port))
    while not stop.is_set():
        if publish is not None:
            publish()
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except asyncio.TimeoutError:
            pass
    if profiler is not None and profile is not None:
        profiler.disable()
        profiler.dump_stats(str(profile))
    await server.stop(0)


# --------------------------------------------------------------------------- client


def _messages(rng: random.Random, count: int) -> list[tuple[pb.ProcessingRequest, pb.ProcessingRequest]]:
    """(headers, body) pairs as Envoy sends them on the shipped config."""
    from bench.cost import prompt_bodies

    config = pb.ProtocolConfiguration(request_body_mode=_Mode.FULL_DUPLEX_STREAMED, response_body_mode=_Mode.NONE)
    out = []
    for i, body in enumerate(prompt_bodies(rng, 200, count)):
        headers = [(":authority", "localhost:8081"), (":path", "/v1/completions"), (":method", "POST"),
                   (":scheme", "http"), ("user-agent", "bench"), ("content-type", "application/json"),
                   ("content-length", str(len(body))), ("accept", "*/*"), ("x-forwarded-proto", "http"),
                   ("x-request-id", f"5f0c{i:08d}-aaaa-bbbb-cccc-000000000000")]
        head = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers])),
            protocol_config=config)
        out.append((head, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))))
    return out


def _observed(token: str) -> list[pb.ProcessingRequest]:
    """What the shipped config's observer filter sends for a response: the request headers (with
    the pick's observe token), the response headers and its one body chunk (a stub completion
    with usage), in observability mode."""
    from bench.stubpods import COMPLETION
    from epp.api.headers import OBSERVE_TOKEN

    def headers(pairs: list[tuple[str, str]]) -> pb.HttpHeaders:
        return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]))

    return [
        pb.ProcessingRequest(observability_mode=True, request_headers=headers(
            [(":path", "/v1/completions"), (":method", "POST"), (OBSERVE_TOKEN, token)])),
        pb.ProcessingRequest(observability_mode=True, response_headers=headers(
            [(":status", "200"), ("content-type", "application/json"), ("content-length", str(len(COMPLETION)))])),
        pb.ProcessingRequest(observability_mode=True, response_body=pb.HttpBody(body=COMPLETION, end_of_stream=True)),
    ]


def _logged(token: str) -> object:
    """What the shipped config's access log sends for a plain response: an entry with the pick's
    token, the status, the size and the usage the Lua filter read off the body."""
    from envoy.data.accesslog.v3 import accesslog_pb2
    from google.protobuf import struct_pb2

    from bench.stubpods import COMPLETION
    from epp.api.headers import OBSERVE_TOKEN

    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_headers[OBSERVE_TOKEN] = token
    entry.response.response_code.value = 200
    entry.response.response_body_bytes = len(COMPLETION)
    usage = orjson.dumps(orjson.loads(COMPLETION)["usage"]).decode()
    entry.common_properties.metadata.filter_metadata["epp"].CopyFrom(
        struct_pb2.Struct(fields={"usage": struct_pb2.Value(string_value=usage)}))
    return entry


async def _drive(port: int, requests: list[tuple[pb.ProcessingRequest, pb.ProcessingRequest]],
                 concurrency: int) -> int:
    """Send every request once, as Envoy does on the shipped config: the picking stream, then
    (when the pick asked for it with an observe token) the observer stream with the response, or
    (marked for the access log) an entry on the access-log stream, batched every 20 ms.
    Returns how many got their destination."""
    from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

    from epp.api.headers import OBSERVE_TOKEN, OBSERVE_VIA

    done = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        queue = list(reversed(requests))
        log_call = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs()
        logged: list[object] = []
        writing = True

        async def flush() -> None:
            while writing or logged:
                await asyncio.sleep(0.02)
                if logged:
                    message = als_pb2.StreamAccessLogsMessage()
                    message.http_logs.log_entry.extend(logged)  # type: ignore[arg-type]
                    logged.clear()
                    await log_call.write(message)

        flusher = asyncio.create_task(flush())

        async def worker() -> None:
            nonlocal done
            while queue:
                head, body = queue.pop()
                call = stub.Process()
                await call.write(head)
                await call.write(body)
                token = ""
                via = False
                while True:
                    reply = await call.read()
                    if reply is grpc.aio.EOF:
                        break
                    kind = reply.WhichOneof("response")
                    if kind == "request_headers":
                        for option in reply.request_headers.response.header_mutation.set_headers:
                            if option.header.key == OBSERVE_TOKEN:
                                token = option.header.raw_value.decode()
                            elif option.header.key == OBSERVE_VIA:
                                via = True
                    elif kind == "request_body" and reply.request_body.response.body_mutation.streamed_response.end_of_stream:
                        done += 1
                        break
                # Envoy: the request goes upstream (the observer stream opens), the response comes
                # back (the observer reports it), then the HTTP stream, and with it the picking
                # stream, ends.
                if token and not via:
                    observer = stub.Process()
                    # The server ends an observer stream once it has what it needs (or when it has
                    # no pick to report to): writes after that fail, as Envoy's are dropped.
                    with contextlib.suppress(Exception):
                        for message in _observed(token):
                            await observer.write(message)
                        await observer.done_writing()
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        while await observer.read() is not grpc.aio.EOF:
                            pass
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:
                    pass
                if token and via:
                    logged.append(_logged(token))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        writing = False
        await flusher
        await log_call.done_writing()
        await log_call
    return done


async def in_process(endpoints: int, requests: list[tuple[pb.ProcessingRequest, pb.ProcessingRequest]],
                     rounds: int) -> list[float]:
    """CPU seconds per request of the EPP's own work: a `RequestStream` per request fed the same
    messages (parsed from their bytes, as gRPC hands them over), its replies serialised, the
    stream closed; no gRPC. One figure per round."""
    from epp.extproc import messages
    from epp.extproc.stream import RequestStream

    from epp.runner import tune_collector

    servicer, publish = _epp_servicer(endpoints)
    tune_collector()  # as `epp serve` does (this process is the bench's own)
    wire = [(head.SerializeToString(), body.SerializeToString()) for head, body in requests]
    parse = pb.ProcessingRequest.FromString
    director = servicer.director  # type: ignore[attr-defined]

    async def one_round() -> float:
        start = time.process_time()
        for i, (head, body) in enumerate(wire):
            if i % 25 == 0:
                publish()  # ~every 50 ms at 500 req/s, as the scraper's board would
            stream = RequestStream(director, 32 << 20)
            for message in (parse(head), parse(body)):
                for reply in await stream.handle(message):
                    messages.serialize(reply)
            stream.close()
        return (time.process_time() - start) / len(wire)

    await one_round()  # warm up
    return [await one_round() for _ in range(rounds)]


def _relative_paths(text: str) -> str:
    """A profile's file names without this machine's directories (the repository's, the
    interpreter's), so a committed report names no local path."""
    text = text.replace(str(REPO) + "/", "")
    text = re.sub(r"[^\s(]*/site-packages/", "", text)
    return re.sub(r"[^\s(]*/lib/python3\.\d+/", "", text)


class Server:
    def __init__(self, kind: str, endpoints: int, profile: Path | None = None) -> None:
        self.kind = kind
        self._dir = tempfile.TemporaryDirectory(prefix="bench-reqpath-")
        port_file = Path(self._dir.name) / "port"
        cmd = [sys.executable, "-m", "bench.request_path", "serve", kind, str(endpoints), str(port_file)]
        self.profile = profile
        if profile is not None:
            cmd.append(str(profile))
        self.proc = start_process(cmd, f"request-path-{kind}-{endpoints}")
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} server did not start")
            time.sleep(0.05)
        self.port = int(port_file.read_text())

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except Exception:
            pass
        stop_process(self.proc)
        self._dir.cleanup()


async def measure(endpoints: list[int], count: int, concurrency: int, rounds: int, profile_top: int,
                  keep: Path | None = None, in_process_only: bool = False) -> str:
    requests = _messages(random.Random(5), count)
    lines = [f"# The request path's CPU (`python -m bench.request_path`, {time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Server CPU per request: {count} requests per round over {concurrency} concurrent ext_proc streams, "
             f"{rounds} alternating rounds, no TLS, no Envoy; load average {machine_load()} at the start. "
             "`floor` is `bench.grpc_floor`'s servicer (answers, no work); `epp` the default config's request path.",
             "", "| endpoints | floor CPU/req | EPP CPU/req (each round) | EPP CPU/req | ÷ floor | EPP above floor |",
             "|---|---|---|---|---|---|"]
    profiles: list[str] = []
    inproc: list[str] = ["", "The EPP's own work in-process (no gRPC): each request's messages through a `RequestStream`, "
                         "replies serialised, CPU per request (each round).", "",
                         "| endpoints | CPU/req (each round) |", "|---|---|"]
    for n in endpoints:
        alone = await in_process(n, requests, rounds)
        inproc.append(f"| {n} | " + ", ".join(f"{x * 1e3:.3f} ms" for x in alone) + " |")
        log(f"  {n} endpoints, in-process: " + ", ".join(f"{x * 1e3:.3f}" for x in alone) + " ms/req")
        if in_process_only:
            continue
        servers = {"floor": Server("floor", n), "epp": Server("epp", n)}
        try:
            for server in servers.values():  # warm up: imports, first picks, the index
                await _drive(server.port, requests[:200], concurrency)
            spent: dict[str, list[float]] = {"floor": [], "epp": []}
            for _ in range(rounds):
                for kind, server in servers.items():
                    c0 = server.cpu()
                    done = await _drive(server.port, requests, concurrency)
                    spent[kind].append((server.cpu() - c0) / max(1, done))
                    log(f"  {n} endpoints, {kind}: {spent[kind][-1] * 1e3:.3f} ms/req ({done} requests)")
        finally:
            for server in servers.values():
                server.close()
        floor, epp = min(spent["floor"]), min(spent["epp"])
        rounds_text = ", ".join(f"{x * 1e3:.3f}" for x in spent["epp"])
        lines.append(f"| {n} | {floor * 1e3:.3f} ms | {rounds_text} | {epp * 1e3:.3f} ms | {epp / floor:.2f}× | "
                     f"{(epp - floor) * 1e3:.3f} ms |")
        if profile_top:
            with tempfile.TemporaryDirectory(prefix="bench-reqpath-prof-") as tmp:
                out = Path(tmp) / "epp.prof"
                server = Server("epp", n, profile=out)
                try:
                    await _drive(server.port, requests[:200], concurrency)
                    server.proc.send_signal(signal.SIGUSR1)
                    await asyncio.sleep(0.2)
                    await _drive(server.port, requests, concurrency)
                finally:
                    server.close()
                if keep is not None:
                    keep.with_suffix(f".{n}.prof").write_bytes(out.read_bytes())
                text = io.StringIO()
                pstats.Stats(str(out), stream=text).sort_stats("tottime").print_stats(profile_top)
                profiles += ["", f"## cProfile of the EPP server, {n} endpoints, {count} requests (own time)", "",
                             "```", _relative_paths(text.getvalue().strip().replace(str(out), out.name)), "```"]
    lines.append("")
    lines.append("CPU/req is the lowest round's (the least disturbed by other load); each round's is listed.")
    return "\n".join(lines + inproc + profiles) + "\n"


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "serve":
        import uvloop

        kind, endpoints, port_file = argv[1], int(argv[2]), Path(argv[3])
        uvloop.run(_serve(kind, endpoints, port_file, Path(argv[4]) if len(argv) > 4 else None))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoints", type=lambda s: [int(x) for x in s.split(",")], default=[10, 100])
    parser.add_argument("--requests", type=int, default=3000, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the EPP's top N functions")
    parser.add_argument("--in-process", action="store_true", help="only the in-process table (quick, no servers)")
    parser.add_argument("--out", default="", help="also write the report here (and the raw profiles next to it)")
    args = parser.parse_args(argv)
    report = asyncio.run(measure(args.endpoints, args.requests, args.concurrency, args.rounds, args.profile,
                                 Path(args.out) if args.out else None, args.in_process))
    if args.out:
        Path(args.out).write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
