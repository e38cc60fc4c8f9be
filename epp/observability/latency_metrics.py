"""Metrics of the predicted-latency path: is the service model right, and what does each pod's
ledger hold?

- `inference_extension_ttft_prediction_error_ratio` (histogram): |predicted − observed| / observed
  time to first token of every streamed request the predicted-latency scorer placed; a growing
  error says the model no longer describes the pods (new hardware, a changed engine setting,
  traffic the EPP does not see).
- `inference_extension_ttft_predictions_total{direction}`: over- and under-predictions.
- `inference_extension_slo_ttft_total{outcome}`: requests with `x-slo-ttft-ms` that `met` or
  `missed` it (observed at the first streamed byte), or were `shed` because no pod was predicted
  to meet it.
- `inference_extension_prefix_copies_total{reason}` and `inference_extension_prefix_copy_credit_seconds_total`:
  picks that copied a reused prefix to a pod without it with a copy credit, and the credit they
  were given. `reason="busy"`: a hot prefix spreading to more pods (steadily rising, the pool is
  short of copies); `reason="choice"`: a second copy of a reused prefix held by one pod that is
  busier than the others on average (rising with new prefixes; steadily, prefixes keep being
  evicted down to one copy); `reason="young"`: the same second copy made in a long prefix's first
  seconds of reuse, onto an idle pod with room (rising as new documents arrive);
  `reason="faster"`: a reused prefix moving from slower pods to a faster one, or a long one
  getting another fast copy while its requests spill onto a slower holder (a pool mixing GPU
  types; steadily rising, prefixes keep landing on the slow pods first).
- `inference_extension_saturated_pool_picks_total`: picks made while every candidate's last scrape
  showed a full KV cache and a queue — the pool past its capacity — ranked for its throughput
  (prefixes kept on the pods that still hold them). Rising: add pods, or shed load.
- `inference_extension_ttft_bounded_picks_total`: picks where the cheapest candidate was predicted
  to answer beyond `latency-scorer`'s TTFT bound (`ttftBoundRatio` × the fastest + the slack), so
  a faster one was picked: a pool mixing GPU types whose slow pods sit idle while the fast ones
  are busy.
- `inference_extension_overload_ranked_picks_total`: picks of a request whose cost was mostly its
  decode charge while every candidate, all pods alike, was at its busy cap (the pool's decode
  capacity exhausted everywhere: long generations in an overload), ranked among the candidates
  within 5% of the cheapest cost on the earliest predicted first token plus the first tokens its
  prefill chunk would delay (`latency-scorer`). Rising: add pods, or shed the batch traffic.
- `inference_extension_cold_prompt_reuse_ratio`: of the pool's recent cold prompts, the share a
  later request asked for again (documents, conversations: near 1; unrelated API calls: near 0).
  The TTFT bound applies only below `ttftBoundMaxReuse` (0.5): where a cold prompt lands, its
  reuses follow.
- `inference_extension_ttft_tail_seconds{name}`: the pool's running tail of observed times to
  first token (p90 by default, `predicted-latency-producer`'s `tailQuantile`): every pick is
  charged the time it would spend beyond it (`tailWeight`). A p90 that an SLO dashboard
  computes from the request histograms, kept live for the ranking.
- per endpoint (labels `name` (the pool), `endpoint`, `model_server_pod`, as the other endpoint
  gauges):
  `inference_pool_endpoint_queued_prefill_tokens` (the ledger's prefill not yet done),
  `inference_pool_endpoint_decoding_requests`, `inference_pool_endpoint_unexplained_requests`
  (what the last scrape showed beyond the EPP's own requests: other replicas, direct clients),
  `inference_pool_endpoint_prefill_rate_tokens_per_second` and
  `inference_pool_endpoint_step_seconds` (the learned service model at the current batch), and
  `inference_pool_endpoint_ttft_prediction_error` (its recent mean relative error, of the
  prediction reported), `inference_pool_endpoint_ttft_calibration` (the factor the pod's
  prediction is multiplied by: its learned median of observed over predicted; far from 1, the
  step model misses something about the pod) and `inference_pool_endpoint_first_token_interval_seconds`
  (the time between its first tokens while it had a backlog: the pace of a pod whose KV is full) and
  `inference_pool_endpoint_ttft_tail_share` (the share of its recent first tokens beyond the
  pool's tail: the pods whose requests make the tail).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epp.datastore import Datastore

_ERROR_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0)
_LABELS = ["name", "endpoint", "model_server_pod"]


class LedgerCollector(Collector):
    """Per-endpoint ledger and service-model gauges, computed at scrape time."""

    def __init__(self, datastore: Datastore) -> None:
        self.datastore = datastore

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pool = self.datastore.pool.name
        now = self.datastore.clock()
        families = {
            "queued": GaugeMetricFamily("inference_pool_endpoint_queued_prefill_tokens",
                                        "Prefill tokens the EPP sent the endpoint that it has not yet done "
                                        "(the ledger's estimate).", labels=_LABELS),
            "decoding": GaugeMetricFamily("inference_pool_endpoint_decoding_requests",
                                          "Requests the EPP sent the endpoint that are past their prefill.",
                                          labels=_LABELS),
            "unexplained": GaugeMetricFamily("inference_pool_endpoint_unexplained_requests",
                                             "Requests the endpoint's last scrape showed beyond the EPP's own "
                                             "(other replicas, clients bypassing the gateway).",
                                             labels=_LABELS),
            "rate": GaugeMetricFamily("inference_pool_endpoint_prefill_rate_tokens_per_second",
                                      "Prefill tokens per second the endpoint's learned service model predicts "
                                      "at its current batch.", labels=_LABELS),
            "step": GaugeMetricFamily("inference_pool_endpoint_step_seconds",
                                      "Duration of one decode step the learned service model predicts at the "
                                      "endpoint's current batch.", labels=_LABELS),
            "error": GaugeMetricFamily("inference_pool_endpoint_ttft_prediction_error",
                                       "Recent mean relative error of the endpoint's predicted time to first "
                                       "token.", labels=_LABELS),
            "calibration": GaugeMetricFamily("inference_pool_endpoint_ttft_calibration",
                                             "Factor the endpoint's predicted time to first token is multiplied "
                                             "by: its learned median of observed over predicted (1: none).",
                                             labels=_LABELS),
            "interval": GaugeMetricFamily("inference_pool_endpoint_first_token_interval_seconds",
                                          "Mean time between the endpoint's first tokens while it had a backlog "
                                          "(0: not measured).", labels=_LABELS),
            "tail_share": GaugeMetricFamily("inference_pool_endpoint_ttft_tail_share",
                                            "Share of the endpoint's recent first tokens beyond the pool's TTFT "
                                            "tail (inference_extension_ttft_tail_seconds).", labels=_LABELS),
        }
        tail = GaugeMetricFamily("inference_extension_ttft_tail_seconds",
                                 "The pool's running tail of observed times to first token (the tailQuantile, "
                                 "p90 by default, of predicted-latency-producer; 0: none observed yet): picks "
                                 "are charged the time they would spend beyond it.", labels=["name"])
        tail.add_metric([pool], self.datastore.ttft_tail.seconds)
        for ep in self.datastore.endpoints():
            load, service, m = ep.load, ep.service, ep.metrics
            key = [pool, ep.address, ep.name]
            families["queued"].add_metric(key, load.backlog_at(now))
            families["decoding"].add_metric(key, float(load.decoding))
            families["unexplained"].add_metric(
                key, float(max(0, m.waiting_queue_size + m.running_requests - load.requests_at_scrape)))
            families["rate"].add_metric(key, service.prefill_rate(load.decoding, load.context_tokens))
            families["step"].add_metric(key, service.step_seconds(load.decoding, load.context_tokens))
            families["error"].add_metric(key, service.ttft_error)
            families["calibration"].add_metric(key, service.ttft_factor)
            families["interval"].add_metric(key, load.busy_interval)
            families["tail_share"].add_metric(key, load.tail_share)
        yield from families.values()
        yield tail


class LatencyMetrics:
    def __init__(self, registry: CollectorRegistry, datastore: Datastore) -> None:
        self.error = Histogram("inference_extension_ttft_prediction_error_ratio",
                               "|predicted - observed| / observed time to first token of streamed requests "
                               "placed by the predicted-latency scorer.", buckets=_ERROR_BUCKETS, registry=registry)
        self.direction = Counter("inference_extension_ttft_predictions",
                                 "Predicted times to first token that came out over or under the observed one.",
                                 ["direction"], registry=registry)
        self.slo = Counter("inference_extension_slo_ttft",
                           "Requests with x-slo-ttft-ms, by outcome: met, missed (observed at the first "
                           "streamed byte), shed (no endpoint was predicted to meet it).",
                           ["outcome"], registry=registry)
        self.copies = Counter("inference_extension_prefix_copies",
                              "Picks that copied a reused prefix to an endpoint without it, credited for what "
                              "the copy saves the prefix's next requests, by reason: busy (its holders' "
                              "queue), choice (a second holder for a prefix on one busier endpoint), young (a "
                              "second holder made in a long prefix's first seconds), faster "
                              "(an endpoint faster than every holder, or for a long prefix than the holder "
                              "the request would take).", ["reason"],
                              registry=registry)
        self.copy_credit = Counter("inference_extension_prefix_copy_credit_seconds",
                                   "Seconds of copy credit given to the picks that copied a reused prefix.",
                                   registry=registry)
        self.saturated = Counter("inference_extension_saturated_pool_picks",
                                 "Picks ranked on a saturated pool (every candidate's KV cache full with a "
                                 "queue): for its throughput, keeping prefixes on the endpoints that hold "
                                 "them.", registry=registry)
        self.bounded = Counter("inference_extension_ttft_bounded_picks",
                               "Picks the latency scorer's TTFT bound made: the cheapest candidate was "
                               "predicted to answer beyond the bound (ratio x the fastest + slack), so the "
                               "pick was the cheapest within it.", registry=registry)
        self.overload_ranked = Counter("inference_extension_overload_ranked_picks",
                                       "Picks ranked in a shared decode overload (every candidate, pods alike, at "
                                       "its busy cap, the request's decode charge above 4x its TTFT): the earliest "
                                       "predicted first token, its own and those its prefill delays, among costs "
                                       "within 5% of the cheapest.",
                                       registry=registry)
        self.reused = Gauge("inference_extension_cold_prompt_reuse_ratio",
                            "Of the pool's recent cold prompts (no endpoint held a quarter of them), the "
                            "share a later request asked for again; the latency scorer's TTFT bound applies "
                            "below ttftBoundMaxReuse (default 0.5). 1 until the first ones resolve.",
                            registry=registry)
        self.reused.set(1.0)
        registry.register(LedgerCollector(datastore))

    def ttft_predicted(self, predicted: float, observed: float) -> None:
        if observed <= 0.0:
            return
        self.error.observe(abs(predicted - observed) / observed)
        self.direction.labels("over" if predicted > observed else "under").inc()

    def slo_outcome(self, outcome: str) -> None:
        self.slo.labels(outcome).inc()

    def prefix_copied(self, credit_seconds: float, reason: str) -> None:
        self.copies.labels(reason).inc()
        self.copy_credit.inc(credit_seconds)

    def saturated_pick(self) -> None:
        self.saturated.inc()

    def ttft_bounded_pick(self) -> None:
        self.bounded.inc()

    def overload_ranked_pick(self) -> None:
        self.overload_ranked.inc()
