"""The configuration used when none is given.

`REFERENCE_DEFAULT_CONFIG` is the reference EPP's default (§3.4 of the reference notes) verbatim.
`DEFAULT_CONFIG` is ours: the same, plus `active-request-scorer` (weight 2) in the default profile.

Why the addition: the reference's scorers all read scraped metrics, which are up to one scrape
interval old. Inside a burst every pod looks the same to them, the max-score picker breaks the
tie at random, and requests pile up unevenly until the next scrape (llm-d-router#2515). This EPP
counts a request against its endpoint the moment it is picked (`Endpoint.inflight_requests`), and
`active-request-scorer` scores that exact count min-max over the candidates, so every pick makes
the next one prefer another pod: a burst spreads evenly. Weight 2 equals the queue scorer's — the
in-flight count is the fresh half of the same load signal. It outweighs a partial prefix match
(prefix weight 3 × match ratio < 2 below a 2/3 match) but not a near-complete one, so identical
prompts still stick to the pod that cached them until its scraped queue grows too.

A GIE config given explicitly is used unchanged; only the no-config default differs.
"""

from __future__ import annotations

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
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
"""

DEFAULT_CONFIG = """\
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
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
"""
