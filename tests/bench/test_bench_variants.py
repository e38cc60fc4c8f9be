"""`bench.variants`: each variant is a shipped workload on a pool the simulator accepts, and none is
a case the scale reports already run (their pools on seed 1)."""

from __future__ import annotations

import pytest

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


def test_the_stress_set_is_runnable_and_is_not_a_shipped_case() -> None:
    """Its workload files load with names of their own (no shipped workload's), and its shipped
    workloads run at a rate no report runs."""
    from epp.sim.cluster.workload import builtin_names

    shipped = set(builtin_names())
    written = {}
    for v in variants.STRESS:
        workload = load_workload(v.workload)
        assert workload.classes
        assert parse_pods(v.pods)
        if v.workload in shipped:
            assert v.rate > 1.1
        else:
            assert workload.name not in shipped
            written[workload.name] = workload
    assert len(written) == sum(1 for v in variants.STRESS if v.workload not in shipped)
    served = written["multi-tenant-kv-heavy-served"]
    assert all((c.priority or 0) >= 0 for c in served.classes)  # nothing legacy admission may shed


@pytest.mark.parametrize("name", ["fresh", "sweep"])
def test_a_never_tuned_set_repeats_no_case_of_another_set(name: str) -> None:
    """Its value is that nothing was tuned on it: no case of the reports or of another set."""
    never_tuned = variants.SETS[name].cases
    others = {(v.workload, v.pods, v.seed, v.rate)
              for other, chosen in variants.SETS.items() if other != name for v in chosen.cases}
    cases = {(v.workload, v.pods, v.seed, v.rate) for v in never_tuned}
    assert len(cases) == len(never_tuned) and not cases & others
    reported = {p.spec for p in (*POOLS.values(), *QUICK_POOLS.values())} | {"4:h100,12:a100"}
    for v in never_tuned:
        assert load_workload(v.workload).classes
        assert parse_pods(v.pods)
        assert v.pods not in reported or v.seed > 7  # the reports run seeds 1-5, the variants 2-7
