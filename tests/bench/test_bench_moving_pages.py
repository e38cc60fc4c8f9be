"""The moving pages stay faithful to vLLM's /metrics, whose `?name[]=` filter is prometheus_client's."""

from __future__ import annotations

from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.exposition import _bake_output

from bench.moving_pages import _Pod, _template
from bench.stubpods import metrics_page
from epp.datalayer.engines import BUILTIN_ENGINES
from epp.datalayer.promparse import parse_wanted
from epp.sim.exposition import restrict


def test_restrict_serves_what_prometheus_client_serves_for_name_filters() -> None:
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "Running.", ["engine", "model_name"], registry=registry)
    running.labels("0", "m").set(3)
    Gauge("vllm:other", "Not asked for.", registry=registry).set(1)
    itl = Histogram("vllm:inter_token_latency_seconds", "ITL.", ["engine", "model_name"], registry=registry)
    itl.labels("0", "m").observe(0.02)
    info = Gauge("vllm:cache_config_info", "Config.", ["block_size", "engine"], registry=registry)
    info.labels("16", "0").set(1)
    query = BUILTIN_ENGINES["vllm"].query
    _, _, served = _bake_output(registry, "text/plain", "", parse_qs(query), True)
    names = set(parse_qs(query)["name[]"])
    ours = restrict(generate_latest(registry), names)
    # the same lines (prometheus_client orders the families it collects as its set of collectors)
    assert sorted(ours.splitlines()) == sorted(served.splitlines())
    assert b"vllm:other" not in ours and b"_bucket" not in ours and b"_created" not in ours


def test_a_restricted_moving_page_reads_as_the_whole_one() -> None:
    mapping = BUILTIN_ENGINES["vllm"]
    names = set(parse_qs(mapping.query)["name[]"])
    whole, restricted = _template(), _template(names)
    a, b = _Pod(*whole, seed=5), _Pod(*whole, seed=5)
    for _ in range(3):
        full, small = a.page(), b.page(restricted)
        wanted = [*mapping.primary.names, *mapping.fallback.names]
        assert parse_wanted(small, wanted) == parse_wanted(full, wanted)
        assert len(small) < len(full) / 10
    assert restrict(metrics_page(), {"nothing:here"}) == b""
