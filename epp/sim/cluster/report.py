"""From a run's raw requests to the numbers people compare: latency percentiles per class and
tenant, throughput, prefix-cache hit rate, queues over time, errors by reason.

Percentiles are nearest-rank over the requests that arrived after the warm-up. TTFT and
end-to-end latency run from the client's arrival (so time queued in flow control counts); ITL
per request is its mean time between output tokens; the per-token ITL percentiles come from
every decode step of every pod. The prefix-cache hit rate is the engines' own counters (hit
tokens / queried tokens), as vLLM's `prefix_cache_hits` / `prefix_cache_queries` would show.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from epp.sim.cluster.cluster import RunResult
from epp.sim.cluster.diagnostics import BEHIND_TOKENS
from epp.sim.cluster.traffic import Job

Triple = tuple[float, float, float]
NAN3: Triple = (math.nan, math.nan, math.nan)


def pct(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (nan when empty)."""
    if not sorted_values:
        return math.nan
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[i]


def triple(values: Iterable[float]) -> Triple:
    s = sorted(values)
    return (pct(s, 0.5), pct(s, 0.9), pct(s, 0.99))


def quantiles(values: Iterable[float], steps: int = 100) -> list[float]:
    """Values at q = 0, 1/steps, ..., 1 (empty for no values)."""
    s = sorted(values)
    if not s:
        return []
    return [s[min(len(s) - 1, round(i * (len(s) - 1) / steps))] for i in range(steps + 1)]


def weighted_triple(hist: dict[float, int]) -> Triple:
    """p50/p90/p99 of a value -> count histogram."""
    total = sum(hist.values())
    if not total:
        return NAN3
    out = []
    items = sorted(hist.items())
    for q in (0.5, 0.9, 0.99):
        rank = max(1, math.ceil(q * total))
        acc = 0
        for value, n in items:
            acc += n
            if acc >= rank:
                out.append(value)
                break
    return (out[0], out[1], out[2])


@dataclass(slots=True)
class GroupStats:
    """One class or tenant (or everything)."""

    name: str
    requests: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttft: Triple = NAN3  # seconds
    itl: Triple = NAN3  # per-request mean ITL, seconds
    e2e: Triple = NAN3
    queue: Triple = NAN3  # arrival to dispatch (the router's queue), seconds
    output_tokens: int = 0
    slo_ttft: float | None = None
    slo_attained: float | None = None  # share of the group's requests served within the TTFT SLO


@dataclass(slots=True)
class Report:
    policy: str
    workload: str
    pods: int
    seed: int
    flow_control: bool
    requests: int
    ok: int
    errors: dict[str, int]
    window: float  # seconds the throughput is measured over (see `throughput`)
    throughput_rps: float
    output_tps: float
    prefix_hit_rate: float
    preemptions: int
    overall: GroupStats
    token_itl: Triple
    by_class: list[GroupStats]
    by_tenant: list[GroupStats]
    queue_series: dict[str, list[float]]  # time, waiting, running, router_queued, kv_usage
    pod_load: list[list[int]]  # per sample: waiting + running per pod
    pod_share: list[float]  # share of served requests per pod
    end_time: float
    unfinished: int
    ttft_quantiles: list[float] = field(default_factory=list)  # TTFT at q = 0, 0.01, ..., 1 (CDF plots)
    wall_seconds: float = 0.0
    # Why (see `diagnostics`): share of picks that queued behind >= 4k more uncached prefill
    # tokens than the least loaded pod had; the router's prefix-index accuracy (Σ min(believed,
    # true) / Σ max over the picks it believed anything about) and the share of picks where it
    # claimed a cached prefix the engine did not have (4+ blocks and a quarter of the claim); the
    # median |predicted - observed| / observed
    # TTFT of a predicting router.
    behind_share: float = math.nan
    index_accuracy: float = math.nan
    over_claimed: float = math.nan
    prediction_error: float = math.nan
    busiest_share: float = math.nan
    # Share of engine steps outside the step-time model's calibrated range (extrapolated timing).
    steps_out_of_range: float = 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return _clean(data)


def _clean(value: Any) -> Any:
    """NaN -> None, so the JSON is standard."""
    if isinstance(value, float):
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def group(name: str, jobs: Sequence[Job], slo: float | None = None) -> GroupStats:
    ok = [j for j in jobs if j.ok]
    errors = Counter(j.error for j in jobs if j.error)
    g = GroupStats(
        name=name, requests=len(jobs), ok=len(ok), errors=dict(sorted(errors.items())),
        ttft=triple(j.first_token - j.arrival for j in ok),
        itl=triple((j.finish - j.first_token) / (j.generated - 1) for j in ok if j.generated > 1),
        e2e=triple(j.finish - j.arrival for j in ok),
        queue=triple(j.dispatch - j.arrival for j in jobs if j.dispatch >= 0),
        output_tokens=sum(j.generated for j in ok), slo_ttft=slo,
    )
    if slo is not None and jobs:
        g.slo_attained = sum(1 for j in ok if j.first_token - j.arrival <= slo) / len(jobs)
    return g


