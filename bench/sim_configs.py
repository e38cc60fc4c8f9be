"""EndpointPickerConfigs the virtual-time benchmarks compare.

`DEFAULT` is the EPP's built-in default (queue 2, KV 2, prefix 3, active requests 2).
`TUNED` came out of a sweep in the virtual-time cluster (32 pods, the three scale workloads,
comparing TTFT p50/p90/p99 with the oracle): prefix affinity weighs more, the stale scraped
signals (queue, KV) less, and the exact in-flight signals — requests *and* tokens picked but not
finished — most. The token count is what tells a pod busy with a few very long prompts from one
with many short ones (head-of-line); at equal request counts the scraped queue cannot, for up to a
scrape interval. Weights tried and rejected: prefix 5 (no better than 4), running-requests-size
(it chases the scraped batch size and doubled TTFT p99), token load without active requests.
"""

from __future__ import annotations

from epp.config.defaults import DEFAULT_CONFIG

DEFAULT = DEFAULT_CONFIG

TUNED = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: active-request-scorer
- type: token-load-scorer
  parameters: {queueThresholdTokens: 200000}
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: kv-cache-utilization-scorer, weight: 1}
  - {pluginRef: prefix-cache-scorer, weight: 4}
  - {pluginRef: active-request-scorer, weight: 3}
  - {pluginRef: token-load-scorer, weight: 2}
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
"""
