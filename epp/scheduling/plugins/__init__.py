"""In-tree scheduling plugins, one file per config `type`.

`PLUGIN_CLASSES` is the explicit list the registry builds its table from. Plugins that live in
other layers (saturation detectors in `epp.flowcontrol`, data-layer sources/extractors in
`epp.datalayer`, request parsers) are added to the table the config loader uses
(`epp.config.plugin_types`), so this package never imports the layers above it. Modules whose
name starts with `_` are shared helpers, not plugin types.
"""

from __future__ import annotations

from epp.scheduling.framework import Plugin
from epp.scheduling.plugins.active_request_scorer import ActiveRequestScorer
from epp.scheduling.plugins.approx_prefix_cache_producer import ApproxPrefixCacheProducer
from epp.scheduling.plugins.destination_endpoint_served_verifier import DestinationEndpointServedVerifier
from epp.scheduling.plugins.header_based_testing_filter import HeaderBasedTestingFilter
from epp.scheduling.plugins.inflight_load_producer import InflightLoadProducer
from epp.scheduling.plugins.kv_cache_utilization_scorer import KvCacheUtilizationScorer
from epp.scheduling.plugins.latency_scorer import LatencyScorer
from epp.scheduling.plugins.lora_affinity_scorer import LoraAffinityScorer
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.plugins.predicted_latency_producer import PredictedLatencyProducer
from epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from epp.scheduling.plugins.queue_scorer import QueueScorer
from epp.scheduling.plugins.random_picker import RandomPicker
from epp.scheduling.plugins.running_requests_size_scorer import RunningRequestsSizeScorer
from epp.scheduling.plugins.single_profile_handler import SingleProfileHandler
from epp.scheduling.plugins.slo_headroom_tier_filter import SloHeadroomTierFilter
from epp.scheduling.plugins.token_load_scorer import TokenLoadScorer
from epp.scheduling.plugins.weighted_random_picker import WeightedRandomPicker

PLUGIN_CLASSES: tuple[type[Plugin], ...] = (
    # scorers
    QueueScorer,
    RunningRequestsSizeScorer,
    KvCacheUtilizationScorer,
    LoraAffinityScorer,
    TokenLoadScorer,
    ActiveRequestScorer,
    PrefixCacheScorer,
    LatencyScorer,
    # filters
    SloHeadroomTierFilter,
    # data producers / request-lifecycle hooks
    ApproxPrefixCacheProducer,
    InflightLoadProducer,
    PredictedLatencyProducer,
    # pickers
    MaxScorePicker,
    RandomPicker,
    WeightedRandomPicker,
    # profile handlers
    SingleProfileHandler,
    # conformance (test only)
    HeaderBasedTestingFilter,
    DestinationEndpointServedVerifier,
)

__all__ = [
    "PLUGIN_CLASSES",
    "ActiveRequestScorer",
    "ApproxPrefixCacheProducer",
    "DestinationEndpointServedVerifier",
    "HeaderBasedTestingFilter",
    "InflightLoadProducer",
    "KvCacheUtilizationScorer",
    "LatencyScorer",
    "LoraAffinityScorer",
    "MaxScorePicker",
    "PredictedLatencyProducer",
    "PrefixCacheScorer",
    "QueueScorer",
    "RandomPicker",
    "RunningRequestsSizeScorer",
    "SingleProfileHandler",
    "SloHeadroomTierFilter",
    "TokenLoadScorer",
    "WeightedRandomPicker",
]
