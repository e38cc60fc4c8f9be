"""Metrics of the precise prefix path: the index, the KV-event stream, the tokenizer.

Names follow the reference's successor where it has the family: llm-d-kv-cache's
`kvcache_index_*` (entries, admissions, evictions, lookups, hits, hit rate; label
`backend="in_memory"`) and llm-d-router's `llm_d_epp_precise_prefix_indexer_{max,avg,std_dev}_hit_ratio`
histograms. It has none for the event stream, so those are ours, in the same `kvcache_kvevents_*`
namespace: messages and events processed, lag (now − the batch's engine timestamp), per-endpoint
event age, gaps, replays, restarts, resets, skipped blocks, and the warnings the subscriber logs
when it looks misconfigured. Labels are bounded: endpoints come from discovery (the pool),
reasons and outcomes from fixed sets; topics a pod sends never become labels.

Counters live as plain ints in the index and the subscribers (no Prometheus call on the hot
paths) and are read when Prometheus scrapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_BACKEND = "in_memory"


class PrecisePrefixMetrics(Collector):
    def __init__(self, registry: CollectorRegistry, producers: list[Any]) -> None:
        self.producers = producers  # PrecisePrefixCacheProducer (duck-typed: observability sits below)
        self.subscribers: list[Any] = []  # KVEventSubscriber, added by the runner
        self.token_producers: list[Any] = []
        labels = ["plugin_name", "plugin_type"]
        self.max_ratio = Histogram("llm_d_epp_precise_prefix_indexer_max_hit_ratio",
                                   "Ratio of matched KV blocks to total prompt KV blocks at the best-matched endpoint.",
                                   labels, buckets=_RATIO_BUCKETS, registry=registry)
        self.avg_ratio = Histogram("llm_d_epp_precise_prefix_indexer_avg_hit_ratio",
                                   "Average ratio of matched KV blocks to total prompt KV blocks across candidates.",
                                   labels, buckets=_RATIO_BUCKETS, registry=registry)
        self.std_ratio = Histogram("llm_d_epp_precise_prefix_indexer_std_dev_hit_ratio",
                                   "Standard deviation of the ratio of matched KV blocks across candidates.",
                                   labels, buckets=_RATIO_BUCKETS, registry=registry)
        registry.register(self)

    def lookup_observer(self, producer: Any) -> Callable[[Any], None]:
        """The producer's per-lookup hook: llm-d's three hit-ratio histograms."""
        labels = (producer.name, producer.type)
        max_h, avg_h, std_h = (h.labels(*labels) for h in (self.max_ratio, self.avg_ratio, self.std_ratio))

        def observe(match: Any) -> None:
            total = match.total
            if not total or not match.sources:
                return
            ratios = [match.matched.get(address, 0) / total for address in match.sources]
            mean = sum(ratios) / len(ratios)
            max_h.observe(max(ratios))
            avg_h.observe(mean)
            std_h.observe(math.sqrt(sum((r - mean) ** 2 for r in ratios) / len(ratios)))

        return observe

    def collect(self) -> Iterator[Any]:
        yield from self._index()
        yield from self._events()
        yield from self._tokens()

    def _index(self) -> Iterator[Any]:
        def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> CounterMetricFamily:
            labels = labels or {"backend": _BACKEND}
            family = CounterMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        stats = [p.index.stats for p in self.producers]
        entries = GaugeMetricFamily("kvcache_index_entries", "Current number of keys held in the index (router "
                                    "keys summed over endpoints).", labels=["backend"])
        entries.add_metric([_BACKEND], float(sum(p.index.size for p in self.producers)))
        yield entries
        yield counter("kvcache_index_admissions", "Total number of KV-block admissions.",
                      sum(s.admissions for s in stats))
        yield counter("kvcache_index_evictions", "Total number of KV-block evictions (events, resets, the memory "
                      "bound).", sum(s.evictions for s in stats))
        yield counter("kvcache_index_capacity_evictions", "KV-block keys dropped by the index's memory bound.",
                      sum(s.capacity_evictions for s in stats))
        lookups = CounterMetricFamily("kvcache_index_lookup_requests", "Total number of lookup calls.")
        lookups.add_metric([], float(sum(s.lookups for s in stats)))
        yield lookups
        hits = CounterMetricFamily("kvcache_index_lookup_hits", "Blocks found on the best endpoint on lookup.")
        hits.add_metric([], float(sum(s.lookup_hits for s in stats)))
        yield hits
        blocks = sum(s.lookup_blocks for s in stats)
        rate = GaugeMetricFamily("kvcache_index_hit_rate", "Cumulative block-level hit ratio (hits / blocks looked "
                                 "up) since process start.", labels=["backend"])
        rate.add_metric([_BACKEND], sum(s.lookup_hits for s in stats) / blocks if blocks else 0.0)
        yield rate
        spec = CounterMetricFamily("kvcache_index_speculative_entries", "Speculative entries by outcome.",
                                   labels=["outcome"])
        for outcome, attr in (("added", "speculative_added"), ("confirmed", "speculative_confirmed"),
                              ("expired", "speculative_expired")):
            spec.add_metric([outcome], float(sum(getattr(s, attr) for s in stats)))
        yield spec
        yield counter("kvcache_index_foreseen_evictions", "Router blocks an endpoint held at lookup but was not "
                      "credited with: the blocks already sent its way evict them before it admits the request.",
                      sum(s.foreseen_blocks for s in stats))
        skipped = CounterMetricFamily("kvcache_index_skipped_blocks", "Engine blocks not indexed, by reason "
                                      "(sliding_window and other non-prefix groups, orphan, malformed, ...).",
                                      labels=["reason"])
        resets = CounterMetricFamily("kvcache_index_endpoint_resets", "Endpoints whose entries were dropped, by "
                                     "reason (cleared, restart, gap).", labels=["reason"])
        merged_skip: dict[str, int] = {}
        merged_reset: dict[str, int] = {}
        for s in stats:
            for k, v in s.skipped_blocks.items():
                merged_skip[k] = merged_skip.get(k, 0) + v
            for k, v in s.resets.items():
                merged_reset[k] = merged_reset.get(k, 0) + v
        for k, v in merged_skip.items():
            skipped.add_metric([k], float(v))
        for k, v in merged_reset.items():
            resets.add_metric([k], float(v))
        yield skipped
        yield resets
        per = GaugeMetricFamily("kvcache_index_endpoint_entries", "Router keys the index holds per endpoint.",
                                labels=["endpoint"])
        for p in self.producers:
            for address in p.index.endpoints():
                per.add_metric([address], float(p.index.endpoint_size(address)))
        yield per

    def _events(self) -> Iterator[Any]:
        subs = self.subscribers
        names = {
            "messages": ("kvcache_kvevents_messages", "KV-event messages (batches) received and decoded."),
            "decode_errors": ("kvcache_kvevents_decode_errors", "KV-event messages dropped as undecodable."),
            "skipped_events": ("kvcache_kvevents_skipped_events", "Events of an unknown type or malformed, skipped."),
            "gaps": ("kvcache_kvevents_gaps", "Sequence gaps detected (lost messages)."),
            "restarts": ("kvcache_kvevents_restarts", "Publishers whose sequence went back (engine restarts)."),
            "unknown_topic_messages": ("kvcache_kvevents_unknown_topic_messages",
                                       "Messages whose topic names no endpoint of the pool (dropped)."),
        }
        for attr, (name, doc) in names.items():
            family = CounterMetricFamily(name, doc)
            family.add_metric([], float(sum(getattr(s.stats, attr) for s in subs)))
            yield family
        for name, doc, label, attr in (
                ("kvcache_kvevents_events", "KV events processed, by type.", "type", "events"),
                ("kvcache_kvevents_replays", "Replays through the publisher's ROUTER socket, by outcome.",
                 "outcome", "replays"),
                ("kvcache_kvevents_warnings", "Misconfiguration warnings logged (unknown_topic, silent_endpoint, "
                 "no_match).", "kind", "warnings")):
            family = CounterMetricFamily(name, doc, labels=[label])
            merged: dict[str, int] = {}
            for s in subs:
                for k, v in getattr(s.stats, attr).items():
                    merged[k] = merged.get(k, 0) + v
            for k, v in merged.items():
                family.add_metric([k], float(v))
            yield family
        silent = GaugeMetricFamily("kvcache_kvevents_silent_endpoints",
                                   "Endpoints that have sent no KV event since they joined (past silentAfter).")
        silent.add_metric([], float(sum(s.stats.silent_endpoints for s in subs)))
        yield silent
        sockets = GaugeMetricFamily("kvcache_kvevents_sockets", "KV-event sockets open.")
        sockets.add_metric([], float(sum(s.stats.sockets for s in subs)))
        yield sockets
        if subs:
            from epp.datalayer.kv_subscriber import LAG_BUCKETS  # noqa: PLC0415 - only when subscribers exist

            buckets = [0] * (len(LAG_BUCKETS) + 1)
            total, count = 0.0, 0
            for s in subs:
                for i, v in enumerate(s.stats.lag_buckets):
                    buckets[i] += v
                total += s.stats.lag_sum
                count += s.stats.lag_count
            cumulative, pairs = 0, []
            for bound, v in zip((*map(str, LAG_BUCKETS), "+Inf"), buckets):
                cumulative += v
                pairs.append((bound, float(cumulative)))
            lag = HistogramMetricFamily("kvcache_kvevents_lag_seconds", "Seconds from the engine's batch timestamp "
                                        "to the batch being applied to the index (a stamp over an hour back counts as an hour).")
            lag.add_metric([], pairs, sum_value=total)
            yield lag
        age = GaugeMetricFamily("kvcache_kvevents_endpoint_event_age_seconds",
                                "Seconds since the endpoint's last KV event (-1: never).", labels=["endpoint"])
        for s in subs:
            now = s.clock()
            for ep in s.datastore.endpoints():
                info = s.index.events(ep.address)
                age.add_metric([ep.address], now - info.last_event if info is not None and info.last_event else -1.0)
        yield age

    def _tokens(self) -> Iterator[Any]:
        family = CounterMetricFamily("kvcache_tokenization_requests", "Requests tokenized by the token-producer, "
                                     "by backend and outcome.", labels=["backend", "outcome"])
        chars = CounterMetricFamily("kvcache_tokenization_cached_chars", "Prompt characters the tokenization "
                                    "cache spared the tokenizer.")
        total_chars = 0
        merged: dict[tuple[str, str], int] = {}
        for t in self.token_producers:
            s = t.stats
            for key, v in ((("local", "ok"), s.local), (("vllm", "ok"), s.vllm), (("vllm", "error"), s.vllm_errors),
                           (("any", "skipped"), s.skipped), (("local", "error"), s.failures)):
                merged[key] = merged.get(key, 0) + v
            if t.local is not None:
                total_chars += t.local.cache.stats.cached_chars
        for (backend, outcome), v in merged.items():
            family.add_metric([backend, outcome], float(v))
        chars.add_metric([], float(total_chars))
        yield family
        yield chars
