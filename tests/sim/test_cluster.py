"""The virtual-time cluster: the EPP's real request path on simulated pods, and the reference
policies it is compared with. Behaviour, not constants; no wall-clock assertions."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from epp.config.defaults import DEFAULT_CONFIG
from epp.datalayer.engines import BUILTIN_ENGINES
from epp.datalayer.extract import extract_metrics
from epp.datastore import EndpointMetrics
from epp.sim.cluster.cluster import Cluster
from epp.sim.cluster.epp_router import EppRouter
from epp.sim.cluster.pods import ClusterPod
from epp.sim.cluster.report import build_report, render_text
from epp.sim.cluster.routers import LeastQueueRouter, reference_router
from epp.sim.cluster.simulate import EppArm, expand_policies, run_policy, simulate
from epp.sim.cluster.traffic import Job
from epp.sim.cluster.vloop import VirtualTimeLoop, run_virtual
from epp.sim.cluster.workload import load_workload, parse_workload
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.exposition import Exposition
from epp.sim.factory import RequestFactory
from epp.sim.metrics import VllmMetrics

FLOW_CONTROL = DEFAULT_CONFIG + """featureGates: [flowControl]
flowControl:
  defaultPriorityBand:
    fairnessPolicyRef: round-robin-fairness-policy
    dispatchGate: {queueDepthThreshold: 3}
"""

FLOOD = """
name: flood
duration: 10
classes:
- {name: a, tenants: [user-a], arrival: {process: burst, count: 150, at: 0}, prompt: 1500, output: 300}
- {name: b, tenants: [user-b], arrival: {process: burst, count: 1, at: 1}, prompt: 300, output: 20}
"""

SMALL = """
name: small
duration: 6
warmup: 1
objectives: {gold: 3}
classes:
- {name: chat, rate: 6, objective: gold, prompt: 300, output: 60, tenants: 3,
   prefix: {groups: 3, tokens: 500}, chat: {turns: 3, think_time: 0.5, message: 40}, slo_ttft_ms: 200}
- {name: batch, rate: 3, priority: -1, prompt: {dist: uniform, min: 500, max: 1500}, output: 100}
"""


def _without_wall(report: Any) -> dict[str, Any]:
    data = report.to_json()
    data.pop("wall_seconds")
    return data


def test_same_seed_same_report_for_every_policy_and_flow_control() -> None:
    w = parse_workload(SMALL)
    policies = expand_policies(["all"], [EppArm("epp"), EppArm("epp-fc", FLOW_CONTROL)])
    first = simulate(w, pods=2, policies=policies, seed=5)
    second = simulate(w, pods=2, policies=policies, seed=5)
    assert [r.policy for r in first] == ["epp", "epp-fc", "random", "round-robin", "least-queue", "greedy-oracle"]
    for a, b in zip(first, second):
        assert json.dumps(_without_wall(a)) == json.dumps(_without_wall(b))
        assert a.ok > 0 and a.errors == {}
    other = simulate(w, pods=2, policies=["random"], seed=6)[0]
    assert _without_wall(other) != _without_wall(first[2])


class _Spy(EppRouter):
    """Records, at each pick, what the EPP saw of the chosen pod and what was true."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[float, float, int, int]] = []

    async def route(self, job: Job) -> int:
        pod = await super().route(job)
        m = self.endpoints[pod].metrics
        engine = self.cluster.pods[pod].engine
        self.seen.append((self.cluster.loop.time(), m.update_time, m.waiting_queue_size + m.running_requests,
                          len(engine.waiting) + len(engine.running)))
        return pod


def test_the_epp_sees_scraped_metrics_not_the_truth() -> None:
    w = parse_workload("""
duration: 5
classes:
- {name: a, arrival: {process: burst, count: 40, at: 1.01}, prompt: 400, output: 50}
- {name: b, rate: 10, prompt: 400, output: 50}
""")
    spy = _Spy(seed=1, refresh_interval=0.05)
    Cluster(w, spy, pods=2, seed=1, refresh_interval=0.05).run()
    assert spy.seen
    for now, updated, _, _ in spy.seen:
        assert 0 < updated <= now
        assert now - updated <= 0.05 + 1e-9  # never older than one refresh interval
    # Within the burst the scraped load lags behind what the pods really hold.
    assert any(scraped != truth for _, _, scraped, truth in spy.seen)
    assert any(now > updated for now, updated, _, _ in spy.seen)


def test_without_metric_collection_the_epp_gets_no_metrics() -> None:
    config = DEFAULT_CONFIG.split("dataLayer:")[0] + "dataLayer: {sources: []}\n"
    spy = _Spy(config, seed=1)
    Cluster(parse_workload("duration: 3\nclasses: [{name: a, rate: 5}]"), spy, pods=2, seed=1).run()
    assert spy.seen and all(updated == 0.0 for _, updated, _, _ in spy.seen)


