"""Live routing quality: the same simulated pods and the same requests behind each router.

    python -m bench.routing prefix            # shared system prompts + multi-turn chats
    python -m bench.routing balance           # independent prompts of varied length (inference-perf)
    python -m bench.routing hol               # short requests mixed with a few very long generations
    python -m bench.routing prefix --quick    # fewer arms and rates, shorter points (~2 min)
    python -m bench.routing prefix --arms epp,envoy-rr --rates 8,16 --duration 20

Every point (one arm at one rate) gets freshly started pods (cold prefix cache) and a freshly
started router; arms take turns at each rate, so machine noise hits all of them alike. Requests
sent during the first `--warmup` seconds warm the caches and are left out of the figures. The
prefix-cache hit rate and each pod's share come from the pods' own /metrics. Writes
bench/results/routing-<scenario>.md with PNG plots next to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench import inferenceperf, plots
from bench.arms import Arm, arm, available, start_arm
from bench.client import replay
from bench.common import MODEL, RESULTS, log, machine_load, write_report
from bench.podmon import PodMonitor, PodSample, delta
from bench.pods import PodSpec, Pods
from bench.stats import Point, from_run
from bench.workloads import BUILDERS

LOAD_AT_START = machine_load()
PEERS_PREFIX = ["sglang-cache_aware", "sglang-round_robin", "vllm-cache_aware", "vllm-power_of_two",
                "vllm-sticky_least_loaded"]


@dataclass(slots=True)
class Scenario:
    name: str
    title: str
    pods: PodSpec
    rates: list[float]
    arms: list[str]
    duration: float = 14.0
    warmup: float = 4.0
    drain: float = 15.0
    loadgen: str = "own"  # or "inference-perf"
    quick_arms: list[str] = field(default_factory=list)


SCENARIOS: dict[str, Scenario] = {
    "prefix": Scenario(
        "prefix", "Prefix-heavy: shared system prompts, multi-turn chats",
        PodSpec(num_gpu_blocks=1200, max_num_seqs=12, time_scale=1.0),
        rates=[12.0, 24.0, 32.0],
        arms=["epp", "epp-weighted", "envoy-rr", *PEERS_PREFIX],
        # 30 s: the chats reach their 6 kept turns (a user speaks every 48 / rate seconds) and
        # their histories fill the pods' KV, the steady state the scenario describes.
        duration=30.0, warmup=3.0,
        quick_arms=["epp", "epp-weighted", "envoy-rr", "sglang-cache_aware", "vllm-cache_aware"]),
    "balance": Scenario(
        "balance", "Load balancing: independent prompts of varied length",
        PodSpec(num_gpu_blocks=2000, max_num_seqs=8, time_scale=1.0),
        rates=[10.0, 20.0, 30.0],
        arms=["epp", "envoy-rr", "sglang-cache_aware", "vllm-power_of_two"],
        duration=10.0, warmup=0.0, loadgen="inference-perf",
        quick_arms=["epp", "envoy-rr", "vllm-power_of_two"]),
    "hol": Scenario(
        "hol", "Head-of-line: short requests with a few very long generations",
        PodSpec(num_gpu_blocks=2000, max_num_seqs=8, time_scale=1.0),
        rates=[8.0, 14.0, 20.0],
        arms=["epp", "epp-weighted", "envoy-rr", "sglang-cache_aware", "vllm-power_of_two"],
        duration=30.0, warmup=3.0,  # several lifetimes of a long generation (5-10 s)
        quick_arms=["epp", "epp-weighted", "envoy-rr", "sglang-cache_aware"]),
}


# --------------------------------------------------------------------------- measuring


def _series(mon: PodMonitor, t0: float) -> list[list[tuple[float, float]]]:
    return [[(s.t - t0, s.running + s.waiting) for s in series] for series in mon.series]


def _nearest(series: list[PodSample], t: float, after: bool) -> PodSample:
    if after:
        return next((s for s in series if s.t >= t), series[-1])
    return next((s for s in reversed(series) if s.t <= t), series[0])


async def own_point(sc: Scenario, a: Arm, rate: float, seed: int) -> Point:
    """One arm at one rate with our streaming client, on fresh pods."""
    plan = BUILDERS[sc.name](rate, sc.duration, seed).plan
    tag = f"{sc.name}-{a.name}-{rate:g}"
    with Pods(sc.pods, tag) as pods:
        running = start_arm(a, pods.addresses, tag)
        try:
            async with PodMonitor(pods.urls) as mon:
                warm: list[PodSample] = []

                async def mark_warm() -> None:
                    await asyncio.sleep(sc.warmup)
                    warm.extend(await mon.snapshot())

                first = await mon.snapshot()
                marker = asyncio.create_task(mark_warm())
                t0 = time.monotonic()
                result = await replay(running.url, MODEL, plan, sc.duration, sc.drain)
                await marker
                after = await mon.snapshot()
                series = _series(mon, t0)
        finally:
            running.close()
    point = from_run(sc.name, a.name, rate, result, sc.warmup, sc.duration, delta(warm, after), delta(first, after),
                     sc.pods.time_scale)
    point.load_series = series
    return point


async def inference_perf_arm(sc: Scenario, a: Arm, rates: list[float], seed: int) -> list[Point]:
    """One arm at every rate in turn (one inference-perf run each), on the same fresh pods."""
    tag = f"{sc.name}-{a.name}"
    points = []
    with Pods(sc.pods, tag) as pods:
        running = start_arm(a, pods.addresses, tag)
        try:
            async with PodMonitor(pods.urls) as mon:
                try:
                    stages = await asyncio.to_thread(inferenceperf.run, running.url, rates, sc.duration, tag, seed)
                except asyncio.CancelledError:
                    inferenceperf.CANCEL.set()  # the worker thread stops inference-perf
                    raise
                await asyncio.sleep(0.6)  # one more sample after the last stage
                for st in stages:
                    start, end = st.window
                    before = [_nearest(s, start, after=False) for s in mon.series]
                    after = [_nearest(s, end, after=True) for s in mon.series]
                    d = delta(before, after)
                    engine = d.engine_e2e_mean * sc.pods.time_scale
                    p = Point(sc.name, a.name, st.rate, achieved=st.rps, sent=st.count, ok=st.count - st.failures,
                              errors=st.failures, ttft=st.ttft, itl=st.itl, out_tps=st.out_tps, hit_rate=d.hit_rate,
                              share=d.share, loadgen="inference-perf")
                    p.load_series = [[(s.t - start, s.running + s.waiting) for s in series if start <= s.t <= end]
                                     for series in mon.series]
                    p.clock = st.e2e_mean / engine if engine and not math.isnan(engine) else math.nan
                    points.append(p)
        finally:
            running.close()
    return points


def _progress(p: Point) -> None:
    log(f"  {p.arm:<26} {p.rate:>5g}/s  TTFT p50/p90/p99 {p.ttft[0] * 1e3:7.0f} {p.ttft[1] * 1e3:7.0f} "
        f"{p.ttft[2] * 1e3:7.0f} ms  hit {p.hit_rate:6.1%}  ok {p.ok}/{p.sent}  share {p.share_spread}"
        + (f"  clock x{p.clock:.2f}" if not math.isnan(p.clock) else ""))


async def run(sc: Scenario, arms: list[Arm], seed: int) -> list[Point]:
    points: list[Point] = []
    if sc.loadgen == "inference-perf":
        for i, a in enumerate(arms):
            log(f"[{sc.name}] arm {i + 1}/{len(arms)}: {a.name} (inference-perf, rates {sc.rates})")
            for p in await inference_perf_arm(sc, a, sc.rates, seed):
                _progress(p)
                points.append(p)
        return points
    total = len(sc.rates) * len(arms)
    for r in sc.rates:
        for a in arms:
            log(f"[{sc.name}] point {len(points) + 1}/{total}: {a.name} at {r:g} req/s "
                f"({sc.duration:g} s + drain)")
            p = await own_point(sc, a, r, seed)
            _progress(p)
            points.append(p)
    return points


# --------------------------------------------------------------------------- report


def _ms(x: float) -> str:
    return "–" if math.isnan(x) else f"{x * 1000:,.0f}"


def _ratio(x: float, y: float) -> str:
    if math.isnan(x) or math.isnan(y) or y == 0:
        return "–"
    return f"{x / y:.2f}"


def report(sc: Scenario, arms: list[Arm], points: list[Point], skipped: list[str], elapsed: float,
           out: Path, seed: int) -> str:
    stem = out.with_suffix("")
    lines = [f"# Routing quality, live: {sc.title}", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M')}, {elapsed / 60:.1f} min, `python -m bench.routing {sc.name}` "
             f"(seed {seed}); machine load average {LOAD_AT_START} at the start, {machine_load()} at the end "
             "(2 cores).", "",
             f"- Pods: {sc.pods.describe()}.",
             f"- Workload: {inferenceperf.DESCRIPTION if sc.loadgen == 'inference-perf' else BUILDERS[sc.name](1.0, 1.0, seed).description}.",
             f"- Load: Poisson arrivals at each offered rate for {sc.duration:g} s; "
             + ("requests in the first "
                f"{sc.warmup:g} s warm the caches and are not counted; stragglers get {sc.drain:g} s to finish. "
                "Client: `bench/client.py` (aiohttp, streaming; TTFT = first SSE event with text)."
                if sc.loadgen == "own" else
                "load generator: **inference-perf**, replaying a seeded trace (the same requests at the same "
                "moments for every arm), one run per rate; its per-stage report gives TTFT/ITL/throughput."),
             "- Every point starts fresh pods (cold prefix cache) and a fresh router; arms alternate at each rate."
             if sc.loadgen == "own" else
             "- Every arm starts fresh pods (cold prefix cache) and a fresh router, then runs the rates in turn; "
             "arms take turns.",
             "- Hit rate = Δ`vllm:prefix_cache_hits_total` / Δ`vllm:prefix_cache_queries_total` summed over the "
             "pods; share = each pod's Δ`vllm:request_success_total`.",
             "- `clock` = the client's mean end-to-end time ÷ (time scale × the pods' own mean e2e, in modelled "
             "seconds): near 1.0 means the simulated GPUs kept pace with wall time on this machine.", "",
             "Arms:", ""]
    for a in arms:
        lines.append(f"- `{a.name}`: {a.note or a.kind + ' ' + a.policy}")
    if skipped:
        lines += ["", f"Not run (not installed): {', '.join(skipped)} — `make bench-deps` installs them."]
    lines += ["", "## Results", "",
              "| rate | arm | done/s | TTFT p50 ms | p90 | p99 | ITL p50 ms | p99 | out tok/s | hit rate | "
              "pod share | errors | clock |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (p.rate, [a.name for a in arms].index(p.arm))):
        err = f"{p.errors}/{p.sent}" + (f" (+{p.not_sent} unsent)" if p.not_sent else "")
        lines.append(
            f"| {p.rate:g} | {p.arm} | {p.achieved:.1f} | {_ms(p.ttft[0])} | {_ms(p.ttft[1])} | {_ms(p.ttft[2])} | "
            f"{_ms(p.itl[0])} | {_ms(p.itl[1])} | {p.out_tps:,.0f} | "
            f"{'–' if math.isnan(p.hit_rate) else f'{p.hit_rate:.1%}'} | {p.share_spread} | {err} | "
            f"{'–' if math.isnan(p.clock) else f'{p.clock:.2f}'} |")
    kinds = sorted({k for p in points for k in p.by_kind})
    if kinds:
        lines += ["", "TTFT by request class (p50 / p90 / p99, ms):", "",
                  "| rate | arm | " + " | ".join(kinds) + " |", "|---|---|" + "---|" * len(kinds)]
        for p in sorted(points, key=lambda p: (p.rate, [a.name for a in arms].index(p.arm))):
            cells = [" / ".join(_ms(x) for x in p.by_kind.get(k, (math.nan,) * 3)) for k in kinds]
            lines.append(f"| {p.rate:g} | {p.arm} | " + " | ".join(cells) + " |")
    lines += headline(points, arms)
    if plots.have_matplotlib() and points:
        pics = [plots.latency_vs_load(points, Path(f"{stem}-latency.png"), sc.title),
                plots.hits_and_throughput(points, Path(f"{stem}-hits.png"), sc.title)]
        top = max(p.rate for p in points)
        pics.append(plots.pod_load([p for p in points if p.rate == top], Path(f"{stem}-podload.png"),
                                   f"{sc.title}: per-pod load over time at {top:g} req/s"))
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pics]
    else:
        lines += ["", "(matplotlib not installed: no plots)"]
    return "\n".join(lines) + "\n"


def headline(points: list[Point], arms: list[Arm]) -> list[str]:
    """TTFT p90 of every arm relative to the EPP's default arm, per rate (>1: the EPP is faster)."""
    base = "epp" if any(p.arm == "epp" for p in points) else (arms[0].name if arms else "")
    rates = sorted({p.rate for p in points})
    at = {(p.arm, p.rate): p for p in points}
    lines = ["", f"## Headline: TTFT p90 of each arm ÷ `{base}`'s (same run; above 1 means `{base}` is faster)", "",
             "| arm | " + " | ".join(f"{r:g}/s" for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for a in arms:
        if a.name == base:
            continue
        cells = []
        for r in rates:
            mine, ref = at.get((a.name, r)), at.get((base, r))
            cells.append(_ratio(mine.ttft[1], ref.ttft[1]) if mine and ref else "–")
        lines.append(f"| {a.name} | " + " | ".join(cells) + " |")
    return lines


def save_points(path: Path, sc: Scenario, points: list[Point]) -> None:
    """The figures without the time series, for `bench.summary`."""
    rows = [{k: getattr(p, k) for k in ("arm", "rate", "achieved", "sent", "ok", "errors", "not_sent", "ttft", "itl",
                                         "out_tps", "hit_rate", "share", "clock", "by_kind", "loadgen")}
            for p in points]
    path.write_text(json.dumps({"scenario": sc.name, "title": sc.title, "points": rows}, indent=1))


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--arms", help="comma-separated arms (default: the scenario's; see bench/arms.py)")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], help="offered req/s")
    parser.add_argument("--duration", type=float, help="seconds of traffic per point")
    parser.add_argument("--warmup", type=float, help="seconds at the start of each point left out")
    parser.add_argument("--pods", type=int, help="number of simulated pods")
    parser.add_argument("--time-scale", type=float, help="wall seconds per modelled second")
    parser.add_argument("--loadgen", choices=("own", "inference-perf"), help="load generator")
    parser.add_argument("--quick", action="store_true", help="fewer arms, the two highest rates, 8 s points")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", help="report path (default bench/results/routing-<scenario>.md)")
    return parser.parse_args(argv)


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    sc = SCENARIOS[args.scenario]
    sc = replace(sc, rates=list(sc.rates), arms=list(sc.arms), pods=sc.pods)
    if args.quick:
        sc.arms = list(sc.quick_arms)
        sc.duration, sc.warmup = 8.0, min(sc.warmup, 2.0)
        sc.rates = sc.rates[1:]  # the loaded end, where routers differ
    if args.arms:
        sc.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if args.rates:
        sc.rates = args.rates
    if args.duration is not None:
        sc.duration = args.duration
    if args.warmup is not None:
        sc.warmup = args.warmup
    if args.pods is not None:
        sc.pods = replace(sc.pods, count=args.pods)
    if args.time_scale is not None:
        sc.pods = replace(sc.pods, time_scale=args.time_scale)
    if args.loadgen:
        sc.loadgen = args.loadgen
    if sc.loadgen == "inference-perf" and inferenceperf.executable() is None:
        log("inference-perf not installed (make bench-deps): using the built-in client instead")
        sc.loadgen = "own"
        sc.warmup = sc.warmup or min(3.0, sc.duration / 4)
    sc.drain = max(sc.drain, sc.duration)
    return sc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sc = scenario_from_args(args)
    wanted = [arm(n) for n in sc.arms]
    arms = [a for a in wanted if available(a)]
    skipped = [a.name for a in wanted if not available(a)]
    for name in skipped:
        log(f"skipping {name}: not installed")
    out = Path(args.out) if args.out else RESULTS / f"routing-{sc.name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)  # before the run, not after minutes of it
    log(f"[{sc.name}] {len(arms)} arms × {len(sc.rates)} rates, {sc.duration:g} s per point; {sc.pods.describe()}")
    started = time.monotonic()
    try:
        points = asyncio.run(run(sc, arms, args.seed))
    except KeyboardInterrupt:
        log("interrupted; every process started has been stopped")
        return 130
    text = report(sc, arms, points, skipped, time.monotonic() - started, out, args.seed)
    write_report(out, text)
    save_points(out.with_suffix(".json"), sc, points)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
