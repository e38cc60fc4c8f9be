"""The composition root: builds a running EPP from `Options` and tears it down cleanly.

Tests and the demo use `EndpointPicker` in-process (ports may be 0 to pick free ones); `epp serve`
runs one until SIGINT/SIGTERM — or, with `--workers N` > 1, a supervisor (`epp.scale.supervisor`)
runs N of them as request-path workers sharing the gRPC port and one view of the pool, each an
`EndpointPicker` with a `PodRole`: its health, metrics and admin servers are then internal and
the supervisor serves the pod's.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from aiohttp import web

from epp.config.defaults import PRESETS
from epp.config.loader import LoadedConfig
from epp.config.options import Options, available_cpus
from epp.core import build_core
from epp.datalayer.kv_subscriber import KVEventSubscriber
from epp.datalayer.scrape_process import ScraperProcess
from epp.datalayer.scraper import MetricsScraper
from epp.datalayer.token_producer import TokenProducer
from epp.datastore import Datastore
from epp.discovery.base import Discovery
from epp.discovery.static import StaticDiscovery, parse_endpoint_list
from epp.extproc.server import ExternalProcessor, ResponseReports, add_to_server
from epp.extproc.tls import server_credentials
from epp.flowcontrol.objectives import load_objectives_file
from epp.observability.admin import AdminServicer, QueueInfo, StatusSources
from epp.observability.admin import add_to_server as add_admin_to_server
from epp.observability.health import HealthServicer
from epp.observability.labels import LabelLimits
from epp.observability.metrics import EppMetrics
from epp.observability.server import start_metrics_server
from epp.observability.trace import DecisionTrace
from grpc_health.v1 import health_pb2_grpc

if TYPE_CHECKING:
    from epp.discovery.leader import LeaderElector
    from epp.scale.member import Member, PodRole, PodState
    from epp.scale.board_reader import BoardReader
    from epp.scale.observe import Relay
    from epp.scale.dispatcher import DispatchServer, RemoteDirector
    from epp.scale.replicas import ReplicaLink
    from epp.shm import Segment

log = logging.getLogger("epp")

# A request allocates a few hundred container objects (messages, the cycle state, the ledger
# entry), so with CPython's default of 700 the young generation was collected every other
# request, each pass also walking the survivors; 20,000 keeps a short-lived request's garbage
# from ever being traced (measured: ~0.1 ms of 1 ms per request at 10 endpoints).
GC_YOUNG_THRESHOLD = 20_000


def tune_collector() -> None:
    """For a process that serves the request path (`epp serve`, each worker), once it is built:
    everything allocated so far (modules, config, plugins) is moved out of the collector's sight
    (`gc.freeze`), and the young generation is collected less often. Not for a shared process
    (tests, the simulator): the setting is process-wide."""
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)
    log.info("garbage collector tuned for serving", extra={"gc_threshold": gc.get_threshold(),
                                                           "gc_frozen": gc.get_freeze_count()})


def max_scrape_interval(options: Options, config: LoadedConfig) -> float:
    """How far an endpoint whose metrics do not move may back off: half the shortest staleness
    threshold a plugin applies (so backing off never makes a pod look stale), at most four
    intervals."""
    interval = options.refresh_metrics_interval
    thresholds = [float(t) for p in config.plugins.values()
                  if isinstance(t := getattr(p, "metrics_staleness_threshold", None), (int, float))]
    detector = config.saturation_detector
    if isinstance(t := getattr(detector, "metrics_staleness_threshold", None), (int, float)):
        thresholds.append(float(t))
    return max(interval, min([4 * interval, *(t / 2 for t in thresholds)]))


def discovery_from_options(options: Options) -> Discovery:
    if options.static_endpoints or options.static_endpoints_file:
        specs = parse_endpoint_list(options.static_endpoints, where="--static-endpoints")
        return StaticDiscovery(specs, path=options.static_endpoints_file, pool_name=options.pool_name or "static")
    if options.pool_name and options.endpoint_selector:
        raise SystemExit("error: --pool-name and --endpoint-selector are mutually exclusive")
    if options.pool_name or options.endpoint_selector:
        from epp.discovery.kubernetes import kubernetes_discovery  # the client loads only when used

        return kubernetes_discovery(
            pool_name=options.pool_name, pool_namespace=options.pool_namespace, pool_group=options.pool_group,
            kubeconfig=options.kubeconfig, endpoint_selector=options.endpoint_selector,
            endpoint_target_ports=options.endpoint_target_ports)
    raise SystemExit("error: no endpoint source: give --pool-name, --endpoint-selector, --static-endpoints "
                     "or --static-endpoints-file")


def config_text(options: Options) -> str | None:
    if options.config_file:
        return Path(options.config_file).read_text()
    if options.config_preset:
        return PRESETS[options.config_preset]
    return options.config_text or None


class EndpointPicker:
    def __init__(self, options: Options, discovery: Discovery | None = None, datastore: Datastore | None = None,
                 role: PodRole | None = None) -> None:
        self.options = options
        self.role = role
        self.datastore = datastore or Datastore()
        self.datastore.pool.name = options.pool_name
        self.datastore.pool.namespace = options.pool_namespace
        self.discovery = discovery or discovery_from_options(options)
        self.metrics = EppMetrics(
            self.datastore, staleness=options.metrics_staleness_threshold,
            known_models=[n.strip() for n in options.metrics_model_names.split(",") if n.strip()],
            limits=LabelLimits(series=max(1, options.metrics_max_series)))
        if options.objectives_file:
            load_objectives_file(options.objectives_file, self.datastore, pool_name=options.pool_name)
        self.trace = DecisionTrace()
        core = build_core(self.datastore, config_text(options), tick=options.refresh_metrics_interval,
                          metrics=self.metrics, trace=self.trace,
                          subset_filter=not options.disable_endpoint_subset_filter)
        self.config: LoadedConfig = core.config
        self.core = core
        self.kv_subscribers: list[KVEventSubscriber] = []
        self.admission = core.admission
        self.director = core.director
        self.state: PodState | None = None
        self.member: Member | None = None
        self.replicas: ReplicaLink | None = None
        self.remote: RemoteDirector | None = None  # a worker handing its requests to the dispatcher
        self._own_segment: Segment | None = None  # a single-process replica's own shared state
        self._share_state(options, role)
        self.extproc = ExternalProcessor(self.remote or self.director,
                                         max_body_bytes=options.max_request_body_bytes,
                                         debug_header=options.debug_decision_header)
        self.metrics.registry.register(ResponseReports(self.extproc))
        self.scraper: MetricsScraper | ScraperProcess | BoardReader | None = None
        self.relay: Relay | None = None  # a pod's worker: observer streams for the other workers' picks
        self.leader: LeaderElector | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._admin: grpc.aio.Server | None = None
        self._dispatch: DispatchServer | None = None
        self.grpc_port = 0
        self.health_port = 0
        self.metrics_port = 0
        self.admin_port = 0

    def _share_state(self, options: Options, role: PodRole | None) -> None:
        """With several workers or replicas: hook the core into the pod's shared state. A worker
        of a pod with flow control talks to the dispatcher, which holds the pod's one set of
        queues, through `self.remote`."""
        if role is None and not options.replicas_url:
            return  # one process, one replica: exactly as ever
        from epp.scale.member import Member, PodLayout, PodState

        if role is None:  # one process with replicas: a pod of one worker and the replica link
            layout, self._own_segment = PodLayout.create(1, replica_link=True)
            self.state = PodState(layout, self._own_segment)
            member = 0
        else:
            self.state = PodState(role.layout)
            member = role.member
        self.member = Member(self.state, member, self.core)
        self.member.install()
        self.metrics.registry.register(self.member)
        if role is not None and role.dispatch_socket and not role.dispatcher:
            from epp.scale.dispatcher import RemoteDirector

            self.remote = RemoteDirector(self.director, role.dispatch_socket, counted=self.member.count_pick)

    def _queues(self) -> list[QueueInfo]:
        """Flow-control queues per band and flow (band rows carry the oldest request's age)."""
        controller = getattr(self.admission, "controller", None)
        if controller is None:
            return []
        now = self.datastore.clock()
        rows: list[QueueInfo] = []
        for band in controller.bands():
            oldest = band.arrivals.peek()
            rows.append(QueueInfo(band.priority, "*", band.count, band.bytes,
                                  now - oldest.enqueue_time if oldest is not None else 0.0))
            rows += [QueueInfo(band.priority, flow.id, flow.queued, flow.bytes, 0.0)
                     for flow in band.flows.values() if flow.queued]
        return rows

    def ready(self) -> bool:
        """Synced with the pool and, with leader election, the leader (gie-epp §1.9). Active-active
        replicas (`--replicas-url`) are ready without leading; a worker of a multi-process pod
        answers what its supervisor decided for the pod."""
        if self.role is not None and self.member is not None:
            return self.member.pod_ready
        leading = self.leader is None or self.leader.is_leader or bool(self.options.replicas_url)
        return self.datastore.synced and leading

    def log_config(self) -> None:
        """Nothing about the config is silent: its warnings, then (at -v=2, the default level)
        the effective configuration with every default that was injected."""
        for warning in self.config.warnings:
            log.warning("config: %s", warning, extra={"config_warning": warning})
        if log.isEnabledFor(logging.INFO):
            log.info("effective configuration", extra={"effective_config": self.config.effective()})

    async def start(self) -> None:
        o = self.options
        role = self.role
        if role is None:
            self.log_config()  # a pod's supervisor logs it once for all its workers
        await self.discovery.start(self.datastore)
        if o.ha_enable_leader_election and role is None:  # a pod elects once, in its supervisor
            from epp.discovery.leader import leader_elector

            self.leader = leader_elector(
                pool_namespace=o.pool_namespace, pool_name=o.pool_name, kubeconfig=o.kubeconfig,
                lease_duration=o.ha_lease_duration, renew_deadline=o.ha_renew_deadline,
                retry_period=o.ha_retry_period)
            await self.leader.start()
        if self.config.data_source is not None:
            await self._start_scraper()
        hands_off = role is not None and bool(role.dispatch_socket) and not role.dispatcher
        if not hands_off:  # a worker that hands its requests to the dispatcher queues nothing itself
            await self.admission.start()
        await self._start_kv_events()

        health = HealthServicer(self.ready)
        internal = "127.0.0.1"  # a pod's workers: health, metrics and admin are the supervisor's to serve
        if role is not None and role.dispatcher:
            from epp.scale.dispatcher import DispatchServer

            self._dispatch = DispatchServer(self.director, role.dispatch_socket,
                                            max_body_bytes=o.max_request_body_bytes,
                                            debug_header=o.debug_decision_header)
            await self._dispatch.start()
        else:
            if role is not None and role.directory:  # observer streams may land on any worker
                from epp.scale.observe import MemberHandoff, Relay

                self.relay = Relay(role.directory, role.member)
                self.extproc.handoff = MemberHandoff(role.member, self.relay)
                if self.member is not None:
                    self.member.relay = self.relay
                await self.relay.start(self.extproc.handoff, self.extproc.access_log.relayed)
            reuse = 1 if role is not None else 0
            self._grpc = grpc.aio.server(options=[("grpc.so_reuseport", reuse)])
            add_to_server(self.extproc, self._grpc)
            if o.health_checking:
                health_pb2_grpc.add_HealthServicer_to_server(health, self._grpc)
            address = f"{o.bind_address}:{role.grpc_port if role is not None else o.grpc_port}"
            if o.secure_serving:
                self.grpc_port = self._grpc.add_secure_port(address, server_credentials(o.cert_path,
                                                                                        o.enable_cert_reload))
            else:
                self.grpc_port = self._grpc.add_insecure_port(address)
            await self._grpc.start()

        if role is None:
            self._health = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(health, self._health)
            self.health_port = self._health.add_insecure_port(f"{o.bind_address}:{o.grpc_health_port}")
            await self._health.start()

        token = Path(o.metrics_bearer_token_file).read_text().strip() if o.metrics_bearer_token_file else ""
        if role is not None:
            self._metrics_runner = await start_metrics_server(self.metrics, internal, 0)
        else:
            self._metrics_runner = await start_metrics_server(self.metrics, o.bind_address, o.metrics_port, token)
        self.metrics_port = self._metrics_runner.addresses[0][1]

        if o.admin_port >= 0 or role is not None:
            detector = self.config.saturation_detector
            sources = StatusSources(
                datastore=self.datastore, ready=self.ready, trace=self.trace, queues=self._queues,
                saturation=lambda: detector.saturation(list(self.datastore.endpoints())),
                flow_control_enabled=self.config.flow_control_config is not None,
            )
            self._admin = grpc.aio.server()
            add_admin_to_server(AdminServicer(sources), self._admin)
            admin_address = f"{internal}:0" if role is not None else f"{o.admin_bind_address}:{o.admin_port}"
            self.admin_port = self._admin.add_insecure_port(admin_address)
            await self._admin.start()
        if self.member is not None:
            self.member.set_started(self.metrics_port, self.admin_port)
            await self.member.start(min(o.refresh_metrics_interval, 1.0))
        if o.replicas_url and role is None:  # one process: it is its own link to the other replicas
            await self._start_replicas()
        log.info("endpoint picker started", extra={"grpc_port": self.grpc_port, "health_port": self.health_port,
                                                   "metrics_port": self.metrics_port, "admin_port": self.admin_port,
                                                   "secure": o.secure_serving, "member": role.member if role else -1,
                                                   "endpoints": len(self.datastore.endpoints())})

    async def _start_replicas(self) -> None:
        from epp.scale.replicas import ReplicaLink, replica_settings

        assert self.state is not None
        self.replicas = ReplicaLink(self.state, replica_settings(self.options), self.datastore.clock,
                                    registry=self.metrics.registry)
        await self.replicas.start()

    async def _start_scraper(self) -> None:
        o = self.options
        assert self.config.data_source is not None
        interval, max_interval = o.refresh_metrics_interval, max_scrape_interval(o, self.config)
        if self.role is not None and self.role.board:  # a pod's member: its supervisor scrapes
            from epp.scale.board_reader import BoardReader

            self.scraper = BoardReader(self.datastore, self.role.board)
            self.extproc.refresh = self.scraper.sync
            await self.scraper.start()
            self.metrics.set_scrape_stats_source(self.scraper.all_stats)
            return
        if o.scrape_in_process:
            self.scraper = MetricsScraper(self.datastore, self.config.data_source, self.config.extractor,
                                          interval=interval, max_interval=max_interval)
        else:
            self.scraper = ScraperProcess(self.datastore, self.config.data_source, self.config.extractor,
                                          interval=interval, max_interval=max_interval, log_level=o.v)
            self.extproc.refresh = self.scraper.sync  # the freshest metrics for every pick
        log.info("scraping model servers every %gs, backing off to %gs for endpoints whose metrics do not move",
                 interval, max_interval, extra={"scraper": "in-process" if o.scrape_in_process else "process",
                                                "interval": interval, "max_interval": max_interval})
        await self.scraper.start()
        self.metrics.set_scrape_stats_source(self.scraper.all_stats)

    async def _start_kv_events(self) -> None:
        """One KV-event subscriber per precise prefix producer, writing into its index."""
        metrics = self.core.precise_metrics
        for producer in self.core.precise_producers:
            subscriber = KVEventSubscriber(producer.index, self.datastore, producer.config.events)
            await subscriber.start()
            self.kv_subscribers.append(subscriber)
            if metrics is not None:
                metrics.subscribers.append(subscriber)
        if metrics is not None:
            metrics.token_producers.extend(p for p in self.config.plugins.values() if isinstance(p, TokenProducer))

    async def stop(self, grace: float = 1.0) -> None:
        if self.leader:  # first: a standby can take over while this replica drains
            await self.leader.stop()
        if self._grpc:
            await self._grpc.stop(grace)
        if self._dispatch is not None:
            await self._dispatch.stop(grace)
        self.extproc.close()
        if self.relay is not None:
            self.relay.close()
        await self.admission.stop()  # after the grace period, in which queued requests may still go
        if self._dispatch is not None:
            await self._dispatch.close()
        if self._health:
            await self._health.stop(0)
        if self._admin:
            await self._admin.stop(0)
        if self._metrics_runner:
            await self._metrics_runner.cleanup()
        if self.scraper:
            await self.scraper.stop()
        for subscriber in self.kv_subscribers:
            await subscriber.stop()
        for plugin in self.config.plugins.values():
            if isinstance(plugin, TokenProducer):
                await plugin.close()
        if self.replicas is not None:
            await self.replicas.stop()
        if self.member is not None:
            await self.member.stop()
        if self.remote is not None:
            await self.remote.close()
        await self.discovery.stop()
        if self.state is not None:
            self.state.close()
        if self._own_segment is not None:
            self._own_segment.close()


async def serve(options: Options) -> None:
    workers = options.workers or available_cpus()
    if workers > 1:
        from epp.scale.supervisor import serve_pod

        await serve_pod(options, workers)
        return
    log.info("serving in one process", extra={"workers": 1})
    picker = EndpointPicker(options)
    await picker.start()
    tune_collector()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await picker.stop(grace=5.0)