def test_a_scrape_is_what_the_data_layer_reads_from_the_pods_metrics() -> None:
    loop = VirtualTimeLoop()
    cfg = EngineConfig(record_token_times=False)
    pod = ClusterPod(0, cfg, loop, on_finish=lambda r: None)
    hist = VllmMetrics(cfg.max_model_len)
    update = pod.engine.update

    def recording_update(out):  # type: ignore[no-untyped-def]
        step = update(out)
        hist.record_step(step)
        return step

    pod.engine.update = recording_update  # type: ignore[method-assign]
    exposition = Exposition("m", cfg, created=0.0)
    factory = RequestFactory(SimConfig(engine=cfg), seed=1)
    mapping = BUILTIN_ENGINES["vllm"]

    async def main() -> list[tuple[EndpointMetrics, EndpointMetrics]]:
        pairs = []
        previous = EndpointMetrics()
        for i in range(60):
            pod.add(factory.synthetic(800, 200, arrival_time=loop.time(), request_id=f"r{i}"))
        for t in (0.2, 0.7, 1.5):
            await asyncio.sleep(t - loop.time())
            ours = pod.scrape(loop.time())
            body = exposition.render(pod.engine, hist).encode()
            theirs = extract_metrics(mapping, body, previous, loop.time()).metrics
            assert theirs is not None
            previous = theirs
            pairs.append((ours, theirs))
        return pairs

    pairs = run_virtual(main(), loop)
    for ours, theirs in pairs:
        assert ours.waiting_queue_size == theirs.waiting_queue_size
        assert ours.running_requests == theirs.running_requests
        assert ours.kv_cache_usage == pytest.approx(theirs.kv_cache_usage, abs=1e-6)
        assert (ours.cache_block_size, ours.cache_num_blocks) == (theirs.cache_block_size, theirs.cache_num_blocks)
        assert ours.update_time == theirs.update_time
    # ITL: the same window means; ours counts each decode step's duration per decoding request.
    for ours, theirs in pairs[1:]:
        assert theirs.inter_token_latency > 0
        assert ours.inter_token_latency == pytest.approx(theirs.inter_token_latency, rel=0.15)


def _class_ttft(report: Any, name: str) -> float:
    return next(g for g in report.by_class if g.name == name).ttft[0]


def test_flow_control_in_virtual_time_keeps_a_flood_from_starving_another_tenant() -> None:
    flood = parse_workload(FLOOD)
    idle = parse_workload(FLOOD.replace(
        "- {name: a, tenants: [user-a], arrival: {process: burst, count: 150, at: 0}, prompt: 1500, output: 300}\n", ""))
    assert [c.name for c in idle.classes] == ["b"]
    alone = _class_ttft(run_policy(idle, "epp", pods=2), "b")
    without = run_policy(flood, EppArm("no-fc"), pods=2)
    with_fc = run_policy(flood, EppArm("fc", FLOW_CONTROL), pods=2)
    b_without, b_with = _class_ttft(without, "b"), _class_ttft(with_fc, "b")
    assert b_with < b_without / 3  # B no longer waits behind A's whole burst ...
    assert b_with < alone + 0.5  # ... only behind what the pods were already working on
    assert with_fc.flow_control and max(with_fc.queue_series["router_queued"]) > 0
    assert with_fc.ok == without.ok == 151  # nothing lost: A's requests were held, not dropped


def test_the_oracle_beats_random_on_a_prefix_heavy_workload() -> None:
    w = load_workload("prefix-heavy").scaled(duration=14)
    oracle = run_policy(w, "oracle", pods=4)
    rand = run_policy(w, "random", pods=4)
    assert oracle.prefix_hit_rate > rand.prefix_hit_rate + 0.1
    assert oracle.overall.ttft[0] < rand.overall.ttft[0]


def test_reference_policies_route_as_they_say() -> None:
    w = parse_workload("duration: 4\nclasses: [{name: a, rate: 25, prompt: 200, output: 20}]")
    rr = run_policy(w, "round-robin", pods=4)
    counts = [round(s * rr.ok) for s in rr.pod_share]
    assert max(counts) - min(counts) <= 1
    rnd = run_policy(w, "random", pods=4)
    assert all(s > 0 for s in rnd.pod_share)
    assert all(r.ok == r.requests for r in (rr, rnd))
    with pytest.raises(ValueError, match="unknown policy"):
        reference_router("fastest")


def test_least_queue_reads_only_the_scraped_queue() -> None:
    router = LeastQueueRouter(seed=1)
    router.metrics = [EndpointMetrics(waiting_queue_size=3), EndpointMetrics(waiting_queue_size=1, running_requests=9),
                      EndpointMetrics(waiting_queue_size=1, running_requests=2)]
    picks = {run_virtual(router.route(None)) for _ in range(5)}  # type: ignore[arg-type]
    assert picks == {2}


def test_legacy_admission_sheds_sheddable_requests_when_saturated() -> None:
    w = parse_workload("""
duration: 8
classes:
- {name: batch, priority: -1, rate: 400, prompt: 2000, output: 400}
""")
    report = run_policy(w, "epp", pods=1)
    assert report.errors.get("saturated", 0) > 0
    assert report.by_class[0].errors == report.errors


def test_requests_still_open_at_the_horizon_are_reported_unfinished() -> None:
    w = parse_workload("duration: 2\nclasses: [{name: a, rate: 20, prompt: 500, output: 2000}]")
    router = reference_router("round-robin")
    result = Cluster(w, router, pods=1, seed=1, horizon=3.0).run()
    report = build_report(result)
    assert result.unfinished > 0 and report.errors.get("unfinished") == result.unfinished
    assert "unfinished" in render_text([report])


def test_flow_control_order_reaches_the_engine_as_vllm_priority() -> None:
    config = FLOW_CONTROL + "  vllmPriority: {enabled: true}\n"
    w = parse_workload("""
duration: 3
engine: {scheduling_policy: priority}
classes:
- {name: a, tenants: [t], arrival: {process: burst, count: 30, at: 0.5}, prompt: 1000, output: 50}
""")
    priorities: list[int] = []

    class Spy(EppRouter):
        async def route(self, job: Job) -> int:
            pod = await super().route(job)
            assert job.request is not None
            priorities.append(job.request.priority)
            return pod

    Cluster(w, Spy(config, seed=1), pods=1, seed=1).run()
    assert len(priorities) == 30 and priorities[0] == 0 and max(priorities) > 0
