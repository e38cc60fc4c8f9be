"""Flow control in the virtual-time cluster: flood, overload and no-overload (issue 4).

    python -m bench.flowcontrol [--quick] [--jobs 2] [--out bench/results]

Writes `flowcontrol.md` and `flowcontrol/*.png` under the output directory; progress on stderr.
Every arm runs the EPP's real admission and scheduler (`epp.sim.cluster`) on the same simulated
pods, workload and seed; only the EndpointPickerConfig differs, so each compared figure is
measured in the same run as its baseline.

- **Flood**: user A sends 500 requests at once; users B and C send one each a second later.
  B's and C's time to first token against an idle pool, without flow control and with it
  (FCFS across users — the reference's default policy — round robin, and token fairness).
- **Overload**: interactive and batch traffic together at twice the pool's capacity. The
  capacity is measured first, in the same run: the output-token throughput of a saturated pool
  divided by the mix's mean output length. Interactive p99 TTFT against its SLO; what happened to
  batch (served, queued how long, shed and why), without and with flow control.
- **No overload**: the same mix at half the capacity: throughput and latency with flow control
  on must equal those with it off.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from bench.sim_common import (RESULTS, SimTask, default_jobs, errors_text, log, md_table, ms, pct, progress,
                              pyplot, ratio, run_tasks, sec)
from epp.config.defaults import DEFAULT_CONFIG
from epp.sim.cluster.report import GroupStats, Report
from epp.sim.cluster.simulate import EppArm
from epp.sim.cluster.workload import Workload, parse_workload

SLO_MS = 300  # interactive TTFT objective in the overload scenarios

# -- the configs under test (the scheduling profile is the EPP's default in every arm) --

NO_FLOW_CONTROL = EppArm("no flow control", DEFAULT_CONFIG)


def _flow_control(fairness: str, gate: str) -> str:
    return DEFAULT_CONFIG + f"""featureGates: [flowControl]
flowControl:
  defaultPriorityBand:
    fairnessPolicyRef: {fairness}
    dispatchGate: {gate}
"""


# Keep each engine's own queue short (<3 waiting, counting what we sent since the last scrape) so
# the order is decided here, where it can still change.
FLOOD_GATE = "{queueDepthThreshold: 3}"
FLOOD_ARMS = (
    NO_FLOW_CONTROL,
    EppArm("flow control, FCFS (reference default policy)", _flow_control("global-strict-fairness-policy", FLOOD_GATE)),
    EppArm("flow control, round robin", _flow_control("round-robin-fairness-policy", FLOOD_GATE)),
    EppArm("flow control, token fairness", _flow_control("token-fairness-policy", FLOOD_GATE)),
)

OVERLOAD_FLOW_CONTROL = DEFAULT_CONFIG + """featureGates: [flowControl]
flowControl:
  priorityBands:
  - priority: 0                 # interactive
    fairnessPolicyRef: round-robin-fairness-policy
    dispatchGate: {queueDepthThreshold: 3}
  - priority: -1                # batch (sheddable)
    fairnessPolicyRef: round-robin-fairness-policy
    defaultRequestTTL: 60s
    maxRequests: 5000
    dispatchGate: {queueDepthThreshold: 1, kvCacheUtilThreshold: 0.75}
"""
OVERLOAD_ARMS = (NO_FLOW_CONTROL, EppArm("flow control", OVERLOAD_FLOW_CONTROL))


# -- workloads --


@dataclass(slots=True, frozen=True)
class Sizes:
    flood_pods: int = 4
    flood_a: int = 500
    overload_pods: int = 8
    duration: float = 60.0
    warmup: float = 10.0
    probe_duration: float = 25.0


QUICK = Sizes(flood_pods=2, flood_a=200, overload_pods=4, duration=20.0, warmup=5.0, probe_duration=15.0)
TINY = Sizes(flood_pods=1, flood_a=20, overload_pods=1, duration=4.0, warmup=1.0, probe_duration=4.0)


def flood_workload(a: int, *, idle: bool = False) -> Workload:
    flood = "" if idle else (f"- {{name: A, tenants: [user-a], arrival: {{process: burst, count: {a}, at: 0}}, "
                             "prompt: 1500, output: 400}\n")
    return parse_workload(f"""
