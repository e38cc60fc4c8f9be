"""The EPP's own Prometheus metrics, with the reference's names, types and labels (gie-epp §7).

Everything lives in one `CollectorRegistry` per EPP instance (no process-global registry), so
tests and the in-process simulator can run several EPPs side by side. Pool gauges are computed
when Prometheus scrapes, from the datastore, so they are never older than the scrape.

Label values a client or a pod controls (model names, fairness ids, priorities, pod names) are
bounded by `labels.LabelGuard`: a model keeps its name only if the pool serves it, everything
else is counted under `other`, and every family has a budget of series. The exposition is built
off the event loop (`server`), and these bounds are what keep building it cheap.

Thread safety: the exposition runs in another thread than the updates. prometheus_client's
metrics lock themselves; the collectors here only read immutable snapshots (the datastore's
endpoint tuple, each endpoint's frozen `EndpointMetrics`, a copy of the scraper's table).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from epp import __version__
from epp.api.request import InferenceRequest
from epp.api.response import Usage
from epp.datastore import Datastore, Endpoint
from epp.observability.labels import BoundedFamily, Kind, KnownModels, LabelGuard, LabelLimits
from epp.observability.latency_metrics import LatencyMetrics
from epp.plugin import Plugin

if TYPE_CHECKING:
    from epp.datalayer.scraper import ScrapeStats


_DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20,
                     30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
_SIZE_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288,
                 1048576, 2097152, 4194304, 8388608, 16777216, 33554432, 67108864, 134217728, 268435456,
                 536870912, 1073741824)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
                  262144, 524288, 1048576)
_NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5,
                  0.6, 0.8, 1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 12.0, 18.0, 24.0, 30.0, 36.0, 48.0, 60.0)
_SCHEDULER_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                  60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_CYCLE_BUCKETS = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_FLOW_QUEUE_LABELS = ["fairness_id", "priority", "inference_pool", "model_name", "target_model_name"]


class SaturationCollector(Collector):
    """`inference_extension_flow_control_pool_saturation`: the saturation detector's pool value,
    computed when Prometheus scrapes (with or without flow control: the legacy admission sheds
    sheddable requests on the same number)."""

    def __init__(self, datastore: Datastore) -> None:
        self.datastore = datastore
        self.source: Callable[[], float] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.source is None:
            return
        family = GaugeMetricFamily("inference_extension_flow_control_pool_saturation",
                                   "Saturation of the inference pool as the saturation detector sees it (>= 1 is saturated).",
                                   labels=["inference_pool"])
        family.add_metric([self.datastore.pool.name or "default"], float(self.source()))
        yield family


class PoolCollector(Collector):
    """`inference_pool_*` gauges over endpoints whose metrics are valid and fresher than `staleness`
    (an endpoint reporting garbage is left out at once, a silent one once its metrics age)."""

    def __init__(self, datastore: Datastore, staleness: float) -> None:
        self.datastore = datastore
        self.staleness = staleness

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pool = self.datastore.pool.name or "default"
        now = self.datastore.clock()
        fresh = [ep for ep in self.datastore.endpoints()
                 if ep.metrics_valid and ep.metrics.update_time > 0 and now - ep.metrics.update_time <= self.staleness]
        n = len(fresh)

        def average(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["name"])
            family.add_metric([pool], value)
            return family

        yield average("inference_pool_average_kv_cache_utilization",
                      "The average kv cache utilization for an inference server pool.",
                      sum(ep.metrics.kv_cache_usage for ep in fresh) / n if n else 0.0)
        yield average("inference_pool_average_queue_size",
                      "The average number of requests pending in the model server queue.",
                      sum(ep.metrics.waiting_queue_size for ep in fresh) / n if n else 0.0)
        yield average("inference_pool_average_running_requests",
                      "The average number of requests currently being processed by model servers.",
                      sum(ep.metrics.running_requests for ep in fresh) / n if n else 0.0)
        yield average("inference_pool_ready_pods", "The number of ready pods in the inference server pool.",
                      float(len(self.datastore.endpoints())))
        per_pod = GaugeMetricFamily("inference_pool_per_pod_queue_size",
                                    "The total number of requests pending in the model server queue for each underlying pod.",
                                    labels=["name", "model_server_pod"])
        for ep in fresh:
            per_pod.add_metric([pool, ep.name], float(ep.metrics.waiting_queue_size))
        yield per_pod
        yield from self._endpoint_gauges(pool, now)

    def _endpoint_gauges(self, pool: str, now: float) -> Iterator[GaugeMetricFamily]:
        """Ours: every endpoint's signals as the EPP sees them, fresh or not, and their age, so an
        SRE can tell a busy pod from one whose metrics stopped arriving."""
        labels = ["name", "endpoint", "model_server_pod"]
        families = {
            "waiting": GaugeMetricFamily("inference_pool_endpoint_waiting_queue_size",
                                         "Waiting requests the endpoint last reported.", labels=labels),
            "running": GaugeMetricFamily("inference_pool_endpoint_running_requests",
                                         "Running requests the endpoint last reported.", labels=labels),
            "kv": GaugeMetricFamily("inference_pool_endpoint_kv_cache_utilization",
                                    "KV-cache utilisation (0-1) the endpoint last reported.", labels=labels),
            "itl": GaugeMetricFamily("inference_pool_endpoint_inter_token_latency_seconds",
                                     "Mean inter-token latency over the endpoint's last scrape window.", labels=labels),
            "inflight": GaugeMetricFamily("inference_pool_endpoint_inflight_requests",
                                          "Requests this EPP picked for the endpoint that have not ended (exact).",
                                          labels=labels),
            "age": GaugeMetricFamily("inference_pool_endpoint_metrics_age_seconds",
                                     "Seconds since the endpoint's metrics were last scraped successfully (-1: never). "
                                     "An endpoint whose metrics do not move is polled less often, so its age grows "
                                     "up to its inference_pool_endpoint_scrape_interval_seconds.",
                                     labels=labels),
            "stalled": GaugeMetricFamily("inference_pool_endpoint_stalled_seconds",
                                         "How far past its predicted first token the oldest stalled request this EPP "
                                         "sent to the endpoint is (0: none; stalled: a streamed request long overdue, "
                                         "e.g. on a pod stuck preempting for KV blocks). The predicted-latency "
                                         "scheduler adds it to the endpoint's predicted TTFT once the endpoint has "
                                         "sent any first byte.", labels=labels),
            "up": GaugeMetricFamily("inference_pool_endpoint_scrape_up",
                                    "1 when the endpoint's last metrics scrape succeeded, else 0 (failed, or held "
                                    "values out of bounds).", labels=labels),
        }
        for ep in self.datastore.endpoints():
            m = ep.metrics
            key = [pool, ep.address, ep.name]
            families["waiting"].add_metric(key, float(m.waiting_queue_size))
            families["running"].add_metric(key, float(m.running_requests))
            families["kv"].add_metric(key, m.kv_cache_usage)
            families["itl"].add_metric(key, m.inter_token_latency)
            families["inflight"].add_metric(key, float(ep.inflight_requests))
            families["age"].add_metric(key, now - m.update_time if m.update_time > 0 else -1.0)
            families["stalled"].add_metric(key, ep.load.lateness(now))
            families["up"].add_metric(key, 0.0 if ep.scrape_error or m.update_time <= 0 else 1.0)
        yield from families.values()


class ScrapeCollector(Collector):
    """Ours: `inference_pool_endpoint_invalid_metric_samples_total{name, endpoint, model_server_pod,
    metric}`, scrapes of a live endpoint rejected because `metric` was out of bounds. Labels are
    bounded: endpoints of the pool now (a departed pod's series go with it), metric names from
    the engine mapping."""

    def __init__(self, datastore: Datastore) -> None:
        self.datastore = datastore
        self.source: Callable[[], Mapping[str, ScrapeStats]] | None = None

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        family = CounterMetricFamily(
            "inference_pool_endpoint_invalid_metric_samples",
            "Scrapes of the endpoint rejected because this metric's value was out of bounds "
            "(not finite, a fraction above 1, a negative or fractional count, ...).",
            labels=["name", "endpoint", "model_server_pod", "metric"])
        interval = GaugeMetricFamily(
            "inference_pool_endpoint_scrape_interval_seconds",
            "Seconds between the endpoint's metrics polls now: the configured interval, or up to a few times it "
            "while its metrics do not move (back-off; the first change, a failure, or a request the EPP sends it "
            "returns it to the interval).",
            labels=["name", "endpoint", "model_server_pod"])
        source = self.source
        if source is not None:
            pool = self.datastore.pool.name or "default"
            for address, stats in source().items():
                endpoint = self.datastore.get(address)
                if endpoint is None:
                    continue
                for metric, count in stats.invalid.copy().items():
                    family.add_metric([pool, address, endpoint.name, metric], float(count))
                if stats.interval > 0:
                    interval.add_metric([pool, address, endpoint.name], stats.interval)
        yield family
        yield interval


class Children:
    """A metric's label children by label values. prometheus_client's `labels()` takes a lock and
    checks the values on every call, and the request path asks for the same few children thousands
    of times a second; the label sets are already bounded (`BoundedFamily`), so is this table."""

    __slots__ = ("_cache", "metric")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._cache: dict[tuple[str, ...], Any] = {}

    def __call__(self, values: tuple[str, ...]) -> Any:
        found = self._cache.get(values)
        if found is None:
            found = self._cache[values] = self.metric.labels(*values)
        return found

    def remove(self, values: tuple[str, ...]) -> None:
        """Remove the series (a removed child is detached: updating it would expose nothing)."""
        self._cache.pop(values, None)
        try:
            self.metric.remove(*values)
        except KeyError:
            pass


def _histogram_lines(buckets: Sequence[float]) -> int:
    """Exposition lines of one histogram label set: buckets, +Inf, _count, _sum, _created."""
    return len(buckets) + 4


_COUNTER_LINES = 2  # _total, _created


class EppMetrics:
    """The registry and every update the request path, flow control and plugins report.

    `known_models`: names that always keep their own `model_name` label value, besides those the
    pods report (`--metrics-model-names`). `limits`: the label and series caps."""

    def __init__(self, datastore: Datastore, staleness: float = 2.0, *, known_models: Iterable[str] = (),
                 limits: LabelLimits | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.datastore = datastore
        mt = ["model_name", "target_model_name"]
        self.folded = Counter("inference_extension_metric_labels_folded",
                              "Metric updates whose label value was replaced by 'other', by metric, label and "
                              "reason (unknown_model, too_long, too_many_values, series_budget).",
                              ["metric", "label", "reason"], registry=r)
        self.known_models = KnownModels(datastore, known_models, clock=datastore.clock)
        self.guard = LabelGuard(limits or LabelLimits(), self.known_models, self.folded)
        self.info = Gauge("inference_extension_info", "General information of the current build of Inference Extension.",
                          ["commit", "build_ref"], registry=r)
        self.info.labels(commit="", build_ref=__version__).set(1)
        self.request_total = Counter("inference_objective_request", "Counter of inference objective requests broken out for each model and target model.",
                                     [*mt, "priority"], registry=r)
        self.request_error_total = Counter("inference_objective_request_error", "Counter of inference objective requests errors broken out for each model and target model.",
                                           [*mt, "error_code"], registry=r)
        self.request_duration = Histogram("inference_objective_request_duration_seconds", "Inference objective response latency distribution in seconds for each model and target model.",
                                          mt, buckets=_DURATION_BUCKETS, registry=r)
        self.request_sizes = Histogram("inference_objective_request_sizes", "Inference objective requests size distribution in bytes for each model and target model.",
                                       mt, buckets=_SIZE_BUCKETS, registry=r)
        self.response_sizes = Histogram("inference_objective_response_sizes", "Inference objective responses size distribution in bytes for each model and target model.",
                                        mt, buckets=_SIZE_BUCKETS, registry=r)
        self.input_tokens = Histogram("inference_objective_input_tokens", "Inference objective input token count distribution for requests in each model.",
                                      mt, buckets=_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram("inference_objective_output_tokens", "Inference objective output token count distribution for requests in each model.",
                                       mt, buckets=_TOKEN_BUCKETS, registry=r)
        self.prompt_cached_tokens = Histogram("inference_objective_prompt_cached_tokens", "Inference objective prompt cached token count distribution for requests in each model.",
                                              mt, buckets=_TOKEN_BUCKETS, registry=r)
        self.ntpot = Histogram("inference_objective_normalized_time_per_output_token_seconds", "Inference objective latency divided by number of output tokens in seconds for each model and target model.",
                               mt, buckets=_NTPOT_BUCKETS, registry=r)
        self.running_requests = Gauge("inference_objective_running_requests", "Inference objective number of running requests in each model.",
                                      ["model_name"], registry=r)
        self.scheduler_e2e = Histogram("inference_extension_scheduler_e2e_duration_seconds", "End-to-end scheduling latency distribution in seconds.",
                                       buckets=_SCHEDULER_BUCKETS, registry=r)
        self.scheduler_attempts = Counter("inference_extension_scheduler_attempts", "Total number of scheduling attempts.",
                                          ["status", "target_model_name", "pod_name", "namespace", "port"], registry=r)
        self.plugin_duration = Histogram("inference_extension_plugin_duration_seconds",
                                         "Plugin processing latency distribution in seconds for each extension point, plugin type and plugin name.",
                                         ["extension_point", "plugin_type", "plugin_name"], buckets=_SCHEDULER_BUCKETS, registry=r)
        self.prefix_indexer_hit_bytes = Histogram("inference_extension_prefix_indexer_hit_bytes",
                                                  "Length of the prefix match in number of bytes in the cache lookup.",
                                                  buckets=_SIZE_BUCKETS, registry=r)
        self.prefix_indexer_hit_ratio = Histogram("inference_extension_prefix_indexer_hit_ratio", "Ratio of prefix length matched to total prefix length in the cache lookup.",
                                                  buckets=_RATIO_BUCKETS, registry=r)
        r.register(PoolCollector(datastore, staleness))
        self._scrapes = ScrapeCollector(datastore)
        r.register(self._scrapes)
        # -- flow control (reference names; `rejections` is ours) --
        self.flow_queue_size = Gauge("inference_extension_flow_control_queue_size",
                                     "Number of requests waiting in flow control.", _FLOW_QUEUE_LABELS, registry=r)
        self.flow_queue_bytes = Gauge("inference_extension_flow_control_queue_bytes",
                                      "Request body bytes held by requests waiting in flow control.",
                                      _FLOW_QUEUE_LABELS, registry=r)
        self.flow_queue_duration = Histogram("inference_extension_flow_control_request_queue_duration_seconds",
                                             "Time requests spent in flow control, by outcome.",
                                             ["fairness_id", "priority", "outcome", "inference_pool", *mt],
                                             buckets=_QUEUE_BUCKETS, registry=r)
        self.flow_enqueue_seconds = Histogram("inference_extension_flow_control_request_enqueue_duration_seconds",
                                              "Time the enqueue step took; outcome Enqueued or the rejection.",
                                              ["fairness_id", "priority", "outcome"], buckets=_CYCLE_BUCKETS, registry=r)
        self.flow_cycle_seconds = Histogram("inference_extension_flow_control_dispatch_cycle_duration_seconds",
                                            "Time one flow-control dispatch cycle took.", buckets=_CYCLE_BUCKETS, registry=r)
        self.flow_rejections = Counter("inference_extension_flow_control_rejections",
                                       "Requests admission ended without dispatching them, by reason (capacity, "
                                       "band_capacity, saturated, ttl, evicted, cancelled, shutdown) and priority.",
                                       ["reason", "priority", "inference_pool"], registry=r)
        self._saturation = SaturationCollector(datastore)
        r.register(self._saturation)

        # The guarded label sets, one `BoundedFamily` per family (label names as above).
        def family(name: str, labels: Sequence[str], kinds: Sequence[Kind | None], lines: int) -> BoundedFamily:
            return BoundedFamily(self.guard, name, labels, kinds, lines)

        hist = _histogram_lines
        self._request_total = family("inference_objective_request_total", [*mt, "priority"],
                                     [Kind.MODEL, Kind.MODEL, Kind.PRIORITY], _COUNTER_LINES)
        self._request_error = family("inference_objective_request_error_total", [*mt, "error_code"],
                                     [Kind.MODEL, Kind.MODEL, None], _COUNTER_LINES)
        self._by_model = {
            name: family(name, mt, [Kind.MODEL, Kind.MODEL], hist(buckets)) for name, buckets in (
                ("inference_objective_request_duration_seconds", _DURATION_BUCKETS),
                ("inference_objective_request_sizes", _SIZE_BUCKETS),
                ("inference_objective_response_sizes", _SIZE_BUCKETS),
                ("inference_objective_input_tokens", _TOKEN_BUCKETS),
                ("inference_objective_output_tokens", _TOKEN_BUCKETS),
                ("inference_objective_prompt_cached_tokens", _TOKEN_BUCKETS),
                ("inference_objective_normalized_time_per_output_token_seconds", _NTPOT_BUCKETS),
            )}
        self._running = family("inference_objective_running_requests", ["model_name"], [Kind.MODEL], 1)
        self._attempts = family("inference_extension_scheduler_attempts_total",
                                ["status", "target_model_name", "pod_name", "namespace", "port"],
                                [None, Kind.MODEL, Kind.ENDPOINT, Kind.ENDPOINT, Kind.ENDPOINT], _COUNTER_LINES)
        # queue_size and queue_bytes move together: one family of two lines per label set
        self._flow_queue = family("inference_extension_flow_control_queue_size", _FLOW_QUEUE_LABELS,
                                  [Kind.FAIRNESS, Kind.PRIORITY, None, Kind.MODEL, Kind.MODEL], 2)
        self._flow_duration = family("inference_extension_flow_control_request_queue_duration_seconds",
                                     ["fairness_id", "priority", "outcome", "inference_pool", *mt],
                                     [Kind.FAIRNESS, Kind.PRIORITY, None, None, Kind.MODEL, Kind.MODEL],
                                     hist(_QUEUE_BUCKETS))
        self._flow_enqueue = family("inference_extension_flow_control_request_enqueue_duration_seconds",
                                    ["fairness_id", "priority", "outcome"], [Kind.FAIRNESS, Kind.PRIORITY, None],
                                    hist(_CYCLE_BUCKETS))
        self._flow_rejections = family("inference_extension_flow_control_rejections_total",
                                       ["reason", "priority", "inference_pool"], [None, Kind.PRIORITY, None],
                                       _COUNTER_LINES)
        # Gauges moved up and down must use one label set for both moves: the set chosen when a
        # model (or a flow) first goes up is kept until it is back at zero, even if the model
        # becomes known meanwhile. Entries live only while something is running or queued.
        self._running_labels: dict[str, list[Any]] = {}  # model -> [label, count]
        self._flow_labels: dict[tuple[str, int, str, str], list[Any]] = {}  # raw -> [labels, requests]
        self._flow_queued: dict[tuple[str, ...], list[int]] = {}  # labels -> [requests, bytes]
        self.latency = LatencyMetrics(r, datastore)
        self._children = {name: Children(getattr(self, name)) for name in (
            "plugin_duration", "flow_queue_size", "flow_queue_bytes", "flow_queue_duration", "flow_rejections",
            "flow_enqueue_seconds", "request_total", "request_sizes", "request_error_total", "scheduler_attempts",
            "running_requests", "request_duration", "response_sizes", "input_tokens", "output_tokens",
            "prompt_cached_tokens", "ntpot")}

    def ttft_predicted(self, request: InferenceRequest, predicted: float, observed: float) -> None:
        self.latency.ttft_predicted(predicted, observed)

    def slo_outcome(self, request: InferenceRequest, outcome: str) -> None:
        self.latency.slo_outcome(outcome)

    def prefix_copied(self, request: InferenceRequest, credit_seconds: float, reason: str) -> None:
        self.latency.prefix_copied(credit_seconds, reason)

    def saturated_pick(self, request: InferenceRequest) -> None:
        self.latency.saturated_pick()

    def ttft_bounded_pick(self, request: InferenceRequest) -> None:
        self.latency.ttft_bounded_pick()

    def overload_ranked_pick(self, request: InferenceRequest) -> None:
        self.latency.overload_ranked_pick()

    def cold_prompts_reused(self, request: InferenceRequest, share: float) -> None:
        self.latency.reused.set(share)

    def plugin_timed(self, extension_point: str, plugin: Plugin, seconds: float) -> None:
        self._children["plugin_duration"]((extension_point, plugin.type, plugin.name)).observe(seconds)

    def prefix_matched(self, ratio: float, hit_bytes: int) -> None:
        self.prefix_indexer_hit_ratio.observe(ratio)
        self.prefix_indexer_hit_bytes.observe(hit_bytes)

    def set_prefix_index_size(self, source: Callable[[], int]) -> None:
        """`inference_extension_prefix_indexer_size`, read when Prometheus scrapes."""
        gauge = Gauge("inference_extension_prefix_indexer_size", "Size of the prefix indexer.", registry=self.registry)
        gauge.set_function(lambda: float(source()))

    def set_saturation_source(self, source: Callable[[], float]) -> None:
        """Where the pool saturation gauge reads from (the configured detector over the pool)."""
        self._saturation.source = source

    def set_scrape_stats_source(self, source: Callable[[], Mapping[str, ScrapeStats]]) -> None:
        """Where the invalid-sample counters read from (`MetricsScraper.all_stats`)."""
        self._scrapes.source = source

    # -- events from flow control (`epp.flowcontrol.sink.FlowMetricsSink`) --

    def _pool(self) -> str:
        return self.datastore.pool.name or "default"

    def flow_queue_changed(self, fairness_id: str, priority: int, model: str, target_model: str,
                           requests: int, size: int) -> None:
        raw = (fairness_id, priority, model, target_model)
        entry = self._flow_labels.get(raw)
        if entry is None:
            labels = self._flow_queue.admit((fairness_id, str(priority), self._pool(), model, target_model))
            entry = self._flow_labels[raw] = [labels, 0]
        labels = entry[0]
        entry[1] += requests
        if entry[1] <= 0:
            del self._flow_labels[raw]
        held = self._flow_queued.setdefault(labels, [0, 0])
        held[0] += requests
        held[1] += size
        if held[0] <= 0:  # drop the series of a flow that left: fairness ids are unbounded over time
            del self._flow_queued[labels]
            for name in ("flow_queue_size", "flow_queue_bytes"):
                self._children[name].remove(labels)
            self._flow_queue.release(labels)
            return
        self._children["flow_queue_size"](labels).set(held[0])
        self._children["flow_queue_bytes"](labels).set(held[1])

    def flow_request_done(self, fairness_id: str, priority: int, model: str, target_model: str,
                          outcome: str, seconds: float) -> None:
        labels = self._flow_duration.admit((fairness_id, str(priority), outcome, self._pool(), model, target_model))
        self._children["flow_queue_duration"](labels).observe(seconds)

    def flow_rejected(self, reason: str, priority: int) -> None:
        self._children["flow_rejections"](self._flow_rejections.admit((reason, str(priority), self._pool()))).inc()

    def flow_enqueue_duration(self, fairness_id: str, priority: int, outcome: str, seconds: float) -> None:
        labels = self._flow_enqueue.admit((fairness_id, str(priority), outcome))
        self._children["flow_enqueue_seconds"](labels).observe(seconds)

    def flow_dispatch_cycle(self, seconds: float) -> None:
        self.flow_cycle_seconds.observe(seconds)

    # -- events from request control (`epp.requestcontrol.sink.RequestMetricsSink`) --

    def request_received(self, request: InferenceRequest) -> None:
        labels = self._request_total.admit((request.model, request.target_model, str(request.priority)))
        self._children["request_total"](labels).inc()
        labels = self._by_model["inference_objective_request_sizes"].admit((request.model, request.target_model))
        self._children["request_sizes"](labels).observe(request.body_size)

    def request_error(self, request: InferenceRequest, code: str) -> None:
        labels = self._request_error.admit((request.model, request.target_model, code))
        self._children["request_error_total"](labels).inc()

    def scheduled(self, request: InferenceRequest, endpoint: Endpoint | None, seconds: float) -> None:
        self.scheduler_e2e.observe(seconds)
        if endpoint is None:
            labels = self._attempts.admit(("failure", request.target_model, "", "", ""))
        else:
            labels = self._attempts.admit(("success", request.target_model, endpoint.name,
                                           endpoint.spec.namespace, str(endpoint.spec.port)))
        self._children["scheduler_attempts"](labels).inc()

    def running_changed(self, model: str, delta: int) -> None:
        entry = self._running_labels.get(model)
        if entry is None:
            entry = self._running_labels[model] = [self._running.admit((model,))[0], 0]
        entry[1] += delta
        self._children["running_requests"]((entry[0],)).inc(delta)
        if entry[1] <= 0:
            del self._running_labels[model]

    def request_finished(self, request: InferenceRequest, usage: Usage | None, response_bytes: int,
                         elapsed: float) -> None:
        if request.body is None:
            return
        raw = (request.model, request.target_model)
        by_model = self._by_model

        def labels(name: str) -> tuple[str, ...]:
            return by_model[name].admit(raw)

        self._children["request_duration"](labels("inference_objective_request_duration_seconds")).observe(elapsed)
        if response_bytes:
            self._children["response_sizes"](labels("inference_objective_response_sizes")).observe(response_bytes)
        if usage is not None:
            self._children["input_tokens"](labels("inference_objective_input_tokens")).observe(usage.prompt_tokens)
            self._children["output_tokens"](labels("inference_objective_output_tokens")).observe(usage.completion_tokens)
            self._children["prompt_cached_tokens"](labels("inference_objective_prompt_cached_tokens")).observe(
                usage.cached_tokens)
            if usage.completion_tokens > 0:
                self._children["ntpot"](labels("inference_objective_normalized_time_per_output_token_seconds")).observe(
                    elapsed / usage.completion_tokens)
