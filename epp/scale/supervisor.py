"""`epp serve --workers N`: N request-path processes serving one gRPC port as one EPP.

The supervisor (the process `epp serve` started) validates the configuration and logs it once,
creates the pod's shared segment (`epp.scale.member`), and starts its members as fresh
interpreters (multiprocessing's spawn: no forked gRPC or event-loop state):

- N workers, each a full `EndpointPicker` (discovery, scraping, the request path) bound to the
  same ext_proc port with SO_REUSEPORT, so the kernel spreads the gateway's connections over
  them; they share in-flight counts, the ledger, the service model and the prefix index through
  the segment;
- with flow control configured, one dispatcher holding the pod's one set of queues
  (`epp.scale.dispatcher`), to which the workers hand their requests.

The supervisor serves what must be one per pod: gRPC health (ready once every member has started
and synced with the pool and, with leader election and no active-active replicas, the pod leads),
one /metrics adding up the members' (`epp.scale.merge`), the admin API, the leader election, and
the link to the other replicas (`--replicas-url`). A member that dies is cleared from the shared
table at once — the in-flight counts it held leave every other member's view — and started again
(with a growing delay while it keeps dying). Members exit when the supervisor goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from epp.admin.v1 import admin_pb2, admin_pb2_grpc
from epp.config.loader import load_config
from epp.config.options import Options
from epp.datastore import Datastore
from epp.observability.health import HealthServicer
from epp.scale import table as t
from epp.scale.member import PodLayout, PodRole, PodState
from epp.scale.merge import merge_expositions, merge_status
from grpc_health.v1 import health_pb2_grpc

log = logging.getLogger("epp.scale")

_MONITOR_PERIOD = 0.1  # seconds between looks at the members
_START_TIMEOUT = 120.0  # a member that has not started by then is restarted
_MAX_BACKOFF = 30.0
_HUNG_AFTER = 30.0  # seconds without a heartbeat (a member beats every scrape tick): killed, restarted


@dataclass(slots=True, frozen=True)
class MemberSpec:
    """What a member process is started with (pickled by multiprocessing's spawn)."""

    options: Options
    role: PodRole
    supervisor_pid: int


def member_main(spec: MemberSpec) -> None:
    """The entry point of a member process."""
    from epp.cli import _run_async
    from epp.observability.logging import setup_logging

    setup_logging(spec.options.v)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; a terminal's ^C reaches all
    _run_async(_run_member(spec))


async def _run_member(spec: MemberSpec) -> None:
    from epp.runner import EndpointPicker, tune_collector

    picker = EndpointPicker(spec.options, role=spec.role)
    await picker.start()
    tune_collector()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    while not stop.is_set():  # exit with the supervisor, never linger holding the port
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await stop.wait()
        if os.getppid() != spec.supervisor_pid:
            log.warning("supervisor gone: member %d exits", spec.role.member)
            break
    await picker.stop(grace=5.0)


@dataclass(slots=True)
class _Child:
    member: int
    name: str  # "worker-0", "dispatcher"
    spec: MemberSpec
    process: Any = None  # multiprocessing.Process
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0  # monotonic time of the next attempt (after a death)


class Supervisor:
    def __init__(self, options: Options, workers: int) -> None:
        self.options = options
        self.workers = workers
        from epp.runner import config_text

        loaded = load_config(config_text(options), Datastore())  # invalid: ConfigError, before anything starts
        self._log_config(loaded)
        self.config = loaded
        self._check_kv_events(loaded)
        self.flow_control = loaded.flow_control_config is not None
        self.layout, self._segment = PodLayout.create(workers, dispatcher=self.flow_control,
                                                      replica_link=bool(options.replicas_url))
        self.state = PodState(self.layout, self._segment)
        self._dir = Path(tempfile.mkdtemp(prefix="epp-pod-"))
        self._reserved: socket.socket | None = None
        self.grpc_port = options.grpc_port or self._reserve_port()
        socket_path = str(self._dir / "dispatch.sock") if self.flow_control else ""
        member_options = replace(options, workers=1, ha_enable_leader_election=False)
        if options.secure_serving and not options.cert_path:  # one self-signed certificate for the pod
            member_options = replace(member_options, cert_path=self._self_signed())
        self._member_options = member_options
        self._socket_path = socket_path
        self.children: list[_Child] = []  # made in `start`, once the pod's scraper has its board
        self.discovery: Any = None
        self.scraper: Any = None  # the pod's one scraper process, whose board every member reads
        self._ctx = multiprocessing.get_context("spawn")
        self.registry = CollectorRegistry(auto_describe=True)
        self._alive = Gauge("inference_extension_pod_members", "Processes of this EPP pod by role and state "
                            "(ready: started and synced with the pool).", ["role", "state"], registry=self.registry)
        self._picks = Gauge("inference_extension_pod_member_picks", "Requests each member of this EPP pod "
                            "scheduled (or handed to the dispatcher) since it started: how evenly the gateway's "
                            "connections spread over the workers.", ["member"], registry=self.registry)
        self._pids = Gauge("inference_extension_pod_member_pid", "Process id of each member of this EPP pod "
                           "(0 while it is down), to match its logs.", ["member"], registry=self.registry)
        self._restarts = Counter("inference_extension_pod_member_restarts", "Member processes of this EPP pod "
                                 "started again after they died.", ["role"], registry=self.registry)
        self.leader: Any = None
        self.replicas: Any = None
        self._health: grpc.aio.Server | None = None
        self._admin: grpc.aio.Server | None = None
        self._metrics: web.AppRunner | None = None
        self._monitor: asyncio.Task[None] | None = None
        self.health_port = 0
        self.metrics_port = 0
        self.admin_port = 0

    @staticmethod
    def _check_kv_events(loaded: Any) -> None:
        """Every worker subscribes to the pods' KV events itself (the precise index needs nothing
        shared); a central socket that the pods connect to can be bound by one process only."""
        from epp.params import ConfigError
        from epp.scheduling.plugins.precise_prefix_cache_producer import PrecisePrefixCacheProducer

        for plugin in loaded.plugins.values():
            if isinstance(plugin, PrecisePrefixCacheProducer) and plugin.config.events.zmq_endpoint:
                raise ConfigError(
                    f"{plugin.name}: kvEventsConfig.zmqEndpoint binds one socket, which several workers "
                    "cannot share: use discoverPods (every worker subscribes to every pod) or --workers 1")

    @staticmethod
    def _log_config(loaded: Any) -> None:
        for warning in loaded.warnings:
            log.warning("config: %s", warning, extra={"config_warning": warning})
        if log.isEnabledFor(logging.INFO):
            log.info("effective configuration", extra={"effective_config": loaded.effective()})

    def _self_signed(self) -> str:
        from epp.extproc.tls import self_signed

        cert, key = self_signed()
        (self._dir / "tls.crt").write_bytes(cert)
        key_path = self._dir / "tls.key"
        key_path.touch(mode=0o600)
        key_path.write_bytes(key)
        return str(self._dir)

    def _reserve_port(self) -> int:
        """A free port the workers can all bind (held here, not listening, until the end)."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.options.bind_address else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.options.bind_address, 0))
        self._reserved = sock
        return sock.getsockname()[1]

    # -- lifecycle --

    async def start(self) -> None:
        board = await self._start_scraper()
        pid, options, socket_path = os.getpid(), self._member_options, self._socket_path
        directory = str(self._dir)
        self.children = [_Child(m, f"worker-{m}", MemberSpec(options, PodRole(
            self.layout, m, False, socket_path, self.grpc_port, board, directory), pid)) for m in range(self.workers)]
        if self.flow_control:
            m = self.layout.dispatcher_member
            self.children.append(_Child(m, "dispatcher", MemberSpec(options, PodRole(
                self.layout, m, True, socket_path, self.grpc_port, board, directory), pid)))
        log.info("starting the pod's processes", extra={"workers": self.workers, "dispatcher": self.flow_control,
                                                        "grpc_port": self.grpc_port, "shared_scraper": bool(board),
                                                        "replicas": bool(self.options.replicas_url)})
        for child in self.children:
            self._spawn(child)
        o = self.options
        health = HealthServicer(self.ready)
        self._health = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, self._health)
        self.health_port = self._health.add_insecure_port(f"{o.bind_address}:{o.grpc_health_port}")
        await self._health.start()
        token = Path(o.metrics_bearer_token_file).read_text().strip() if o.metrics_bearer_token_file else ""
        self._metrics = await self._start_metrics(o.bind_address, o.metrics_port, token)
        self.metrics_port = self._metrics.addresses[0][1]
        if o.admin_port >= 0:
            self._admin = grpc.aio.server()
            admin_pb2_grpc.add_AdminServicer_to_server(_PodAdmin(self), self._admin)
            self.admin_port = self._admin.add_insecure_port(f"{o.admin_bind_address}:{o.admin_port}")
            await self._admin.start()
        if o.ha_enable_leader_election:
            from epp.discovery.leader import leader_elector

            self.leader = leader_elector(
                pool_namespace=o.pool_namespace, pool_name=o.pool_name, kubeconfig=o.kubeconfig,
                lease_duration=o.ha_lease_duration, renew_deadline=o.ha_renew_deadline,
                retry_period=o.ha_retry_period)
            await self.leader.start()
            if o.replicas_url:
                log.info("active-active replicas: readiness does not wait for leadership (the lease is still held)")
        if o.replicas_url:
            from epp.scale.replicas import ReplicaLink, replica_settings

            self.replicas = ReplicaLink(self.state, replica_settings(o), time.monotonic,
                                        registry=self.registry)
            await self.replicas.start()
        self._monitor = asyncio.get_running_loop().create_task(self._watch(), name="pod-supervisor")

    async def _start_scraper(self) -> str:
        """The pod's scraper process over the supervisor's own discovery of the pool; returns its
        board's name ("" when the members scrape themselves: no data source, --scrape-in-process)."""
        o, config = self.options, self.config
        if config.data_source is None or o.scrape_in_process:
            return ""
        from epp.datalayer.scrape_process import ScraperProcess
        from epp.runner import discovery_from_options, max_scrape_interval

        datastore = Datastore()
        self.discovery = discovery_from_options(o)
        await self.discovery.start(datastore)
        interval = o.refresh_metrics_interval
        self.scraper = ScraperProcess(datastore, config.data_source, config.extractor, interval=interval,
                                      max_interval=max_scrape_interval(o, config), log_level=o.v)
        await self.scraper.start()
        assert self.scraper.board is not None
        log.info("the pod's scraper process serves every member", extra={"board": self.scraper.board.name,
                                                                         "interval": interval})
        return self.scraper.board.name

    async def wait_ready(self, timeout: float = _START_TIMEOUT) -> None:
        """Until every member has started (tests, benchmarks); raises TimeoutError."""
        async with asyncio.timeout(timeout):
            while not all(self.state.table.status(c.member, t.STARTED) for c in self.children):
                await asyncio.sleep(0.05)

    async def stop(self, grace: float = 5.0) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        if self.leader is not None:
            await self.leader.stop()
        self.state.table.pod_ready = False
        for child in self.children:  # workers drain their streams and the dispatcher its queues
            if child.process is not None and child.process.is_alive():
                child.process.terminate()
        deadline = time.monotonic() + grace + 5.0
        for child in self.children:
            if child.process is None:
                continue
            await asyncio.get_running_loop().run_in_executor(None, child.process.join,
                                                              max(0.0, deadline - time.monotonic()))
            if child.process.is_alive():
                child.process.kill()
                child.process.join()
        if self.replicas is not None:
            await self.replicas.stop()
        if self.scraper is not None:
            await self.scraper.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        for server in (self._health, self._admin):
            if server is not None:
                await server.stop(0)
        if self._metrics is not None:
            await self._metrics.cleanup()
        self.state.close()
        self._segment.close()
        if self._reserved is not None:
            self._reserved.close()
        for leftover in self._dir.iterdir():
            leftover.unlink(missing_ok=True)
        self._dir.rmdir()

    # -- members --

    def _spawn(self, child: _Child) -> None:
        table = self.state.table
        table.set_status(child.member, t.STARTED, 0)
        table.set_status(child.member, t.SYNCED, 0)
        process = self._ctx.Process(target=member_main, args=(child.spec,), name=f"epp-{child.name}", daemon=True)
        process.start()
        child.process = process
        child.started_at = time.monotonic()
        log.info("member started", extra={"member": child.name, "pid": process.pid})

    def _member_ready(self, child: _Child) -> bool:
        table = self.state.table
        return (child.process is not None and child.process.is_alive()
                and bool(table.status(child.member, t.STARTED)) and bool(table.status(child.member, t.SYNCED)))

    def ready(self) -> bool:
        if not all(self._member_ready(c) for c in self.children):
            return False
        if self.leader is not None and not self.options.replicas_url:
            return bool(self.leader.is_leader)
        return True

    async def _watch(self) -> None:
        table = self.state.table
        while True:
            now = time.monotonic()
            for child in self.children:
                process = child.process
                if process is not None and not process.is_alive():
                    child.restarts += 1
                    backoff = min(_MAX_BACKOFF, 0.5 * 2 ** min(child.restarts - 1, 6))
                    if now - child.started_at > 60.0:  # it ran a good while: not a crash loop
                        backoff = 0.5
                    log.error("member died: its in-flight requests are released from the pod's view; restarting",
                              extra={"member": child.name, "exit_code": process.exitcode, "restart_in_s": backoff})
                    table.clear_member(child.member)
                    process.close()
                    child.process = None
                    child.next_start = now + backoff
                    self._restarts.labels(child.name.split("-")[0]).inc()
                elif process is None and now >= child.next_start:
                    self._spawn(child)
                elif (process is not None and not table.status(child.member, t.STARTED)
                      and now - child.started_at > _START_TIMEOUT):
                    log.error("member did not start in time; restarting", extra={"member": child.name})
                    process.kill()
                elif process is not None and table.status(child.member, t.STARTED) and \
                        time.time() * 1000 - table.status(child.member, t.HEARTBEAT_MS) > _HUNG_AFTER * 1000:
                    log.error("member stopped beating (its event loop is stuck); restarting",
                              extra={"member": child.name})
                    process.kill()
            table.pod_ready = self.ready()
            self._alive.clear()
            for child in self.children:
                state = "ready" if self._member_ready(child) else (
                    "starting" if child.process is not None and child.process.is_alive() else "down")
                self._alive.labels(child.name.split("-")[0], state).inc()
                self._picks.labels(child.name).set(table.status(child.member, t.PICKS))
                alive = child.process is not None and child.process.is_alive()
                self._pids.labels(child.name).set(child.process.pid if alive else 0)
            await asyncio.sleep(_MONITOR_PERIOD)

    def member_ports(self, word: int) -> list[int]:
        table = self.state.table
        return [table.status(c.member, word) for c in self.children if self._member_ready(c)
                and table.status(c.member, word)]

    # -- the pod's /metrics --

    async def _start_metrics(self, host: str, port: int, token: str) -> web.AppRunner:
        expected = f"Bearer {token}".encode() if token else b""
        session: dict[str, aiohttp.ClientSession] = {}

        async def fetch(member_port: int) -> str:
            async with session["s"].get(f"http://127.0.0.1:{member_port}/metrics") as response:
                return await response.text()

        async def handle_metrics(request: web.Request) -> web.Response:
            if expected and not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
                return web.Response(status=401, text="unauthorized\n", headers={"WWW-Authenticate": "Bearer"})
            if "s" not in session:
                session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
            texts = await asyncio.gather(*(fetch(p) for p in self.member_ports(t.METRICS_PORT)),
                                         return_exceptions=True)
            own = generate_latest(self.registry).decode()
            body = merge_expositions([own, *(x for x in texts if isinstance(x, str))])
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def handle_healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok\n")

        async def close_session(_: web.Application) -> None:
            if "s" in session:
                await session["s"].close()

        app = web.Application()
        app.router.add_get("/metrics", handle_metrics)
        app.router.add_get("/healthz", handle_healthz)
        app.on_cleanup.append(close_session)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        return runner


class _PodAdmin(admin_pb2_grpc.AdminServicer):
    """The pod's admin status: its members' merged (`merge.merge_status`)."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    async def GetStatus(self, request: admin_pb2.GetStatusRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> admin_pb2.Status:
        decisions = min(request.decisions, 1000)

        async def one(port: int) -> admin_pb2.Status:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await admin_pb2_grpc.AdminStub(channel).GetStatus(
                    admin_pb2.GetStatusRequest(decisions=decisions), timeout=5)

        got = await asyncio.gather(*(one(p) for p in self.supervisor.member_ports(t.ADMIN_PORT)),
                                   return_exceptions=True)
        statuses = [s for s in got if isinstance(s, admin_pb2.Status)]
        return merge_status(statuses, ready=self.supervisor.ready(), decisions=decisions)


async def serve_pod(options: Options, workers: int) -> None:
    """`epp serve` with `workers` > 1, until SIGINT/SIGTERM."""
    supervisor = Supervisor(options, workers)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await supervisor.start()
    await stop.wait()
    log.info("shutting down the pod")
    await supervisor.stop(grace=5.0)
