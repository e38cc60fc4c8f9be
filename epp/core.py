"""The composition root of the request path: config → plugins → admission → director.

`epp serve` (`epp.runner`) and the virtual-time simulator (`epp.sim.cluster.epp_router`) both
build their EPP here and nowhere else, so a simulated run exercises exactly the objects, wiring
and defaults production runs. Network servers, discovery and scraping are the runner's business;
this module does no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from epp.api.preparer import RequestPreparer
from epp.config.loader import LoadedConfig, load_config
from epp.datalayer.core_metrics_extractor import CoreMetricsExtractor
from epp.datastore import Datastore
from epp.flowcontrol.admission import Admission
from epp.flowcontrol.factory import build_admission
from epp.observability.kv_metrics import PrecisePrefixMetrics
from epp.observability.metrics import EppMetrics
from epp.observability.trace import DecisionTrace
from epp.requestcontrol.director import Director
from epp.scheduling.plugins.approx_prefix_cache_producer import ApproxPrefixCacheProducer
from epp.scheduling.plugins.precise_prefix_cache_producer import PrecisePrefixCacheProducer


@dataclass(slots=True)
class Core:
    """A built request path, ready for `director.handle_request`."""

    datastore: Datastore
    config: LoadedConfig
    admission: Admission
    director: Director
    trace: DecisionTrace | None
    precise_metrics: PrecisePrefixMetrics | None = None

    @property
    def precise_producers(self) -> list[PrecisePrefixCacheProducer]:
        """The configured precise prefix producers: their `index` is what KV events feed (the runner's
        subscribers, or the simulator in-process: `producer.index.apply(address, batch.events, now)`)."""
        return [p for p in self.config.plugins.values() if isinstance(p, PrecisePrefixCacheProducer)]


def build_core(
    datastore: Datastore,
    config_text: str | None,
    *,
    tick: float,
    metrics: EppMetrics | None = None,
    trace: DecisionTrace | None = None,
    subset_filter: bool = True,
    seed: int | None = None,
) -> Core:
    """Build the EPP's request path over `datastore`.

    `config_text`: an EndpointPickerConfig (None: the built-in default). `tick`: how often flow
    control re-runs a dispatch cycle while requests wait (the scrape interval). `seed` makes every
    random choice reproducible (the simulator). `metrics` gets the plugins' observations."""
    config = load_config(config_text, datastore, seed=seed)
    precise_metrics = observe_plugins(config, datastore, metrics) if metrics is not None else None
    admission = build_admission(config.flow_control_config, config.saturation_detector, datastore,
                                tick=tick, metrics=metrics)
    if isinstance(config.extractor, CoreMetricsExtractor):
        # One answer to "which engine is this pod" for its metrics, the APIs it serves and the
        # body fields it gets (the extractor's engine label key and default engine).
        admission.engine_of = config.extractor.engine_of
    director = Director(
        datastore,
        config.scheduler,
        admission,
        pre_request=config.pre_request,
        response_received=config.response_received,
        response_complete=config.response_complete,
        metrics=metrics,
        subset_filter=subset_filter,
        trace=trace,
        rng=random.Random(f"{seed}:director") if seed is not None else None,
        preparers=[p for p in config.plugins.values() if isinstance(p, RequestPreparer)],
    )
    return Core(datastore, config, admission, director, trace, precise_metrics)


def observe_plugins(config: LoadedConfig, datastore: Datastore, metrics: EppMetrics) -> PrecisePrefixMetrics | None:
    """Hook the scheduler, the prefix index and the saturation detector into the metrics (none of
    them imports the observability layer)."""
    config.scheduler.timer = metrics.plugin_timed
    detector = config.saturation_detector
    metrics.set_saturation_source(lambda: detector.saturation(datastore.endpoints()))
    for plugin in config.plugins.values():
        if isinstance(plugin, ApproxPrefixCacheProducer):
            plugin.observer = metrics.prefix_matched
            metrics.set_prefix_index_size(lambda p=plugin: p.index.entries)
            break
    precise = [p for p in config.plugins.values() if isinstance(p, PrecisePrefixCacheProducer)]
    if precise:
        kv_metrics = PrecisePrefixMetrics(metrics.registry, precise)
        for producer in precise:
            producer.observer = kv_metrics.lookup_observer(producer)
        return kv_metrics  # the runner adds its subscribers' counters
    return None
