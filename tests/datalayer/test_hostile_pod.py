"""One pod of three reports garbage metrics: the pool is not shed, the garbage is not routed to.

The EPP runs in-process with its real scraper against three real HTTP `/metrics` servers (two
serve a captured vLLM exposition, one the same with hostile values) and is driven over real
gRPC ext_proc. Before the data layer checked values, the bad pod's `kv_cache_usage_perc` of 1e308
became the pool's mean and every sheddable request got 429 while the other pods were idle.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import channel_to, running_picker
from tests.extproc.client import ExtProcClient, body_msg, headers_msg, request_headers, set_headers

from .helpers import fixture_body, wait_until

IDLE = fixture_body("idle")
GARBAGE = (IDLE
           .replace(b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0',
                    b'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 1e308')
           .replace(b'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
                    b'vllm:num_requests_waiting{engine="0",model_name="tiny"} NaN')
           .replace(b'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
                    b'vllm:num_requests_running{engine="0",model_name="tiny"} -5e300'))

# The reference's default profile; a staleness bound generous enough for a loaded test machine.
PROFILE = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
{gates}
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- {{type: utilization-detector, parameters: {{metricsStalenessThreshold: 5s}}}}
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: queue-scorer, weight: 2}}
  - {{pluginRef: kv-cache-utilization-scorer, weight: 2}}
  - {{pluginRef: prefix-cache-scorer, weight: 3}}
"""


async def metrics_server(body: bytes) -> TestServer:
    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.fixture
async def pods() -> AsyncIterator[list[str]]:
    servers = [await metrics_server(body) for body in (IDLE, IDLE, GARBAGE)]
    yield [f"127.0.0.1:{s.port}" for s in servers]
    for server in servers:
        await server.close()


@pytest.mark.parametrize("gates", ["", "featureGates: [flowControl]"], ids=["legacy-admission", "flow-control"])
async def test_a_pod_reporting_garbage_sheds_nothing_and_gets_nothing(pods: list[str], gates: str) -> None:
    bad = pods[2]
    async with running_picker(static_endpoints=",".join(pods), config_text=PROFILE.format(gates=gates),
                              refresh_metrics_interval=0.02) as picker, channel_to(picker) as channel:
        picker.datastore.set_objective("batch", -1)  # sheddable
        endpoints = {ep.address: ep for ep in picker.datastore.endpoints()}
        await wait_until(lambda: all(endpoints[a].metrics.update_time > 0 for a in pods[:2])
                         and (endpoints[bad].metrics.update_time > 0 or endpoints[bad].scrape_error != ""),
                         "every pod scraped")

        # Ties between the two idle pods break at random: 32 picks all landing on one is a 2**-31 chance
        # (12 were 1 in 2,048, and CI drew it once).
        picked: list[str] = []
        for i in range(32):
            client = ExtProcClient(channel)
            await client.send(headers_msg(request_headers(**{"x-gateway-inference-objective": "batch"})),
                              body_msg(orjson.dumps({"model": "tiny", "prompt": f"request {i}"})))
            (reply, *_) = await client.recv(2)
            assert not reply.HasField("immediate_response"), reply.immediate_response.body
            picked.append(set_headers(reply)["x-gateway-destination-endpoint"])
            await client.close()
        assert set(picked) <= set(pods[:2]) and len(set(picked)) == 2
        assert not endpoints[bad].metrics_valid and endpoints[bad].scrape_error.startswith("invalid metrics: ")
        assert endpoints[bad].metrics.update_time == 0  # nothing it reported was taken
        assert picker.config.saturation_detector.saturation(list(endpoints.values())) == pytest.approx(1 / 3)

        await wait_until(lambda: sum(ep.inflight_requests for ep in endpoints.values()) == 0, "requests released")
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{picker.metrics_port}/metrics") as r:
                text = await r.text()
    fams = {f.name: f for f in text_string_to_metric_families(text)}

    def value(family: str, **labels: str) -> float:
        return next(s.value for s in fams[family].samples if all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("inference_pool_average_kv_cache_utilization") == 0.0  # the bad pod is left out
    assert value("inference_pool_average_queue_size") == 0.0
    assert value("inference_extension_flow_control_pool_saturation") == pytest.approx(1 / 3)
    assert value("inference_pool_endpoint_scrape_up", endpoint=bad) == 0.0
    for metric in ("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert value("inference_pool_endpoint_invalid_metric_samples", endpoint=bad, metric=metric) >= 1
    invalid_endpoints = {s.labels["endpoint"] for s in fams["inference_pool_endpoint_invalid_metric_samples"].samples}
    assert invalid_endpoints == {bad}


async def test_when_every_pod_reports_garbage_requests_still_go_somewhere() -> None:
    """Fail open for the pick (as with stale metrics): a pool whose exporters all misbehave
    still serves its non-sheddable traffic."""
    servers = [await metrics_server(GARBAGE) for _ in range(2)]
    try:
        addresses = [f"127.0.0.1:{s.port}" for s in servers]
        async with running_picker(static_endpoints=",".join(addresses), config_text=PROFILE.format(gates=""),
                                  refresh_metrics_interval=0.02) as picker, channel_to(picker) as channel:
            await wait_until(lambda: not any(ep.metrics_valid for ep in picker.datastore.endpoints()), "scrapes")
            client = ExtProcClient(channel)
            await client.send(headers_msg(request_headers()), body_msg(orjson.dumps({"model": "tiny", "prompt": "x"})))
            (reply, *_) = await client.recv(2)
            assert set_headers(reply)["x-gateway-destination-endpoint"] in addresses
            await client.close()
            await asyncio.sleep(0)
    finally:
        for server in servers:
            await server.close()
