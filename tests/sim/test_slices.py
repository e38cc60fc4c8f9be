"""Token slices in the virtual-time cluster: every request is served in full, a continuation where
its predecessor ran reuses the cached blocks, one elsewhere pays the re-prefill, and a pool that
is not saturated serves the same throughput."""

from __future__ import annotations

import pytest

from epp.sim.cluster.cluster import Cluster
from epp.sim.cluster.report import build_report
from epp.sim.cluster.routers import RoundRobinRouter
from epp.sim.cluster.simulate import make_router
from epp.sim.cluster.slices import SlicedCluster, run_sliced
from epp.sim.cluster.workload import parse_workload

WORKLOAD = """
name: slices
duration: 10
engine: {num_gpu_blocks: 2000, max_num_seqs: 8, step_profile: a100-llama3-8b}
classes:
- name: short
  rate: 4
  prompt: {dist: uniform, min: 150, max: 600}
  output: {dist: uniform, min: 16, max: 48}
  tenants: 3
- name: long
  rate: 0.5
  prompt: 110
  output: {dist: uniform, min: 300, max: 500}
"""


def test_a_sliced_request_is_served_whole_as_one_client_request() -> None:
    w = parse_workload(WORKLOAD)
    plain = Cluster(w, make_router("epp", seed=1), pods=2, seed=1).run()
    router = make_router("epp", seed=1)
    sliced, stats = run_sliced(w, router, pods=2, seed=1, slice_tokens=64)
    assert len(sliced.jobs) == len(plain.jobs)  # slices are not client requests
    assert all(j.ok for j in sliced.jobs) and sliced.unfinished == 0
    by_id = {j.id: j for j in plain.jobs}
    for j in sliced.jobs:
        assert j.generated == by_id[j.id].generated == j.output_tokens  # every token, once
    longs = [j for j in sliced.jobs if j.output_tokens > 64]
    assert longs and stats.requests_sliced == len(longs)
    assert stats.slices == sum(-(-j.output_tokens // 64) for j in longs)
    assert len(stats.gaps) == stats.slices - len(longs) and min(stats.gaps) > 0
    # The EPP routes a continuation back to the pod holding its prefix: the blocks are reused and
    # only the last, partial block (plus vLLM's one recomputed token) is prefilled again.
    assert stats.moved <= stats.slices // 10
    assert stats.reprefill_share < 0.1
    # Nothing left anywhere: the EPP released every slice exactly once.
    assert [ep.inflight_requests for ep in router.endpoints] == [0, 0]  # type: ignore[attr-defined]


def test_a_continuation_elsewhere_prefills_what_that_pod_has_not_cached() -> None:
    w = parse_workload(WORKLOAD.split("- name: short")[0] + "- name: long\n  arrival: {process: burst, count: 1}\n"
                       "  prompt: 110\n  output: 450\n")
    cluster = SlicedCluster(w, RoundRobinRouter(), pods=2, seed=1, slice_tokens=100)
    cluster.run()
    stats = cluster.slice_stats
    assert stats.slices == 5 and stats.moved == 4  # round robin sends each slice to the other pod
    # Prompts of the continuations: p + 100, p + 200, ... (p: the first prompt, 110 tokens and the
    # tokenizer's BOS). Slice 1 finds nothing on pod 1; each later slice finds the full 16-token
    # blocks of the sequence (prompt and output) two slices before it — the previous slice's prompt —
    # and prefills the rest again.
    p = cluster.jobs[0].prompt_tokens
    prompts = [p + 100 * k for k in range(1, 5)]
    assert stats.continuation_prompt_tokens == sum(prompts)
    assert stats.reprefill_tokens == prompts[0] + sum(prompts[k] - prompts[k - 1] // 16 * 16 for k in range(1, 4))


def test_slicing_costs_no_throughput_on_a_pool_that_keeps_up() -> None:
    w = parse_workload(WORKLOAD)
    plain = build_report(Cluster(w, make_router("epp", seed=1), pods=2, seed=1).run())
    sliced = build_report(SlicedCluster(w, make_router("epp", seed=1), pods=2, seed=1, slice_tokens=64).run())
    assert sliced.output_tps == pytest.approx(plain.output_tps, rel=0.02)
    assert sliced.ok == plain.ok


def test_slice_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="slice_tokens"):
        SlicedCluster(parse_workload(WORKLOAD), RoundRobinRouter(), pods=1, slice_tokens=0)
