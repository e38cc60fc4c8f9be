"""Variants of the scale reports' cases, for what the reports cannot show: a change tuned on
their pools and seeds that only holds there.

    python -m bench.variants [--set variants|stress|fresh|sweep] [--jobs 2] [--out DIR]
    python -m bench.variants --set stress --against bench/results/stress.md

Each variant is a shipped workload on a pool, seed or rate the reports do not run (other splits
of H100 and A100 pods, smaller and larger pools, seeds 2-7, 0.9-1.1x the rate); every policy of
`bench.scale` runs it on the same requests, and the summary marks it against the same bars (TTFT
p90 <= 1.05x, p99 <= 1.2x the best other policy, no more errors). Writes `variants.md` under the
output directory (default bench/results); ~10 min on 2 cores.

`--set stress` runs the stress set instead (`stress.md`, ~5 min): issue 10's shapes with other
parameters, written for it under bench/workloads-sim/stress/ (fewer or more shared contexts,
steeper popularity, deeper agent sessions, a KV-heavy tenant mix with and without sheddable
batch, twice the long share of the head-of-line mix), and shipped workloads at 1.3x their rate —
where the pools' KV caches fill.

`--set fresh` runs cases written after the default's design had settled (session 48, at commit
9d8ab1f) and never tuned on (`fresh.md`, ~7 min): pools mostly of the fast GPU type (12 H100 +
4 A100, 10 + 6), 24 pods, seeds 8-12, 0.8-1.2x the rate. Keep it that way: a change that loses
here was tuned to the other reports; do not tune to it in turn.

`--set sweep` (`sweep.md`, ~8 min) was written in session 49 the same way: half its cases at
0.5-0.6x the rate, where no other set runs (a lightly loaded pool is where the greedy oracle is
strongest), half on pool sizes and mixes no other set runs. The same rule holds.

`--against REPORT` checks a change to the default in a fraction of the time, as `bench.scale`'s
does: the default alone on the set's cases, against the committed report's other policies.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from bench.scale import POLICIES, compare, read_summary, run_cases, summary
from bench.sim_common import RESULTS, SimTask, default_jobs, write_report
from epp.sim.cluster.workload import load_workload


@dataclass(slots=True, frozen=True)
class Variant:
    workload: str  # a shipped workload's name, or a workload file
    pods: str  # `--pods` of `epp simulate`
    seed: int
    rate: float = 1.0

    @property
    def label(self) -> str:
        rate = f", ×{self.rate:g} rate" if self.rate != 1.0 else ""
        return f"{self.pods} pods, seed {self.seed}{rate}"


VARIANTS = (
    Variant("mixed", "6:h100,10:a100", 7),
    Variant("mixed", "2:h100,14:a100", 4, 1.1),
    Variant("mixed", "16", 3),
    Variant("head-of-line", "2:h100,6:a100", 5, 0.9),
    Variant("head-of-line", "16", 2),
    Variant("b2b-shared-context", "4:h100,12:a100", 4),
    Variant("b2b-overload", "4:h100,12:a100", 2),
    Variant("b2b-kv-pressure", "8:h100,8:a100", 2),
    Variant("agentic-multiturn", "8:h100,8:a100", 3),
    Variant("zipf-system-prompts", "4:h100,12:a100", 6),
    Variant("long-context", "6:h100,10:a100", 2),
    Variant("multi-tenant", "8:h100,8:a100", 5),
    Variant("load-balancing", "2:h100,10:a100", 3),
)

_STRESS = Path(__file__).parent / "workloads-sim" / "stress"

STRESS = (
    Variant(str(_STRESS / "b2b-few-long-contexts.yaml"), "16", 1),
    Variant(str(_STRESS / "b2b-many-short-contexts.yaml"), "8:h100,8:a100", 1),
    Variant(str(_STRESS / "b2b-hot-contexts.yaml"), "16", 1),
    Variant(str(_STRESS / "agentic-deep-sessions.yaml"), "8:h100,8:a100", 1),
    Variant(str(_STRESS / "zipf-steep.yaml"), "16", 1),
    Variant(str(_STRESS / "long-context-few-documents.yaml"), "16", 1),
    Variant(str(_STRESS / "multi-tenant-kv-heavy.yaml"), "8:h100,8:a100", 1),
    Variant(str(_STRESS / "multi-tenant-kv-heavy-served.yaml"), "8:h100,8:a100", 1),
    Variant(str(_STRESS / "head-of-line-heavy.yaml"), "16", 1),
    Variant("head-of-line", "16", 1, 1.3),
    Variant("multi-tenant", "8:h100,8:a100", 1, 1.3),
)

FRESH = (
    Variant("mixed", "12:h100,4:a100", 8),
    Variant("head-of-line", "12:h100,4:a100", 9),
    Variant("b2b-shared-context", "24", 10),
    Variant("agentic-multiturn", "16", 11, 1.15),
    Variant("zipf-system-prompts", "8:h100,8:a100", 12, 1.2),
    Variant("long-context", "12:h100,4:a100", 8),
    Variant("multi-tenant", "16", 9, 0.8),
    Variant("prefix-heavy", "10:h100,6:a100", 10),
    Variant("b2b-kv-pressure", "16", 11),
    Variant("load-balancing", "8:h100,8:a100", 12),
    Variant("b2b-overload", "12:h100,4:a100", 3),
)

# Written in session 49 and run once, like the fresh set: half at 0.5-0.6x the rate (no other set
# runs a pool that lightly loaded), half on pools of sizes and mixes no other set runs.
SWEEP = (
    Variant("mixed", "16", 13, 0.5),
    Variant("head-of-line", "8:h100,8:a100", 14, 0.5),
    Variant("agentic-multiturn", "12", 15, 0.6),
    Variant("zipf-system-prompts", "16", 16, 0.5),
    Variant("multi-tenant", "6:h100,6:a100", 17, 0.6),
    Variant("b2b-shared-context", "16", 18, 0.5),
    Variant("long-context", "16", 19, 0.5),
    Variant("prefix-heavy", "8:h100,8:a100", 20, 0.6),
    Variant("load-balancing", "32", 21),
    Variant("agentic-multiturn", "4:h100,8:a100", 22, 0.9),
    Variant("b2b-kv-pressure", "6:h100,6:a100", 23),
    Variant("zipf-system-prompts", "20", 24, 1.1),
    Variant("head-of-line", "12", 25, 1.1),
    Variant("multi-tenant", "32", 26),
    Variant("long-context", "4:h100,12:a100", 27),
    Variant("b2b-overload", "16", 28, 0.8),
)

@dataclass(slots=True, frozen=True)
class CaseSet:
    """A set of variants and how its report describes them."""

    cases: tuple[Variant, ...]
    title: str  # the report's heading
    what: str  # the report's one-line description
    unit: str = "cases"  # what the summary counts


SETS = {
    "variants": CaseSet(VARIANTS, "variants", "The scale reports' workloads on pools, seeds and rates they do not run",
                        unit="variants"),
    "stress": CaseSet(STRESS, "the stress set",
                      "Issue 10's shapes with parameters no report runs (workload files under "
                      "bench/workloads-sim/stress/) and shipped workloads at 1.3x their rate"),
    "fresh": CaseSet(FRESH, "the fresh set",
                     "Cases written after the default's design had settled and never tuned on: pools mostly of the "
                     "fast GPU type, 24 pods, seeds and rates no other report runs"),
    "sweep": CaseSet(SWEEP, "the sweep set",
                     "Cases written in session 49 and never tuned on: half at 0.5-0.6x the rate, half on pool "
                     "sizes and mixes no other report runs (12, 20 and 32 pods; 6+6, 4+8 and 4+12 mixes)"),
}

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.variants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", choices=tuple(SETS), default="variants", dest="which",
                        help="the variants of the shipped workloads, the stress set, or a never-tuned set (fresh, sweep)")
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="parallel simulations")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--against", type=Path, default=None,
                        help="the set's committed report: run the default alone and compare (as bench.scale's)")
    args = parser.parse_args(argv)
    which = args.which
    chosen = SETS[which]
    tasks = []
    for v in chosen.cases:
        workload = load_workload(v.workload)
        if v.rate != 1.0:
            workload = workload.scaled(rate=v.rate)
        for policy in POLICIES if args.against is None else POLICIES[:1]:
            tasks.append(SimTask(f"{workload.name}/{v.label}", workload, policy, v.pods, seed=v.seed))
    if args.against is not None:
        against = read_summary(args.against)
        cases, _ = run_cases(tasks, args.jobs)
        print(compare(cases, against, args.against))
        return 0
    cases, wall = run_cases(tasks, args.jobs)
    table, passed, total = summary(cases)
    option = "" if which == "variants" else f" --set {which}"
    text = "\n".join([
        f"# Routing quality in virtual time: {chosen.title}",
        "",
        f"`python -m bench.variants{option}` — {len(tasks)} simulations, {wall:.0f} s "
        f"on this machine. {chosen.what}; every policy of a case ran the same requests "
        "(`bench.scale` says how).",
        "",
        f"**The default within the bars: {passed} of {total} {chosen.unit}.**",
        "",
        table,
        "",
    ])
    write_report(args.out / f"{which}.md", text, wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
