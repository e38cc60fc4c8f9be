"""The EPP's own Prometheus metrics, with the reference's names, types and labels (gie-epp §7).

Everything lives in one `CollectorRegistry` per EPP instance (no process-global registry), so
tests and the in-process simulator can run several EPPs side by side. Pool gauges are computed
when Prometheus scrapes, from the datastore, so they are never older than the scrape.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp import __version__
from epp.api.request import InferenceRequest
from epp.api.response import Usage
from epp.datastore import Datastore, Endpoint

if TYPE_CHECKING:
    from epp.requestcontrol.director import RequestRecord

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


class PoolCollector(Collector):
    """`inference_pool_*` gauges over endpoints whose metrics are fresher than `staleness`."""

    def __init__(self, datastore: Datastore, staleness: float) -> None:
        self.datastore = datastore
        self.staleness = staleness

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pool = self.datastore.pool.name or "default"
        now = self.datastore.clock()
        fresh = [ep for ep in self.datastore.endpoints()
                 if ep.metrics.update_time > 0 and now - ep.metrics.update_time <= self.staleness]
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


class EppMetrics:
    def __init__(self, datastore: Datastore, staleness: float = 2.0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        mt = ["model_name", "target_model_name"]
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
        self.prefix_indexer_hit_ratio = Histogram("inference_extension_prefix_indexer_hit_ratio", "Ratio of prefix length matched to total prefix length in the cache lookup.",
                                                  buckets=_RATIO_BUCKETS, registry=r)
        r.register(PoolCollector(datastore, staleness))

    # -- events from request control --

    def request_received(self, request: InferenceRequest) -> None:
        self.request_total.labels(request.model, request.target_model, str(request.priority)).inc()
        self.request_sizes.labels(request.model, request.target_model).observe(request.body_size)

    def request_error(self, request: InferenceRequest, code: str) -> None:
        self.request_error_total.labels(request.model, request.target_model, code).inc()

    def scheduled(self, request: InferenceRequest, endpoint: Endpoint | None, seconds: float) -> None:
        self.scheduler_e2e.observe(seconds)
        if endpoint is None:
            self.scheduler_attempts.labels("failure", request.target_model, "", "", "").inc()
        else:
            self.scheduler_attempts.labels("success", request.target_model, endpoint.name,
                                           endpoint.spec.namespace, str(endpoint.spec.port)).inc()

    def running_changed(self, model: str, delta: int) -> None:
        self.running_requests.labels(model).inc(delta)

    def request_finished(self, record: RequestRecord, usage: Usage | None, response_bytes: int) -> None:
        request = record.request
        if request.body is None or record.error_code:
            return
        labels = (request.model, request.target_model)
        elapsed = time.monotonic() - record.start
        self.request_duration.labels(*labels).observe(elapsed)
        if response_bytes:
            self.response_sizes.labels(*labels).observe(response_bytes)
        if usage is not None:
            self.input_tokens.labels(*labels).observe(usage.prompt_tokens)
            self.output_tokens.labels(*labels).observe(usage.completion_tokens)
            self.prompt_cached_tokens.labels(*labels).observe(usage.cached_tokens)
            if usage.completion_tokens > 0:
                self.ntpot.labels(*labels).observe(elapsed / usage.completion_tokens)
