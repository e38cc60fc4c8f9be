"""Routing quality in virtual time: the built-in default (predicted latency) against every other
policy, on every shipped workload, at 16 and 100 pods and on a pool that mixes GPU types.

    python -m bench.scale [--quick] [--pools 16,100,8:h100+8:a100] [--workloads a,b] [--seed N] [--jobs 2] [--out DIR]
    python -m bench.scale --pools 50:h100+50:a100 --report scale-100-pods-mixed.md
    python -m bench.scale --pools 50:h100+50:a100 --workloads head-of-line --duration 50 \
        --report scale-100-pods-mixed-hol-50s.md
    python -m bench.scale --pools 16,8:h100+8:a100 --against bench/results/scale.md

Writes `scale.md` under the output directory (default bench/results); progress on stderr.
`--duration` runs every pool for that many seconds of arrivals, up to the workload's own
(default: the workload's, 20 s at 100 pods or more, whose simulations are the slow ones): a
choice whose cost comes late (long generations filling a KV cache over a minute) shows only over
a long enough run. For every pool and workload the same requests, seed and pods go through:

- `epp`: the EPP's built-in default (`predicted-latency`: a predicted time to first token plus what
  the pick costs the pod's later requests, in seconds);
- `epp-weighted`: this project's previous default (the reference's weighted sum, queue 2 +
  KV cache 2 + prefix 3, plus active requests 2);
- `round-robin`, `least-queue` (the shortest scraped queue: the same 50 ms-stale metrics);
- `greedy-oracle`: the least estimated TTFT from the engines' true state at the decision (the
  prompt's real prefix hit on each pod, its real queue, batch and free KV) — greedy, not a bound.

The yardstick (issue 10): on each workload, the default's TTFT p90 ≤ 1.05× and p99 ≤ 1.2× the
best other policy's, with no more errors. The summary marks each case.

`--against REPORT` checks a change to the default in a fifth of the time: with the arguments the
report's header names, it runs the default alone on every case the report holds and weighs it
against the report's other policies (which the change does not touch); it prints the comparison
and writes nothing. A case whose figures are unchanged to the millisecond keeps the report's
verdict (the report's figures are rounded: 81 against 77 ms reads 1.05x either way).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

from bench.sim_common import RESULTS, SimTask, default_jobs, md_table, ms, pct, progress, ratio, run_tasks, write_report
from epp.config.defaults import WEIGHTED_CONFIG
from epp.sim.cluster.report import Report
from epp.sim.cluster.simulate import EppArm, Policy
from epp.sim.cluster.workload import Workload, load_workload

WORKLOADS = ("prefix-heavy", "load-balancing", "head-of-line", "mixed", "b2b-shared-context", "b2b-overload",
             "b2b-kv-pressure", "agentic-multiturn", "zipf-system-prompts", "long-context", "multi-tenant")
DEFAULT = "epp"
POLICIES: tuple[Policy, ...] = (EppArm(DEFAULT, None), EppArm("epp-weighted", WEIGHTED_CONFIG), "round-robin",
                                "least-queue", "greedy-oracle")
P90_BAR, P99_BAR = 1.05, 1.2


@dataclass(slots=True, frozen=True)
class Pool:
    spec: str  # `--pods` of `epp simulate`: a count, or groups such as "8:h100,8:a100"
    duration: float | None  # seconds of arrivals (None: the workload's)
    warmup: float | None

    @property
    def label(self) -> str:
        return self.spec if ":" in self.spec else f"{self.spec} pods"


POOLS = {"16": Pool("16", None, None), "100": Pool("100", 20.0, 8.0),
         "8:h100+8:a100": Pool("8:h100,8:a100", None, None)}
QUICK_POOLS = {"8": Pool("8", 20.0, 5.0)}
TINY_POOLS = {"2": Pool("2", 3.0, 0.5)}  # the test suite's smoke run


def named_pool(name: str) -> Pool:
    """A `--pools` entry: one of `POOLS`, or a count or groups ("50:h100+50:a100"); a pool of 100
    pods or more runs as long as the 100-pod one (20 s of arrivals: its simulations are the slow ones)."""
    if name in POOLS:
        return POOLS[name]
    spec = name.replace("+", ",")
    pods = sum(int(group.split(":")[0]) for group in spec.split(","))
    large = POOLS["100"]
    return Pool(spec, large.duration, large.warmup) if pods >= 100 else Pool(spec, None, None)


def sized(workload: Workload, pool: Pool) -> Workload:
    if pool.duration is None:
        return workload
    return workload.scaled(duration=min(pool.duration, workload.duration),
                           warmup=min(pool.warmup or 0.0, workload.warmup))


def best_other(reports: list[Report], q: int) -> tuple[float, str]:
    others = [(r.overall.ttft[q], r.policy) for r in reports
              if r.policy != DEFAULT and not math.isnan(r.overall.ttft[q])]
    return min(others) if others else (math.nan, "")


def errors(r: Report) -> int:
    return r.requests - r.ok


def case_table(reports: list[Report]) -> str:
    rows = []
    for r in reports:
        others = [x for x in reports if x is not r]
        b90 = min((x.overall.ttft[1] for x in others), default=math.nan)
        b99 = min((x.overall.ttft[2] for x in others), default=math.nan)
        rows.append([f"**{r.policy}**" if r.policy == DEFAULT else r.policy, f"{r.ok}/{r.requests}",
                     ms(r.overall.ttft[0]), ms(r.overall.ttft[1]), ms(r.overall.ttft[2]),
                     ratio(r.overall.ttft[1] / b90), ratio(r.overall.ttft[2] / b99),
                     pct(r.prefix_hit_rate), pct(r.index_accuracy), pct(r.over_claimed), pct(r.behind_share),
                     pct(r.busiest_share), pct(r.prediction_error), f"{r.output_tps:,.0f}"])
    return md_table(["policy", "ok/req", "TTFT p50 ms", "p90", "p99", "p90/best other", "p99/best other",
                     "hit rate", "index accuracy", "over-claimed", "behind ≥ 4k", "busiest pod",
                     "TTFT pred. error", "out tok/s"], rows)


def run_cases(tasks: list[SimTask], jobs: int) -> tuple[dict[tuple[str, str], list[Report]], float]:
    """Run the tasks (labelled "workload/case"); their reports grouped by case, and the wall time."""
    started = time.perf_counter()
    reports = run_tasks(tasks, jobs, progress)
    wall = time.perf_counter() - started
    cases: dict[tuple[str, str], list[Report]] = {}
    for task, report in zip(tasks, reports):
        workload_name, case = task.label.split("/", 1)
        cases.setdefault((workload_name, case), []).append(report)
    return cases, wall


def summary(cases: dict[tuple[str, str], list[Report]]) -> tuple[str, int, int]:
    rows, passed = [], 0
    for (workload, pool), reports in cases.items():
        mine = next(r for r in reports if r.policy == DEFAULT)
        b90, p90 = best_other(reports, 1)
        b99, p99 = best_other(reports, 2)
        r90, r99 = mine.overall.ttft[1] / b90, mine.overall.ttft[2] / b99
        fewest = min(errors(r) for r in reports if r.policy != DEFAULT)
        ok = r90 <= P90_BAR and r99 <= P99_BAR and errors(mine) <= fewest
        passed += ok
        rows.append([workload, pool, ms(mine.overall.ttft[1]), f"{ms(b90)} ({p90})", ratio(r90),
                     ms(mine.overall.ttft[2]), f"{ms(b99)} ({p99})", ratio(r99),
                     f"{errors(mine)} / {fewest}", pct(mine.prediction_error), "yes" if ok else "**no**"])
    table = md_table(["workload", "pool", "epp p90 ms", "best other p90", "ratio", "epp p99 ms", "best other p99",
                      "ratio", "errors (epp / fewest other)", "TTFT pred. error", "within bars"], rows)
    return table, passed, len(rows)


@dataclass(slots=True, frozen=True)
class Committed:
    """One case of a committed report's summary: the default's figures and the best other's."""

    p90: float  # ms
    best90: float
    p99: float
    best99: float
    fewest_errors: int
    errors: int = 0  # the default's
    within: bool = False  # the report's verdict (from unrounded figures)


