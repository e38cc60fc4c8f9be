"""Helpers for the virtual-time benchmarks (`bench.flowcontrol`, `bench.scale`): running
simulations (in parallel processes: every run is independent and deterministic), progress on
stderr, Markdown tables and number formatting.

Each figure a report compares comes from runs of the same workload, seed and pool, so the ratios
hold whatever the machine's speed; wall times are shown only as the cost of the benchmark.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from epp.sim.cluster.report import Report
from epp.sim.cluster.simulate import Policy, run_policy
from epp.sim.cluster.workload import Workload

RESULTS = Path(__file__).parent / "results"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(slots=True, frozen=True)
class SimTask:
    """One simulation: a workload, a policy (or EPP arm) and a pool size."""

    label: str
    workload: Workload
    policy: Policy
    pods: int | str  # a count, or a `--pods` spec ("8:h100,8:a100")
    seed: int = 1
    horizon: float | None = None


def _run(task: SimTask) -> Report:
    return run_policy(task.workload, task.policy, pods=task.pods, seed=task.seed, horizon=task.horizon,
                      max_tenants=20)


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def run_tasks(tasks: Sequence[SimTask], jobs: int = 1,
              done: Callable[[SimTask, Report], None] | None = None) -> list[Report]:
    """Run every task (in `jobs` processes), results in task order; `done` hears each as it ends."""
    results: list[Report | None] = [None] * len(tasks)
    if jobs <= 1 or len(tasks) <= 1:
        for i, task in enumerate(tasks):
            results[i] = _run(task)
            if done:
                done(task, results[i])  # type: ignore[arg-type]
    else:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(jobs) as pool:
            pending = {i: pool.apply_async(_run, (task,)) for i, task in enumerate(tasks)}
            while pending:
                for i in sorted(pending):
                    if pending[i].ready():
                        results[i] = pending.pop(i).get()
                        if done:
                            done(tasks[i], results[i])  # type: ignore[arg-type]
                time.sleep(0.05)
    return [r for r in results if r is not None]


def write_report(path: Path, text: str, wall: float) -> None:
    """Write a benchmark's Markdown report (its directory made), say where, and print it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    log(f"wrote {path} ({wall:.0f} s)")
    print(text)


def progress(task: SimTask, report: Report) -> None:
    log(f"{task.label}: {report.policy} on {task.pods} pods: {report.ok}/{report.requests} served, "
        f"{report.end_time:.0f} s virtual in {report.wall_seconds:.1f} s")


# -- formatting --


def ms(v: float | None) -> str:
    return "–" if v is None or math.isnan(v) else f"{v * 1000:,.0f}"


def sec(v: float | None) -> str:
    return "–" if v is None or math.isnan(v) else f"{v:,.2f}"


def pct(v: float | None) -> str:
    return "–" if v is None or math.isnan(v) else f"{v:.1%}"


def ratio(v: float | None) -> str:
    return "–" if v is None or math.isnan(v) or math.isinf(v) else f"{v:.2f}×"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def errors_text(errors: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "–"


def pyplot():  # type: ignore[no-untyped-def]
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