def throughput(run: RunResult, jobs: Sequence[Job]) -> tuple[float, float, float]:
    """(window, requests/s, output tokens/s) while requests were arriving.

    Measured between the end of the warm-up and the last arrival, from the cumulative counters
    sampled during the run, so a backlog drained after the arrivals stop does not dilute it: an
    overloaded pool shows its capacity, a pool that keeps up shows the offered load. Runs too short
    for two samples fall back to everything served over first arrival to last finish.
    """
    samples = run.samples
    start = max(run.workload.warmup, min((j.arrival for j in jobs), default=0.0))
    stop = min(run.workload.duration, max((j.arrival for j in jobs), default=start))
    inside = [x for x in samples if start <= x.time <= stop]
    if len(inside) >= 3:
        a, b = inside[0], inside[-1]
        span = b.time - a.time
        return span, (b.completed - a.completed) / span, (b.generated - a.generated) / span
    ok = [j for j in jobs if j.ok]
    end = max((j.finish for j in ok), default=start)
    span = max(1e-9, end - start)
    return span, len(ok) / span, sum(j.generated for j in ok) / span


def build_report(run: RunResult, wall_seconds: float = 0.0, max_tenants: int = 0) -> Report:
    """Reduce a run. `max_tenants` > 0 keeps only the busiest tenants in `by_tenant`."""
    w = run.workload
    jobs = [j for j in run.jobs if j.arrival >= w.warmup]
    ok = [j for j in jobs if j.ok]
    window, rps, tps = throughput(run, jobs)
    by_class: dict[int, list[Job]] = defaultdict(list)
    by_tenant: dict[str, list[Job]] = defaultdict(list)
    for j in jobs:
        by_class[j.cls].append(j)
        by_tenant[j.tenant or "default-flow"].append(j)
    classes = [group(spec.name, by_class.get(i, []), spec.slo_ttft) for i, spec in enumerate(w.classes)]
    tenants = sorted(by_tenant.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    if max_tenants > 0:
        tenants = tenants[:max_tenants]
    served = [p.served for p in run.pod_stats]
    total_served = sum(served) or 1
    queries = sum(p.prefix_queries for p in run.pod_stats)
    hits = sum(p.prefix_hits for p in run.pod_stats)
    errors = Counter(j.error for j in jobs if j.error)
    s = run.samples
    why = _diagnose(run, jobs)
    return Report(
        policy=run.policy, workload=w.name, pods=run.pods, seed=run.seed, flow_control=run.flow_control,
        requests=len(jobs), ok=len(ok), errors=dict(sorted(errors.items())), window=window,
        throughput_rps=rps, output_tps=tps,
        prefix_hit_rate=hits / queries if queries else math.nan,
        preemptions=sum(p.preemptions for p in run.pod_stats),
        overall=group("all", jobs), token_itl=weighted_triple(run.itl_hist),
        by_class=classes, by_tenant=[group(name, js) for name, js in tenants],
        queue_series={"time": [x.time for x in s], "waiting": [x.waiting for x in s],
                      "running": [x.running for x in s], "router_queued": [x.router_queued for x in s],
                      "kv_usage": [round(x.kv_usage, 4) for x in s]},
        pod_load=[x.per_pod for x in s], pod_share=[n / total_served for n in served],
        end_time=run.end_time, unfinished=run.unfinished, wall_seconds=wall_seconds,
        ttft_quantiles=quantiles([j.first_token - j.arrival for j in ok]),
        busiest_share=max(served) / total_served if served else math.nan,
        steps_out_of_range=run.steps_out_of_range_share, **why,
    )


def _diagnose(run: RunResult, jobs: Sequence[Job]) -> dict[str, float]:
    counted = {j.id: j for j in jobs}
    picks = [p for p in run.picks if p.job_id in counted]
    if not picks:
        return {}
    block = run.workload.sim_config().engine.block_size
    out = {"behind_share": sum(1 for p in picks if p.queued_excess >= BEHIND_TOKENS) / len(picks)}
    believed = [(p.believed_cached, counted[p.job_id].cached_tokens) for p in picks
                if p.believed_cached >= 0 and counted[p.job_id].ok]
    if believed:
        top = sum(max(b, t) for b, t in believed)
        out["index_accuracy"] = sum(min(b, t) for b, t in believed) / top if top else 1.0
        # Claimed a prefix the engine no longer had (not a few tokens of estimate error).
        out["over_claimed"] = sum(1 for b, t in believed if b - t >= max(4 * block, b / 4)) / len(believed)
    errors = sorted(abs(p.predicted_ttft - (counted[p.job_id].first_token - counted[p.job_id].dispatch))
                    / (counted[p.job_id].first_token - counted[p.job_id].dispatch)
                    for p in picks if not math.isnan(p.predicted_ttft) and counted[p.job_id].ok
                    and counted[p.job_id].first_token > counted[p.job_id].dispatch)
    if errors:
        out["prediction_error"] = pct(errors, 0.5)
    return out


# -- text --


def _ms(v: float) -> str:
    return "–" if v is None or math.isnan(v) else f"{v * 1000:.0f}"


def _s(v: float) -> str:
    return "–" if v is None or math.isnan(v) else f"{v:.2f}"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in errors.items()) or "–"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths)))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in rows:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


