"""The TGI engine mapping on TGI-shaped /metrics (tests/fixtures/tgi-3.3, sources in its README)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from epp.datalayer import CoreMetricsExtractor, MetricsScraper
from epp.datalayer.engines import BUILTIN_ENGINES, TGI_MAPPING
from epp.datastore import Datastore, Endpoint, EndpointMetrics, EndpointSpec

from .helpers import fixture_body, wait_until
from .test_scraper import FakeModelServer

TGI = Path(__file__).resolve().parents[1] / "fixtures" / "tgi-3.3"
BUSY = (TGI / "metrics-busy.txt").read_bytes()
FRESH = (TGI / "metrics-fresh.txt").read_bytes()


def endpoint(engine: str = "tgi", labels: tuple[tuple[str, str], ...] = ()) -> Endpoint:
    return Endpoint(EndpointSpec("tgi-0", "10.0.0.1", 8080, engine=engine, labels=labels))


def test_tgi_is_a_builtin_engine_without_kv_lora_or_block_metrics() -> None:
    assert BUILTIN_ENGINES["tgi"] is TGI_MAPPING
    assert [s.name for s in TGI_MAPPING.queued] == ["tgi_queue_size"]
    assert [s.name for s in TGI_MAPPING.running] == ["tgi_batch_current_size"]
    assert [s.name for s in TGI_MAPPING.itl] == ["tgi_request_mean_time_per_token_duration"]
    assert TGI_MAPPING.kv_usage == () and TGI_MAPPING.lora == () and TGI_MAPPING.cache_info == ()
    assert "no KV-cache utilisation" in TGI_MAPPING.caveat


def test_a_busy_tgi_reads_its_queue_and_batch_and_never_a_kv_value() -> None:
    result = CoreMetricsExtractor().extract(endpoint(), BUSY, now=1.0)
    assert result.problems == ()
    assert result.metrics == EndpointMetrics(waiting_queue_size=3, running_requests=8, update_time=1.0)
    assert result.metrics.kv_cache_usage == 0.0  # not exported: never invented from the batch tokens


def test_inter_token_latency_is_the_window_mean_of_the_per_request_histogram() -> None:
    ex = CoreMetricsExtractor()
    ep = endpoint()
    first = ex.extract(ep, BUSY, now=1.0).metrics
    assert first is not None and first.inter_token_latency == 0.0  # the first scrape is the baseline
    ep.metrics = first
    later = BUSY.replace(b"tgi_request_mean_time_per_token_duration_sum 0.9420870467830725",
                         b"tgi_request_mean_time_per_token_duration_sum 1.0420870467830725")
    later = later.replace(b"tgi_request_mean_time_per_token_duration_count 42",
                          b"tgi_request_mean_time_per_token_duration_count 46")
    second = ex.extract(ep, later, now=2.0).metrics
    assert second is not None and second.inter_token_latency == pytest.approx(0.1 / 4)


def test_a_tgi_that_has_seen_no_request_is_idle_not_broken() -> None:
    # TGI creates its gauges on first use: a fresh server's /metrics is empty.
    result = CoreMetricsExtractor().extract(endpoint(), FRESH, now=1.0)
    assert result.metrics == EndpointMetrics(update_time=1.0) and result.problems == ()
    # Some requests failed validation before any was queued: other tgi_ families, no gauges yet.
    early = b"# TYPE tgi_request_count counter\ntgi_request_count 2\n\n"
    assert CoreMetricsExtractor().extract(endpoint(), early, now=1.0).metrics == EndpointMetrics(update_time=1.0)


def test_a_pod_labelled_tgi_that_is_not_is_reported_not_zeroed() -> None:
    result = CoreMetricsExtractor().extract(endpoint(), fixture_body("busy"), now=1.0)  # vLLM's /metrics
    assert result.metrics is None
    assert result.problems == ("tgi_queue_size: not found", "tgi_batch_current_size: not found")


def test_the_engine_comes_from_the_label_or_the_static_files_field() -> None:
    ex = CoreMetricsExtractor()
    assert ex.engine_of(endpoint("tgi")) == "tgi"
    assert ex.engine_of(endpoint("", (("inference.networking.k8s.io/engine-type", "tgi"),))) == "tgi"
    assert ex.mapping_for(ex.engine_of(endpoint("tgi"))) is TGI_MAPPING
    assert CoreMetricsExtractor(default_engine="tgi").engine_of(endpoint("")) == "tgi"


async def test_the_scraper_says_once_per_pod_what_tgi_cannot_tell(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="epp.datalayer")
    server = await FakeModelServer().start()
    server.body = FRESH
    datastore = Datastore()
    scraper = MetricsScraper(datastore, interval=0.02)
    await scraper.start()
    try:
        ep = datastore.upsert(replace(server.spec("tgi-a"), engine="tgi"))
        stats = scraper.stats(ep.address)
        assert stats is not None
        await wait_until(lambda: stats.scrapes >= 2, "two scrapes of a fresh TGI")
        assert ep.scrape_error == "" and ep.metrics.update_time > 0 and ep.metrics.waiting_queue_size == 0
        server.body = BUSY
        await wait_until(lambda: ep.metrics.running_requests == 8, "the busy TGI")
        assert ep.metrics.waiting_queue_size == 3
    finally:
        await scraper.stop()
        await server.close()
    said = [r.getMessage() for r in caplog.records if "exports no KV-cache utilisation" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("endpoint tgi-a: engine 'tgi': TGI exports no KV-cache")


def test_a_gauge_created_on_first_use_is_seen_at_once_with_page_memory() -> None:
    from epp.datalayer.promparse import PageMemory

    ex = CoreMetricsExtractor()
    ep = endpoint()
    memory = PageMemory(recheck_absent=100)
    first = ex.extract(ep, FRESH, now=1.0, memory=memory).metrics
    assert first is not None and first.waiting_queue_size == 0
    ep.update_metrics(first)
    expected = ex.extract(ep, BUSY, now=2.0).metrics  # without memory
    later = ex.extract(ep, BUSY, now=2.0, memory=memory).metrics  # the gauges exist now: seen at once
    assert later is not None and later == expected and later.waiting_queue_size > 0