def read_summary(path: Path) -> dict[tuple[str, str], Committed]:
    """The summary table of a report this module wrote: (workload, pool label) -> its figures."""
    def number(cell: str) -> float:
        return float(cell.split("(")[0].replace(",", "").replace("*", "").strip())

    cases: dict[tuple[str, str], Committed] = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 11 or cells[0] in ("workload", "") or cells[0].startswith("-"):
            continue
        try:
            cases[(cells[0], cells[1])] = Committed(number(cells[2]), number(cells[3]), number(cells[5]),
                                                    number(cells[6]), int(cells[8].split("/")[1]),
                                                    int(cells[8].split("/")[0]), cells[10] == "yes")
        except (ValueError, IndexError):
            continue
    if not cases:
        raise SystemExit(f"{path}: no summary table of bench.scale's shape")
    return cases


def compare(cases: dict[tuple[str, str], list[Report]], against: dict[tuple[str, str], Committed], path: Path) -> str:
    rows, passed = [], 0
    for (workload, pool), reports in cases.items():
        mine, was = reports[0], against[(workload, pool)]
        p90, p99 = mine.overall.ttft[1] * 1e3, mine.overall.ttft[2] * 1e3
        r90, r99 = p90 / was.best90, p99 / was.best99
        ok = r90 <= P90_BAR and r99 <= P99_BAR and errors(mine) <= was.fewest_errors
        if f"{p90:,.0f}" == f"{was.p90:,.0f}" and f"{p99:,.0f}" == f"{was.p99:,.0f}" and errors(mine) == was.errors:
            ok = was.within  # unchanged to the ms: the report's verdict, not one from its rounded figures
        passed += ok
        rows.append([workload, pool, f"{was.p90:,.0f} → {p90:,.0f}", f"{was.best90:,.0f}", ratio(r90),
                     f"{was.p99:,.0f} → {p99:,.0f}", f"{was.best99:,.0f}", ratio(r99),
                     f"{errors(mine)} / {was.fewest_errors}", "yes" if ok else "**no**"])
    table = md_table(["workload", "pool", "epp p90 ms (report → now)", "best other p90", "ratio",
                      "epp p99 ms (report → now)", "best other p99", "ratio", "errors (epp / fewest other)",
                      "within bars"], rows)
    return f"Against {path}: the default within the bars on {passed} of {len(rows)} cases.\n\n{table}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 pods, 20 s per workload")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # smoke test: 2 pods, 3 s
    parser.add_argument("--pools", default="", help=f"comma-separated, of {', '.join(POOLS)} (a count works too)")
    parser.add_argument("--workloads", default="", help="comma-separated shipped workloads or files")
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="parallel simulations")
    parser.add_argument("--seed", type=int, default=1, help="the requests' random seed (the reports: 1)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--report", default="", help="the report's file name under --out (default: scale.md, "
                                                       "scale-quick.md with --quick)")
    parser.add_argument("--duration", type=float, default=0.0,
                        help="seconds of arrivals on every pool, up to the workload's own "
                             "(default: the workload's; 20 at 100 pods or more)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds left out of the figures, with --duration")
    parser.add_argument("--against", type=Path, default=None,
                        help="a committed report run with the same arguments: run the default alone and compare")
    args = parser.parse_args(argv)
    if args.duration and not 0.0 <= args.warmup < args.duration:
        parser.error(f"--warmup must be at least 0 and below --duration ({args.duration:g} s)")
    pools = TINY_POOLS if args.tiny else QUICK_POOLS if args.quick else POOLS
    if args.pools:
        tiny = TINY_POOLS["2"]
        pools = {name: Pool(name.replace("+", ","), tiny.duration, tiny.warmup) if args.tiny else named_pool(name)
                 for name in args.pools.split(",")}
    if args.duration:
        pools = {name: Pool(pool.spec, args.duration, args.warmup) for name, pool in pools.items()}
    workloads = args.workloads.split(",") if args.workloads else list(WORKLOADS)

    against = read_summary(args.against) if args.against else None
    tasks = []
    for workload_name in workloads:
        for pool in pools.values():
            if against is not None and (workload_name, pool.label) not in against:
                continue
            workload = sized(load_workload(workload_name), pool)
            for policy in POLICIES if against is None else POLICIES[:1]:
                tasks.append(SimTask(f"{workload_name}/{pool.label}", workload, policy, pool.spec,  # type: ignore[arg-type]
                                     seed=args.seed))
    cases, wall = run_cases(tasks, args.jobs)
    if against is not None:
        print(compare(cases, against, args.against))
        return 0
    table, passed, total = summary(cases)
    command = "".join([" --quick" if args.quick else "", f" --pools {args.pools}" if args.pools else "",
                       f" --workloads {args.workloads}" if args.workloads else "",
                       f" --seed {args.seed}" if args.seed != 1 else "",
                       f" --duration {args.duration:g} --warmup {args.warmup:g}" if args.duration else "",
                       f" --report {args.report}" if args.report else ""])
    lines = [
        "# Routing quality in virtual time",
        "",
        f"`python -m bench.scale{command}` — {len(tasks)} simulations, "
        f"{wall:.0f} s on this machine. Every policy of a case ran the same requests (same seed) on a fresh "
        "pool of vLLM v1 engines (`epp/sim`: real tokenizer, vLLM 0.32's block pool and scheduler, step "
        "times from `shared/calibration`), seeing metrics 50 ms stale as in production.",
        "",
        f"**The default within the bars (TTFT p90 ≤ {P90_BAR}×, p99 ≤ {P99_BAR}× the best other policy, no "
        f"more errors): {passed} of {total} cases.**",
        "",
        table,
        "",
        "Columns of the case tables: *hit rate* is the engines' own prefix-cache counters; *index accuracy* "
        "how much of what the router believed the chosen pod held it really held (Σ min / Σ max of believed "
        "and true cached tokens); *over-claimed* the picks that counted on a prefix the pod no longer had; "
        "*behind ≥ 4k* the picks that queued behind at least 4,096 more uncached prefill tokens than the "
        "least loaded pod had; *busiest pod* its share of requests; *TTFT pred. error* the median "
        "|predicted − observed| / observed of a predicting router.",
        "",
    ]
    for (workload_name, pool_label), case in cases.items():
        w = load_workload(workload_name)
        lines += [f"## {workload_name}, {pool_label}", "", f"*{w.description}*", "", case_table(case), ""]
    text = "\n".join(lines)
    path = args.out / (args.report or ("scale-quick.md" if args.quick else "scale.md"))
    if args.tiny:
        path = args.out / "scale.md"
    write_report(path, text, wall)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
