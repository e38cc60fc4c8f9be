"""How far a policy's picks were from the greedy oracle's, by the oracle's own estimate: the
diagnostic behind BENCHMARKS.md round 46.

    python -m bench.regret --workload head-of-line --pods 16 --rate-scale 1.3 [--policy epp] [--seed 1]

At every pick, right after the policy chose, the greedy oracle estimates from the engines' true
state what each pod's time to first token would be (`OracleRouter.estimate`); a pick's regret is
its pod's estimate minus the best one. Per request class: how many picks, the regret's mean, p90
and p99, the share over 50 ms and, for the EPP, what those were: *overridden* where the EPP's own
prediction also had the oracle's pod faster (its cost's externality outweighed the TTFT), else
*mispredicted*. A report's miss against the oracle is then either a cost that buys something
else with this request's wait, or a prediction that is wrong — two different fixes. The oracle
is greedy and its estimate is not the truth, so a policy can beat it with regret; read the
classes where the TTFT tail lives. Where the estimate is crude the regrets are its own: on a pod
past its batch slots it counts one step per request ahead (the engine-mix pool's 32-slot pods,
`head-of-line`: a mean regret of 4.2 s for short picks whose real TTFT p90 is ~1.2 s). Virtual
time, one run, no file written.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from bench.sim_common import md_table
from epp.sim.cluster.cluster import Cluster
from epp.sim.cluster.routers import OracleRouter
from epp.sim.cluster.simulate import make_router
from epp.sim.cluster.traffic import Job
from epp.sim.cluster.workload import load_workload
from epp.sim.pool import parse_pods

REGRET_SECONDS = 0.05  # a pick this much slower than the oracle's best, by its estimate, counts


@dataclass(slots=True)
class ClassRegret:
    """One request class's picks after warm-up."""

    name: str
    regrets: list[float] = field(default_factory=list)  # seconds, one per pick
    overridden: int = 0  # of those over REGRET_SECONDS: the EPP's own prediction had the other pod faster
    mispredicted: int = 0  # ... had its own pick faster

    def quantile(self, q: float) -> float:
        ordered = sorted(self.regrets)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def measure(workload_name: str, pods: str, *, policy: str = "epp", seed: int = 1,
            rate_scale: float = 1.0, duration: float | None = None) -> list[ClassRegret]:
    """Run `policy` on the workload and weigh each of its picks after warm-up with the oracle."""
    workload = load_workload(workload_name)
    if rate_scale != 1.0 or duration is not None:
        workload = workload.scaled(rate=rate_scale, duration=duration)
    router = make_router(policy, seed=seed)
    oracle = OracleRouter(seed)
    classes = [ClassRegret(c.name) for c in workload.classes]
    route = router.route

    async def weighed(job: Job) -> int:
        pod = await route(job)
        if job.arrival < workload.warmup or job.request is None:
            return pod
        if not hasattr(oracle, "cluster"):
            oracle.attach(router.cluster)
        estimates = [oracle.estimate(i, job) for i in range(len(router.cluster.pods))]
        best = min(range(len(estimates)), key=estimates.__getitem__)
        regret = max(0.0, estimates[pod] - estimates[best])
        cls = classes[job.cls]
        cls.regrets.append(regret)
        own = router.predicted_ttfts()
        if regret > REGRET_SECONDS and own is not None:
            if own[pod] > own[best]:
                cls.overridden += 1
            else:
                cls.mispredicted += 1
        return pod

    router.route = weighed  # type: ignore[method-assign]
    Cluster(workload, router, pods=parse_pods(pods), seed=seed).run()
    return classes


def report(classes: list[ClassRegret]) -> str:
    rows = []
    for c in classes:
        n = len(c.regrets)
        over = sum(1 for r in c.regrets if r > REGRET_SECONDS)
        rows.append([c.name, f"{n:,}", f"{1e3 * sum(c.regrets) / n:.1f}" if n else "–",
                     f"{1e3 * c.quantile(0.9):.0f}", f"{1e3 * c.quantile(0.99):.0f}",
                     f"{over / n:.1%}" if n else "–",
                     f"{c.overridden:,} / {c.mispredicted:,}" if c.overridden + c.mispredicted else "–"])
    return md_table(["class", "picks", "regret mean ms", "p90", "p99", f"over {REGRET_SECONDS * 1e3:.0f} ms",
                     "of those: overridden / mispredicted"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.regret", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, help="a shipped workload's name or a workload file")
    parser.add_argument("--pods", default="16", help="as `epp simulate --pods` (default 16)")
    parser.add_argument("--policy", default="epp", help="epp, or a reference policy")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals (default: the workload's)")
    args = parser.parse_args(argv)
    classes = measure(args.workload, args.pods, policy=args.policy, seed=args.seed, rate_scale=args.rate_scale,
                      duration=args.duration)
    print(report(classes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
