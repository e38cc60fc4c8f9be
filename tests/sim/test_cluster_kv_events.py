"""KV-cache events in the virtual-time cluster: one batch per step per pod, delivered in-process
at virtual time + delay, seq from 0 per pod, and enough to rebuild each engine's cache exactly."""

from __future__ import annotations

from collections import Counter

import pytest

from epp.cli import main
from epp.sim.cluster.cluster import Cluster
from epp.sim.cluster.kv_feed import DEFAULT_DELAY
from epp.sim.cluster.routers import RoundRobinRouter
from epp.sim.cluster.workload import parse_workload
from epp.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

# A small KV cache (299 usable blocks of 16 tokens) and ~800-token prompts with shared prefixes:
# blocks are stored, hit and evicted.
EVICTING = """
name: evicting
duration: 4
warmup: 0
engine: {num_gpu_blocks: 300, max_model_len: 2048, max_num_seqs: 8}
classes:
- {name: a, rate: 8, prompt: 300, output: 30, prefix: {groups: 4, tokens: 500}}
"""


class Subscribed(RoundRobinRouter):
    """Round-robin that listens to every pod's KV events, as a precise prefix index would."""

    name = "subscribed"

    def __init__(self) -> None:
        super().__init__()
        self.got: list[tuple[float, int, int, EventBatch]] = []

    def attach(self, cluster: Cluster) -> None:  # type: ignore[override]
        super().attach(cluster)
        cluster.kv_events.subscribe(self.on_events)

    def on_events(self, pod: int, seq: int, batch: EventBatch) -> None:
        self.got.append((self.cluster.loop.time(), pod, seq, batch))


def run(router: RoundRobinRouter, **kw: float) -> Cluster:
    cluster = Cluster(parse_workload(EVICTING), router, pods=3, seed=3, **kw)  # type: ignore[arg-type]
    cluster.run()
    return cluster


@pytest.mark.parametrize("delay", [DEFAULT_DELAY, 0.0, 0.25])
def test_subscriber_gets_every_step_in_order_after_the_delay(delay: float) -> None:
    router = Subscribed()
    cluster = run(router, kv_events_delay=delay)
    assert router.got, "no events"
    per_pod: dict[int, list[int]] = {}
    kinds: Counter[str] = Counter()
    for t, pod, seq, batch in router.got:
        assert t == pytest.approx(batch.ts + delay, abs=1e-9)  # virtual time: exact
        assert batch.data_parallel_rank == 0 and batch.events
        per_pod.setdefault(pod, []).append(seq)
        kinds.update(type(e).__name__ for e in batch.events)
    assert set(per_pod) == {0, 1, 2}
    for pod, seqs in per_pod.items():
        assert seqs == list(range(len(seqs)))
        # Batches still in flight when the last request ends are never delivered (the run is over).
        assert len(seqs) <= cluster.kv_events.next_seq(pod)
        if delay == 0:
            assert len(seqs) == cluster.kv_events.next_seq(pod)
    assert kinds["BlockStored"] > 0 and kinds["BlockRemoved"] > 0
    assert cluster.kv_events.delivered == len(router.got)


def test_events_rebuild_each_engines_cache() -> None:
    """Stores minus removals, per pod, is exactly what the engine holds at the end (the block pool
    does not deduplicate, so a hash can be cached twice and removed once)."""
    router = Subscribed()
    cluster = run(router, kv_events_delay=0.0)
    mirror = [Counter[int]() for _ in cluster.pods]
    for _, pod, _, batch in router.got:
        for e in batch.events:
            if isinstance(e, BlockStored):
                mirror[pod].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                mirror[pod].subtract(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                mirror[pod].clear()
    for pod, held in zip(cluster.pods, mirror, strict=True):
        live = {h for h, n in held.items() if n > 0}
        assert all(n >= 0 for n in held.values())
        assert len(live) == pod.engine.kv.num_cached_blocks and all(pod.engine.kv.is_cached(h) for h in live)


def test_no_subscriber_costs_nothing() -> None:
    cluster = run(RoundRobinRouter())
    assert not cluster.kv_events.active and cluster.kv_events.delivered == 0
    for pod in cluster.pods:
        assert pod.kv_feed is None and not pod.engine.config.enable_kv_cache_events
        assert pod.engine.take_kv_events() == []


def test_same_seed_same_stream() -> None:
    a, b = Subscribed(), Subscribed()
    run(a)
    run(b)
    assert [(t, p, s, e.events) for t, p, s, e in a.got] == [(t, p, s, e.events) for t, p, s, e in b.got]


def test_simulate_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--workload", "mixed", "--pods", "1", "--duration", "1",
                 "--policy", "round-robin", "--kv-events-delay", "2ms"]) == 0
    assert main(["simulate", "--workload", "mixed", "--kv-events-delay", "-1"]) == 2
    assert "--kv-events-delay: must be >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=">= 0"):
        Cluster(parse_workload(EVICTING), RoundRobinRouter(), pods=1, kv_events_delay=-0.1)
