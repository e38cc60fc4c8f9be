"""The configuration used when none is given, and the named presets (`--config-preset`).

- `predicted-latency` (the built-in default, `DEFAULT_CONFIG`): every candidate is scored by a
  prediction in seconds of this request's time to first token there (queued and own uncached
  prefill over the pod's learned rate, the decode batch, slot and KV waits) plus what the pick
  does to the requests that will reach that pod after it; `latency-scorer` picks the cheapest, ties
  at random. No weights to tune: the terms are seconds. `slo-headroom-tier-filter` only acts on
  requests that carry `x-slo-ttft-ms` / `x-slo-tpot-ms`. The approximate prefix producer matches up
  to 128k prompt tokens (the reference's 256 blocks stop at 4k tokens, below a long shared
  document, so its cache credit would be cut short).
- `weighted`: this project's previous default — the reference's weighted sum (queue 2,
  kv-cache 2, prefix 3) plus `active-request-scorer` (2), which counts each request against its
  pod at pick time so a burst spreads before the next scrape.
- `reference`: the reference EPP's default (gie-epp.md §3.4) verbatim, for exact comparisons.

A GIE config given explicitly is used unchanged; only the no-config default differs from the
reference. BENCHMARKS.md has the comparisons across workloads that chose the default.
"""

from __future__ import annotations

_DATA_LAYER = """\
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
"""

REFERENCE_DEFAULT_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
""" + _DATA_LAYER

WEIGHTED_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: active-request-scorer
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: active-request-scorer, weight: 2}
""" + _DATA_LAYER

PREDICTED_LATENCY_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: approx-prefix-cache-producer
  parameters: {maxPrefixTokensToMatch: 131072}
- type: predicted-latency-producer
- type: slo-headroom-tier-filter
- type: latency-scorer
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: slo-headroom-tier-filter}
  - {pluginRef: latency-scorer}
""" + _DATA_LAYER

DEFAULT_CONFIG = PREDICTED_LATENCY_CONFIG
DEFAULT_PRESET = "predicted-latency"
PRESETS: dict[str, str] = {
    "predicted-latency": PREDICTED_LATENCY_CONFIG,
    "weighted": WEIGHTED_CONFIG,
    "reference": REFERENCE_DEFAULT_CONFIG,
}