name: {"idle" if idle else "flood"}
duration: 30
classes:
{flood}- {{name: B, tenants: [user-b], arrival: {{process: burst, count: 1, at: 1}}, prompt: 500, output: 100}}
- {{name: C, tenants: [user-c], arrival: {{process: burst, count: 1, at: 1}}, prompt: 500, output: 100}}
""")


INTERACTIVE_SHARE = 0.25
INTERACTIVE_OUTPUT, BATCH_OUTPUT = 150.0, 500.0


def mix_workload(total_rate: float, duration: float, warmup: float, name: str) -> Workload:
    """Interactive chat (a quarter of the requests, 20 users) plus batch (three quarters, 2 jobs)."""
    return parse_workload(f"""
name: {name}
duration: {duration}
warmup: {warmup}
classes:
- name: interactive
  rate: {total_rate * INTERACTIVE_SHARE}
  priority: 0
  slo_ttft_ms: {SLO_MS}
  prompt: {{dist: lognormal, mean: 500, sigma: 0.6, max: 4000}}
  output: {{dist: lognormal, mean: {INTERACTIVE_OUTPUT}, sigma: 0.6, min: 4, max: 1000}}
  tenants: 20
- name: batch
  rate: {total_rate * (1 - INTERACTIVE_SHARE)}
  priority: -1
  prompt: {{dist: uniform, min: 1000, max: 3000}}
  output: {{dist: uniform, min: 200, max: 800}}
  tenants: 2
