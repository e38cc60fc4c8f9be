"""One call to compare policies on a workload: `simulate(workload, pods=N, policies=[...])`.

Every policy runs the same workload with the same seed on a fresh cluster (fresh engines and
caches), one after the other; the reports are comparable figure by figure. The EPP can appear
several times with different configs (`EppArm`s), e.g. the default and a tuned one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from epp.sim.cluster.cluster import Cluster
from epp.sim.cluster.epp_router import EppRouter
from epp.sim.cluster.kv_feed import DEFAULT_DELAY
from epp.sim.cluster.report import Report, build_report
from epp.sim.cluster.routers import POLICY_ALIASES, REFERENCE_POLICIES, Router, reference_router
from epp.sim.cluster.workload import Workload
from epp.sim.pool import PodGroup, describe_pool, group_config, parse_pods

POLICIES = ("epp", *REFERENCE_POLICIES)


@dataclass(slots=True, frozen=True)
class EppArm:
    """The EPP with one EndpointPickerConfig (None: the built-in default)."""

    name: str = "epp"
    config_text: str | None = None


Policy = str | EppArm
Progress = Callable[[str], None]


def expand_policies(names: Sequence[str], arms: Sequence[EppArm] = ()) -> list[Policy]:
    """Policy names (`all` = every one) with `epp` replaced by the given EPP arms."""
    wanted: list[str] = []
    for name in names:
        for part in name.split(","):
            part = part.strip()
            if part == "all":
                wanted.extend(POLICIES)
            elif part:
                if part not in POLICIES and part not in POLICY_ALIASES:
                    raise ValueError(f"unknown policy {part!r} (known: {', '.join(POLICIES)}, all; "
                                     f"alias: {', '.join(POLICY_ALIASES)})")
                wanted.append(part)
    out: list[Policy] = []
    for name in dict.fromkeys(wanted):
        if name == "epp":
            out.extend(arms or [EppArm()])
        else:
            out.append(name)
    return out


def make_router(policy: Policy, *, seed: int, refresh_interval: float = 0.05) -> Router:
    if isinstance(policy, EppArm):
        return EppRouter(policy.config_text, name=policy.name, seed=seed, refresh_interval=refresh_interval)
    if policy == "epp":
        return EppRouter(None, seed=seed, refresh_interval=refresh_interval)
    return reference_router(policy, seed)


Pods = int | str | Sequence[PodGroup]


def run_policy(workload: Workload, policy: Policy, *, pods: Pods, seed: int | None = None,
               refresh_interval: float = 0.05, horizon: float | None = None, max_tenants: int = 0,
               kv_events_delay: float = DEFAULT_DELAY) -> Report:
    """One policy on a fresh cluster; the report carries the run's wall time."""
    seed = workload.seed if seed is None else seed
    router = make_router(policy, seed=seed, refresh_interval=refresh_interval)
    started = time.perf_counter()
    result = Cluster(workload, router, pods=pods, seed=seed, refresh_interval=refresh_interval,
                     horizon=horizon, kv_events_delay=kv_events_delay).run()
    return build_report(result, time.perf_counter() - started, max_tenants=max_tenants)


def simulate(workload: Workload, *, pods: Pods, policies: Sequence[Policy] = ("epp",),
             seed: int | None = None, refresh_interval: float = 0.05, horizon: float | None = None,
             max_tenants: int = 0, progress: Progress | None = None,
             kv_events_delay: float = DEFAULT_DELAY) -> list[Report]:
    """Run each policy on the workload (same seed), in order; `progress` hears a line per run.

    `pods`: a count, a `--pods` spec ("8:h100,8:a100:max_num_seqs=64") or its parsed groups."""
    if isinstance(pods, (int, str)):
        pods = parse_pods(pods)
    if progress and (len(pods) > 1 or pods[0].profile or pods[0].settings):
        engine = workload.sim_config().engine
        blocks = ", ".join(str(group_config(g, engine, workload.engine).num_gpu_blocks) for g in pods)
        source = " (the workload's num_gpu_blocks)" if "num_gpu_blocks" in workload.engine else ""
        progress(f"{workload.name}: pods {describe_pool(pods, engine.step_profile)}; "
                 f"KV blocks per pod, by group: {blocks}{source}")
    reports = []
    for policy in policies:
        name = policy.name if isinstance(policy, EppArm) else policy
        if progress:
            progress(f"{workload.name}: {name} on {sum(g.count for g in pods)} pods ...")
        report = run_policy(workload, policy, pods=pods, seed=seed, refresh_interval=refresh_interval,
                            horizon=horizon, max_tenants=max_tenants, kv_events_delay=kv_events_delay)
        if progress:
            progress(f"{workload.name}: {name}: {report.ok}/{report.requests} served, "
                     f"{report.end_time:.0f} s virtual in {report.wall_seconds:.1f} s")
        reports.append(report)
    return reports
