"""Every plugin `type` a config may name, across layers.

Scheduling plugins come from `epp.scheduling.plugins.PLUGIN_CLASSES`; saturation detectors from
`epp.flowcontrol`; flow-control policies from `epp.flowcontrol.plugins.PLUGIN_CLASSES`; data-layer
sources and extractors from `epp.datalayer.PLUGIN_CLASSES`; request parsers from
`epp.config.parsers`. Config is the composition layer, so it may import all of them.
"""

from __future__ import annotations

from epp.config.parsers import PARSER_CLASSES
from epp.flowcontrol.concurrency_detector import ConcurrencyDetector
from epp.flowcontrol.plugins import PLUGIN_CLASSES as FLOW_CONTROL_CLASSES
from epp.flowcontrol.utilization_detector import UtilizationDetector
from epp.datalayer import PLUGIN_CLASSES as DATALAYER_CLASSES
from epp.datalayer.token_producer import TokenProducer
from epp.plugin import Plugin
from epp.scheduling.plugins import PLUGIN_CLASSES as SCHEDULING_CLASSES
from epp.scheduling.plugins.precise_prefix_cache_producer import PrecisePrefixCacheProducer

DETECTOR_CLASSES: tuple[type[Plugin], ...] = (UtilizationDetector, ConcurrencyDetector)
# The precise prefix path: the request preparer (tokens, before admission) and the KV-event producer.
PRECISE_PREFIX_CLASSES: tuple[type[Plugin], ...] = (TokenProducer, PrecisePrefixCacheProducer)

METRICS_DATA_SOURCE = "metrics-data-source"
CORE_METRICS_EXTRACTOR = "core-metrics-extractor"
DATA_SOURCE_TYPES = frozenset({METRICS_DATA_SOURCE})
DATA_EXTRACTOR_TYPES = frozenset({CORE_METRICS_EXTRACTOR})


def all_plugin_types() -> dict[str, type[Plugin]]:
    """Config `type` -> plugin class, for every layer."""
    table: dict[str, type[Plugin]] = {}
    for cls in (*SCHEDULING_CLASSES, *DETECTOR_CLASSES, *FLOW_CONTROL_CLASSES, *DATALAYER_CLASSES,
                *PARSER_CLASSES, *PRECISE_PREFIX_CLASSES):
        if cls.type in table and table[cls.type] is not cls:
            raise RuntimeError(f"plugin type {cls.type!r} is defined twice: {table[cls.type]} and {cls}")
        table[cls.type] = cls
    return table
