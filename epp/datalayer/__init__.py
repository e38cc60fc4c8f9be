"""The data layer: scrape model servers' Prometheus metrics into the datastore.

`promparse` reads only the wanted lines of an exposition; `spec` and `engines` say which metric
feeds which field; `extract` builds an `EndpointMetrics`; the two config plugins carry the
settings; `scraper` runs one polling task per endpoint.
"""

from epp.datalayer.core_metrics_extractor import CoreMetricsExtractor
from epp.datalayer.engines import BUILTIN_ENGINES, DEFAULT_ENGINE, ENGINE_LABEL_KEY, EngineMapping
from epp.datalayer.extract import Extraction, extract_metrics
from epp.datalayer.metrics_data_source import MetricsDataSource
from epp.datalayer.promparse import MetricsParseError, Sample, WantedNames, parse_wanted
from epp.datalayer.scraper import MetricsScraper, ScrapeStats
from epp.datalayer.spec import MetricSpec, parse_spec

# The data-layer plugin types, for the config loader's plugin table.
PLUGIN_CLASSES = (MetricsDataSource, CoreMetricsExtractor)

__all__ = [
    "BUILTIN_ENGINES",
    "DEFAULT_ENGINE",
    "ENGINE_LABEL_KEY",
    "PLUGIN_CLASSES",
    "CoreMetricsExtractor",
    "EngineMapping",
    "Extraction",
    "MetricSpec",
    "MetricsDataSource",
    "MetricsParseError",
    "MetricsScraper",
    "Sample",
    "ScrapeStats",
    "WantedNames",
    "extract_metrics",
    "parse_spec",
    "parse_wanted",
]