""")


def mean_output() -> float:
    return INTERACTIVE_SHARE * INTERACTIVE_OUTPUT + (1 - INTERACTIVE_SHARE) * BATCH_OUTPUT


# -- running --


def _cls(report: Report, name: str) -> GroupStats:
    return next(g for g in report.by_class if g.name == name)


def run_flood(sizes: Sizes, jobs: int) -> tuple[Report, list[Report]]:
    tasks = [SimTask("flood: idle pool", flood_workload(0, idle=True), NO_FLOW_CONTROL, sizes.flood_pods)]
    tasks += [SimTask("flood", flood_workload(sizes.flood_a), arm, sizes.flood_pods) for arm in FLOOD_ARMS]
    reports = run_tasks(tasks, jobs, progress)
    return reports[0], reports[1:]


def measure_capacity(sizes: Sizes) -> tuple[float, Report]:
    """Requests/s the pool sustains for this mix: saturated output tokens/s ÷ mean output tokens."""
    guess = 60.0 * sizes.overload_pods  # far above capacity: the pool runs saturated
    w = mix_workload(guess, sizes.probe_duration, min(sizes.warmup, sizes.probe_duration / 3), "capacity probe")
    [probe] = run_tasks([SimTask("capacity probe", w, "round-robin", sizes.overload_pods)], 1, progress)
    return probe.output_tps / mean_output(), probe


def run_load(sizes: Sizes, rate: float, name: str, jobs: int) -> list[Report]:
    w = mix_workload(rate, sizes.duration, sizes.warmup, name)
    return run_tasks([SimTask(name, w, arm, sizes.overload_pods) for arm in OVERLOAD_ARMS], jobs, progress)


# -- the report --


def flood_section(idle: Report, reports: list[Report], sizes: Sizes, out: Path, plots: bool) -> str:
    base_b, base_c = _cls(idle, "B").ttft[0], _cls(idle, "C").ttft[0]
    rows = []
    for r in reports:
        a, b, c = _cls(r, "A"), _cls(r, "B"), _cls(r, "C")
        a_end = r.end_time
        rows.append([r.policy, ms(b.ttft[0]), ms(c.ttft[0]), ratio(b.ttft[0] / base_b), ratio(c.ttft[0] / base_c),
                     f"{ms(a.ttft[0])} / {ms(a.ttft[2])}", sec(a_end), f"{a.ok}/{a.requests}",
                     str(max(r.queue_series["router_queued"], default=0))])
    lines = [
        "## Flood",
        "",
        f"{sizes.flood_pods} pods. User A sends {sizes.flood_a} requests at t=0 (1,500-token prompts, 400 output "
        "tokens each); users B and C send one request each at t=1 s (500-token prompt, 100 tokens). "
        f"Idle pool: B and C alone, TTFT {ms(base_b)} ms and {ms(base_c)} ms.",
        "",
        md_table(["arm", "B TTFT ms", "C TTFT ms", "B vs idle", "C vs idle", "A TTFT p50 / p99 ms",
                  "all done at s", "A served", "max queued in EPP"], rows),
        "",
        f"Flow control's gate: `dispatchGate: {FLOOD_GATE}` on the default band — a pod takes a request only "
        "while its scraped waiting queue plus the requests sent to it since that scrape is below 3. "
        "A's burst waits in the EPP instead of in the engines' FIFO queues, where B and C would sit "
        "behind all of it; the fairness policy then decides who goes next. With FCFS across users "
        "(the reference's default `global-strict-fairness-policy`) B and C still wait for A's backlog, "
        "now in our queue; round robin and token fairness send them at the next dispatch (token "
        "fairness equals round robin here: B and C have one request each). What B and C still wait "
        "for is the prefill of A's requests already in the engines when they arrive: the gate lets "
        "up to 3 per pod through per 50 ms scrape, faster than a pod prefills 1,500-token prompts. "
        "\"All done at\" is when A's last request finished: the gate holds A's requests only while "
        "the pods are busy, so the flood itself is hardly slowed down (work conservation).",
    ]
    if plots:
        lines += ["", f"![flood]({_flood_plot(idle, reports, out)})"]
    return "\n".join(lines)


def _slo_cell(g: GroupStats) -> str:
    return pct(g.slo_attained)


def overload_section(title: str, rate: float, capacity: float, reports: list[Report], sizes: Sizes,
                     out: Path, plots: bool, slug: str) -> str:
    rows = []
    for r in reports:
        i, b = _cls(r, "interactive"), _cls(r, "batch")
        rows.append([r.policy, f"{ms(i.ttft[0])} / {ms(i.ttft[1])} / {ms(i.ttft[2])}", _slo_cell(i),
                     f"{b.ok}/{b.requests}", f"{ms(b.ttft[0])} / {ms(b.ttft[2])}", f"{sec(b.queue[0])} / {sec(b.queue[2])}",
                     errors_text(b.errors), f"{r.output_tps:,.0f}", f"{r.throughput_rps:.1f}",
                     f"{ms(r.token_itl[0])} / {ms(r.token_itl[2])}"])
    lines = [
        f"## {title}",
        "",
        f"{sizes.overload_pods} pods; offered {rate:.1f} requests/s = {rate / capacity:.1f}× the measured capacity "
        f"({capacity:.1f} requests/s) for {sizes.duration:.0f} s (the first {sizes.warmup:.0f} s are warm-up, "
        "not counted); a quarter interactive (priority 0, 20 users, TTFT SLO "
        f"{SLO_MS} ms), three quarters batch (priority −1, sheddable, 2 jobs with 1–3k-token prompts).",
        "",
        md_table(["arm", "interactive TTFT p50 / p90 / p99 ms", f"interactive ≤ {SLO_MS} ms", "batch served",
                  "batch TTFT p50 / p99 ms", "batch queued in EPP p50 / p99 s", "batch shed (reason)",
                  "output tok/s", "served req/s", "ITL p50 / p99 ms"], rows),
    ]
    if plots:
        lines += ["", f"![{slug}]({_overload_plot(reports, out, slug, title)})"]
    return "\n".join(lines)


def _flood_plot(idle: Report, reports: list[Report], out: Path) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    names = ["idle pool"] + [r.policy.replace("flow control, ", "FC: ").replace(" (reference default policy)", "")
                             for r in reports]
    for k, user in enumerate(("B", "C")):
        values = [_cls(idle, user).ttft[0] * 1000] + [_cls(r, user).ttft[0] * 1000 for r in reports]
        axes[0].bar([i + k * 0.4 for i in range(len(values))], values, width=0.4, label=f"user {user}")
    axes[0].set_xticks([i + 0.2 for i in range(len(names))], names, rotation=15, fontsize=8)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].set_title("B's and C's time to first token")
    axes[0].legend()
    axes[0].grid(True, axis="y", which="both", alpha=0.3)
    for r, name in zip(reports, names[1:]):
        s = r.queue_series
        axes[1].plot(s["time"], [w + q for w, q in zip(s["waiting"], s["router_queued"])], label=name)
    axes[1].set_title("A's backlog: waiting in engines + queued in the EPP")
    axes[1].set_xlabel("virtual time (s)")
    axes[1].legend(fontsize=8)
    axes[1].grid(True, alpha=0.3)
    fig.tight_layout()
    path = out / "flood.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"{out.name}/{path.name}"


def _overload_plot(reports: list[Report], out: Path, slug: str, title: str) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for r in reports:
        s = r.queue_series
        axes[0].plot(s["time"], s["waiting"], label=r.policy)
        axes[1].plot(s["time"], s["router_queued"], label=r.policy)
    axes[0].set_title("waiting in the engines (all pods)")
    axes[1].set_title("queued in the EPP (flow control)")
    for ax in axes[:2]:
        ax.set_xlabel("virtual time (s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    width = 0.4
    for k, r in enumerate(reports):
        values = [_cls(r, c).ttft[q] * 1000 for c in ("interactive", "batch") for q in (0, 2)]
        axes[2].bar([i + k * width for i in range(4)], values, width=width, label=r.policy)
    axes[2].axhline(SLO_MS, color="red", linestyle="--", linewidth=1, label=f"SLO {SLO_MS} ms")
    axes[2].set_xticks([i + width / 2 for i in range(4)], ["interactive p50", "interactive p99", "batch p50",
                                                           "batch p99"], fontsize=8)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("TTFT (ms)")
    axes[2].legend(fontsize=8)
    axes[2].grid(True, axis="y", which="both", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = out / f"{slug}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"{out.name}/{path.name}"


def verdicts(idle: Report, flood: list[Report], overload: list[Report], calm: list[Report]) -> list[str]:
    """One line per claim, computed from the runs (the report states what it measured, win or lose)."""
    base = _cls(idle, "B").ttft[0]
    without = _cls(flood[0], "B").ttft[0]
    rr = _cls(flood[2], "B").ttft[0]
    off, on = overload
    i_off, i_on = _cls(off, "interactive"), _cls(on, "interactive")
    b_off, b_on = _cls(off, "batch"), _cls(on, "batch")
    c_off, c_on = calm
    out = [
        f"- **Flood**: B's TTFT is {ratio(without / base)} its idle-pool value without flow control and "
        f"{ratio(rr / base)} with it (round robin); A's flood ends at {sec(flood[0].end_time)} s without and "
        f"{sec(flood[2].end_time)} s with flow control.",
        f"- **Overload (2×)**: interactive p99 TTFT {ms(i_off.ttft[2])} ms without flow control, "
        f"{ms(i_on.ttft[2])} ms with it (SLO {SLO_MS} ms: {pct(i_off.slo_attained)} → {pct(i_on.slo_attained)} "
        f"within). Batch served {b_off.ok}/{b_off.requests} without (shed: {errors_text(b_off.errors)}) and "
        f"{b_on.ok}/{b_on.requests} with flow control (shed: {errors_text(b_on.errors)}; queued p50 "
        f"{sec(b_on.queue[0])} s). Output tokens/s: {on.output_tps / off.output_tps:.3f}× with/without.",
        f"- **No overload (½×)**: with/without flow control, output tokens/s {c_on.output_tps / c_off.output_tps:.3f}×, "
        f"requests/s {c_on.throughput_rps / c_off.throughput_rps:.3f}×, TTFT p50 {ms(c_off.overall.ttft[0])} → "
        f"{ms(c_on.overall.ttft[0])} ms, p99 {ms(c_off.overall.ttft[2])} → {ms(c_on.overall.ttft[2])} ms, "
        f"ITL p99 {ms(c_off.token_itl[2])} → {ms(c_on.token_itl[2])} ms.",
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flowcontrol", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller pools and shorter runs (about a minute)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the test suite's smoke run
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="simulations run in parallel")
    parser.add_argument("--out", default=str(RESULTS), help="directory for flowcontrol.md and its plots")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else QUICK if args.quick else Sizes()
    out = Path(args.out)
    plots_dir = out / "flowcontrol"
    plots = not args.no_plots and pyplot() is not None
    if plots:
        plots_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    log("flood ...")
    idle, flood = run_flood(sizes, args.jobs)
    log("overload: measuring the pool's capacity ...")
    capacity, probe = measure_capacity(sizes)
    log(f"capacity {capacity:.1f} requests/s ({probe.output_tps:,.0f} output tokens/s saturated)")
    overload = run_load(sizes, 2.0 * capacity, "overload (2×)", args.jobs)
    calm = run_load(sizes, 0.5 * capacity, "no overload (½×)", args.jobs)
    wall = time.perf_counter() - started

    mode = "tiny" if args.tiny else "quick" if args.quick else "default"
    text = "\n".join([
        "# Flow control in the virtual-time cluster",
        "",
        f"`python -m bench.flowcontrol{' --quick' if args.quick else ''}` — {mode} sizes, "
        f"{wall:.0f} s wall on this machine. Simulated vLLM pods (H100, Llama-3-8B step-time model; "
        "`epp.sim`) in virtual time, driving the EPP's real config loader, admission (legacy or flow "
        "control), scheduler and `Director` in-process (`epp.sim.cluster`); the EPP reads pod metrics "
        "scraped every 50 ms, as in production. Every arm uses the default scheduling profile and the "
        "same workload and seed; arms differ only in their `flowControl` section.",
        "",
        "## Summary",
        "",
        *verdicts(idle, flood, overload, calm),
        "",
        flood_section(idle, flood, sizes, plots_dir, plots),
        "",
        overload_section("Overload (2× capacity)", 2.0 * capacity, capacity, overload, sizes, plots_dir, plots,
                         "overload"),
        "",
        "Without flow control the reference's legacy admission applies: while the pool is saturated "
        "(mean over pods of max(waiting/5, KV use/0.8) ≥ 1, from scraped metrics) sheddable requests "
        "are rejected at once with 429 (`saturated`); everything else goes straight to the engines' "
        "FIFO queues. With flow control (config below) interactive requests go to a pod while its queue "
        "is under 3; batch requests only into an empty queue on a pod whose KV cache is under 75% full. "
        "The KV headroom is what keeps interactive TTFT low: at 2× load the engines' batches are "
        "bounded by KV memory, and a request that arrives at a full pod waits (in the engine, where "
        "its order can no longer change) until a running one finishes and frees blocks. Batch requests "
        "fill the capacity left and wait in the EPP otherwise, round robin between jobs, for at most "
        "60 s (`ttl`) and at most 5,000 of them (`band_capacity`). (An inter-token-latency gate on the "
        "interactive band was tried and hurt: long batch prefills raise the ITL and closed the gate for "
        "interactive traffic too.)",
        "",
        "```yaml",
        "featureGates:" + OVERLOAD_FLOW_CONTROL.split("featureGates:", 1)[1].rstrip(),
        "```",
        "",
        overload_section("No overload (½× capacity)", 0.5 * capacity, capacity, calm, sizes, plots_dir, plots,
                         "no-overload"),
        "",
        "Throughput is measured while requests arrive (after the warm-up), from the engines' "
        "cumulative counters; TTFT runs from the client's arrival, so time queued in the EPP counts. "
        f"Capacity probe: round robin at {60 * sizes.overload_pods} requests/s for "
        f"{sizes.probe_duration:.0f} s → {probe.output_tps:,.0f} output tokens/s ÷ {mean_output():.1f} "
        f"mean output tokens = {capacity:.1f} requests/s.",
        "",
    ])
    out.mkdir(parents=True, exist_ok=True)
    path = out / "flowcontrol.md"
    path.write_text(text)
    log(f"wrote {path} ({wall:.0f} s)")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
