"""What an SRE sees: metrics after real traffic through Envoy, decision traces, `epp status`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.local.stack import LocalStack, StackConfig
from epp.sim.config import EngineConfig, SimConfig
from epp.status import fetch, render
from tests.conftest import channel_to, running_picker
from tests.extproc.client import ExtProcClient, body_msg, headers_msg, request_headers, set_headers

FAST = SimConfig(time_scale=0.05, engine=EngineConfig(max_num_seqs=8, num_gpu_blocks=4096))
# Steps at real speed (tens of ms a response): an observer stream whose first message the EPP reads
# only after the picking stream ended finds its request released and reports nothing
# (`epp.extproc.observer`); with responses of a few ms, a loaded machine reordered the two.
REAL_SPEED = SimConfig(time_scale=1.0, engine=FAST.engine)


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.e2e
async def test_metrics_after_traffic_through_envoy() -> None:
    async with LocalStack(StackConfig(pods=2, sim=REAL_SPEED, debug_decision_header=True)) as stack:
        assert stack.picker is not None
        async with aiohttp.ClientSession() as session:
            for i in range(6):
                async with session.post(f"{stack.url}/v1/completions", json={
                        "model": FAST.model, "prompt": f"shared prefix for metrics {i % 2} " * 20,
                        "max_tokens": 3}) as r:
                    assert r.status == 200
                    decision = r.headers.get("x-epp-decision", "")
                    assert decision.startswith("pick=127.0.0.1:"), decision
                    assert "latency-scorer=" in decision and "ttft=" in decision
            async with session.post(f"{stack.url}/v1/completions", data=b"{bad json") as r:
                assert r.status == 400
            await asyncio.sleep(0.2)  # at least one scrape of every pod
            async with session.get(f"http://127.0.0.1:{stack.picker.metrics_port}/metrics") as r:
                text = await r.text()
    fams = families(text)
    requests = fams["inference_objective_request"]
    assert sum(s.value for s in requests.samples if s.name.endswith("_total")) == 6
    assert {s.labels["priority"] for s in requests.samples} == {"0"}
    attempts = [s for s in fams["inference_extension_scheduler_attempts"].samples if s.name.endswith("_total")]
    assert sum(s.value for s in attempts if s.labels["status"] == "success") == 6
    assert {s.labels["pod_name"] for s in attempts} <= {p.address for p in stack.pods}
    assert fams["inference_extension_scheduler_e2e_duration_seconds"].samples
    plugin_types = {s.labels["plugin_type"] for s in fams["inference_extension_plugin_duration_seconds"].samples}
    assert {"latency-scorer", "predicted-latency-producer", "approx-prefix-cache-producer", "max-score-picker",
            "slo-headroom-tier-filter"} <= plugin_types
    assert next(s.value for s in fams["inference_pool_ready_pods"].samples) == 2
    ages = [s.value for s in fams["inference_pool_endpoint_metrics_age_seconds"].samples]
    assert len(ages) == 2 and all(0 <= a < 2 for a in ages)
    assert all(s.value == 1 for s in fams["inference_pool_endpoint_scrape_up"].samples)
    assert [s.value for s in fams["inference_pool_endpoint_stalled_seconds"].samples] == [0.0, 0.0]
    assert "inference_extension_flow_control_pool_saturation" in fams
    hit = [s for s in fams["inference_extension_prefix_indexer_hit_ratio"].samples if s.name.endswith("_count")]
    assert hit[0].value == 6
    assert next(s.value for s in fams["inference_extension_prefix_indexer_size"].samples) > 0
    out = [s for s in fams["inference_objective_output_tokens"].samples if s.name.endswith("_sum")]
    assert out[0].value == 18  # 6 requests x 3 tokens, read from the responses' usage
    assert next(s.value for s in fams["inference_objective_running_requests"].samples) == 0


async def test_decision_trace_explains_the_pick(caplog: pytest.LogCaptureFixture) -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        picker.datastore.get("10.0.0.2:8000").inflight_requests = 5  # busy by our own count
        with caplog.at_level(logging.DEBUG, logger="epp.decision"):
            client = ExtProcClient(channel)
            await client.send(headers_msg(request_headers(x_request_id="trace-me")),
                              body_msg(orjson.dumps({"model": "m", "prompt": "why here?"})))
            picked = set_headers((await client.recv(2))[0])["x-gateway-destination-endpoint"]
    record = next(r for r in caplog.records if getattr(r, "decision", {}).get("request_id") == "trace-me")
    decision = record.decision  # type: ignore[attr-defined]
    assert decision["targets"] == [picked]
    by_address = {c["address"]: c for c in decision["candidates"]}
    assert set(by_address) == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    assert by_address["10.0.0.2:8000"]["scores"]["active-request-scorer"] == 0.0
    assert by_address[picked]["total"] == max(c["total"] for c in decision["candidates"])
    assert picked != "10.0.0.2:8000"


async def test_shed_and_errors_are_traced_with_their_reason() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        picker.datastore.set_objective("batch", -5)
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers(**{"x-gateway-inference-objective": "batch"})),
                          body_msg(orjson.dumps({"model": "m", "prompt": "x"})))
        await client.recv(1)
        latest = picker.trace.latest(1)[0]
        assert (latest.outcome, latest.http_status, latest.priority) == ("saturated", 429, -5)


async def test_epp_status_shows_endpoints_and_decisions() -> None:
    async with running_picker() as picker, channel_to(picker) as channel:
        client = ExtProcClient(channel)
        await client.send(headers_msg(request_headers()), body_msg(orjson.dumps({"model": "m", "prompt": "hello"})))
        await client.recv(2)
        status = await asyncio.to_thread(fetch, f"127.0.0.1:{picker.admin_port}", 5)
    assert status.ready and len(status.endpoints) == 3 and status.requests_total == 1
    assert status.decisions[0].outcome == "picked" and len(status.decisions[0].candidates) == 3
    assert all(ep.metrics_age_seconds == -1 for ep in status.endpoints)  # never scraped: metrics off here
    text = render(status)
    assert "10.0.0.1:8000" in text and "never" in text and "RECENT DECISIONS" in text


async def test_metrics_bearer_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    async with running_picker(metrics_bearer_token_file=str(token)) as picker:
        url = f"http://127.0.0.1:{picker.metrics_port}/metrics"
        async with aiohttp.ClientSession() as session:
            async with session.get(url) as r:
                assert r.status == 401
            async with session.get(url, headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
            async with session.get(url, headers={"Authorization": "Bearer s3cret"}) as r:
                assert r.status == 200 and "inference_pool_ready_pods" in await r.text()


async def test_epp_status_shows_a_pods_learned_batch_limit() -> None:
    """vLLM does not export max_num_seqs; the limit its scrapes revealed is what the slot wait
    and flow control's slot ledger use, so an SRE sees it next to the service model."""
    async with running_picker() as picker:
        ep = picker.datastore.endpoints()[0]
        for kv in (0.1, 0.2, 0.3):  # full at 8 with requests waiting, KV room, each after a step
            ep.batch_limit.observe(8, 3, kv, 0, 8192)
        status = await asyncio.to_thread(fetch, f"127.0.0.1:{picker.admin_port}", 0)
    limits = {s.address: s.batch_limit for s in status.endpoints}
    assert limits[ep.address] == 8 and sorted(limits.values()) == [0, 0, 8]
    table = render(status)
    assert "SLOTS" in table
    row = next(line for line in table.splitlines() if line.startswith(ep.address) and line.rstrip().endswith(" 8"))
    assert row
