"""EndpointPickerConfigs the virtual-time benchmarks compare: the built-in default (predicted
latency) and the presets (`epp.config.defaults.PRESETS`)."""

from __future__ import annotations

from epp.config.defaults import DEFAULT_CONFIG, REFERENCE_DEFAULT_CONFIG, WEIGHTED_CONFIG

DEFAULT = DEFAULT_CONFIG
WEIGHTED = WEIGHTED_CONFIG
REFERENCE = REFERENCE_DEFAULT_CONFIG


def precise_config(model: str, block_size: int = 16) -> str:
    """The default with the cache credit from the engines' KV events instead of routing history:
    the prompt tokenized as the simulated engines do (their shipped BPE tokenizer, inline: the
    virtual-time loop runs no threads), router blocks of the engines' size."""
    from epp.sim.tokens import shipped_dir

    return f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters: {{modelName: "{model}", local: {{path: "{shipped_dir('bpe')}", offloadChars: 0}}}}
- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig: {{zmqEndpoint: "tcp://*:5557", topicFilter: "kv@"}}
    tokenProcessorConfig: {{blockSize: {block_size}}}
    speculativeIndexing: true
- type: predicted-latency-producer
  parameters: {{prefixMatchInfoProducerName: precise-prefix-cache-producer}}
- type: slo-headroom-tier-filter
- type: latency-scorer
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: slo-headroom-tier-filter}}
  - {{pluginRef: latency-scorer}}
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{{pluginRef: core-metrics-extractor}}]
"""
