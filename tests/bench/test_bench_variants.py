"""`bench.variants`: each variant is a shipped workload on a pool the simulator accepts, and none is
a case the scale reports already run (their pools on seed 1)."""

from __future__ import annotations

from bench import variants
from bench.scale import POOLS, QUICK_POOLS
from epp.sim.cluster.simulate import parse_pods
from epp.sim.cluster.workload import load_workload


def test_every_variant_is_runnable_and_none_repeats_a_report() -> None:
    reported = {p.spec for p in (*POOLS.values(), *QUICK_POOLS.values())} | {"4:h100,12:a100"}
    for v in variants.VARIANTS:
        assert load_workload(v.workload).classes
        assert parse_pods(v.pods)
        assert v.seed != 1 or v.pods not in reported or v.rate != 1.0
    assert len({(v.workload, v.pods, v.seed, v.rate) for v in variants.VARIANTS}) == len(variants.VARIANTS)