SUMMARY_HEADERS = ["policy", "ok/req", "TTFT p50", "p90", "p99 ms", "p90/best", "p99/best", "ITL p50", "p99 ms",
                   "E2E p50", "p99 s", "req/s", "out tok/s", "hit rate", "waiting max", "EPP queue max", "errors"]

WHY_HEADERS = ["policy", "hit rate", "index accuracy", "over-claimed", f"behind >= {BEHIND_TOKENS // 1024}k",
               "busiest pod", "TTFT pred. error"]


def _pct(v: float) -> str:
    return "–" if v is None or math.isnan(v) else f"{v:.1%}"


def _ratio(mine: float, others: list[float]) -> str:
    """Mine over the best of the others (the 'are we the best here' column)."""
    others = [o for o in others if not math.isnan(o)]
    if math.isnan(mine) or not others or min(others) <= 0:
        return "–"
    return f"{mine / min(others):.2f}"


def summary_row(r: Report, others: Sequence[Report] = ()) -> list[str]:
    o = r.overall
    q = r.queue_series
    return [r.policy, f"{r.ok}/{r.requests}", _ms(o.ttft[0]), _ms(o.ttft[1]), _ms(o.ttft[2]),
            _ratio(o.ttft[1], [x.overall.ttft[1] for x in others]),
            _ratio(o.ttft[2], [x.overall.ttft[2] for x in others]),
            _ms(r.token_itl[0]), _ms(r.token_itl[2]), _s(o.e2e[0]), _s(o.e2e[2]),
            f"{r.throughput_rps:.1f}", f"{r.output_tps:.0f}", _pct(r.prefix_hit_rate),
            str(max(q["waiting"], default=0)), str(max(q["router_queued"], default=0)), _errors(r.errors)]


def why_row(r: Report) -> list[str]:
    return [r.policy, _pct(r.prefix_hit_rate), _pct(r.index_accuracy), _pct(r.over_claimed), _pct(r.behind_share),
            _pct(r.busiest_share), _pct(r.prediction_error)]


# Per group, ITL is each request's mean time per output token (TPOT); the summary's is per token.
GROUP_HEADERS = ["", "ok/req", "TTFT p50", "p90", "p99 ms", "TPOT p50", "p99 ms", "E2E p50", "p99 s",
                 "queued p99 s", "SLO met", "errors"]


def group_row(g: GroupStats) -> list[str]:
    slo = "–" if g.slo_attained is None else f"{g.slo_attained:.1%} (≤{g.slo_ttft * 1000:.0f} ms)"  # type: ignore[operator]
    return [g.name, f"{g.ok}/{g.requests}", _ms(g.ttft[0]), _ms(g.ttft[1]), _ms(g.ttft[2]), _ms(g.itl[0]),
            _ms(g.itl[2]), _s(g.e2e[0]), _s(g.e2e[2]), _s(g.queue[2]), slo, _errors(g.errors)]


def render_text(reports: list[Report], *, max_tenants: int = 10) -> str:
    """The stdout report: one summary line per policy, then classes and tenants per policy."""
    if not reports:
        return ""
    r0 = reports[0]
    rows = [summary_row(r, [x for x in reports if x is not r]) for r in reports]
    lines = [f"workload {r0.workload}: {r0.requests} requests on {r0.pods} pods, seed {r0.seed}, "
             f"virtual time {r0.end_time:.1f} s", "", table(SUMMARY_HEADERS, rows),
             "(p90/best, p99/best: TTFT over the best other policy's)", "",
             table(WHY_HEADERS, [why_row(r) for r in reports])]
    for r in reports:
        lines += ["", f"[{r.policy}] per class" + (" (flow control on)" if r.flow_control else ""),
                  table(GROUP_HEADERS, [group_row(g) for g in r.by_class])]
        if len(r.by_tenant) > 1:
            tenants = r.by_tenant[:max_tenants]
            more = len(r.by_tenant) - len(tenants)
            lines += [f"[{r.policy}] per tenant" + (f" (busiest {len(tenants)}; {more} more in --json)" if more else ""),
                      table(GROUP_HEADERS, [group_row(g) for g in tenants])]
        if r.unfinished:
            lines.append(f"[{r.policy}] {r.unfinished} requests unfinished at the horizon")
    outside = max(r.steps_out_of_range for r in reports)
    if outside > 0.0:
        lines += ["", f"note: up to {outside:.1%} of the engines' steps fall outside the step-time model's "
                      "calibrated range (tokens per step or context): their durations are extrapolated"]
    walls = [f"{r.policy} {r.wall_seconds:.1f} s" for r in reports if r.wall_seconds]
    if walls:
        lines += ["", "wall time: " + ", ".join(walls)]
    return "\n".join(lines)
