"""`epp simulate`: a picker config against a workload on N simulated pods, in virtual time.

    epp simulate --config picker.yaml --workload workload.yaml --pods 16 --policy all \
        --seed 1 --json out.json --plots plots/

Prints a comparison table (and per class / per tenant tables) to stdout; progress goes to stderr.
`--workload` takes a file or the name of a shipped workload (`--list-workloads`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from epp.params import ConfigError, parse_duration

if TYPE_CHECKING:
    from epp.sim.cluster.simulate import EppArm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="EndpointPickerConfig for the EPP (repeat to compare configs; default: built-in)")
    parser.add_argument("--workload", metavar="FILE|NAME", help="workload YAML, or a shipped workload's name")
    parser.add_argument("--pods", default="4", metavar="N|SPEC",
                        help="simulated vLLM pods: a count (default 4), or groups COUNT[:PROFILE][:KEY=VALUE...] "
                             "joined by commas, e.g. 8:h100,8:a100 or 4:a100:max_num_seqs=64")
    parser.add_argument("--policy", action="append", default=[], metavar="NAME",
                        help="epp, random, round-robin, least-queue, greedy-oracle (alias oracle) or all "
                             "(repeatable or comma-separated; default epp)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: the workload's)")
    parser.add_argument("--json", metavar="FILE", help="write the reports as JSON")
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots (needs matplotlib: pip install epp[sim])")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply every arrival rate")
    parser.add_argument("--duration", default=None, help="override the workload's duration (e.g. 30s)")
    parser.add_argument("--requests", type=int, default=None, help="stop after this many requests")
    parser.add_argument("--warmup", default=None,
                        help="requests arriving before this are not counted (default: the workload's)")
    parser.add_argument("--refresh-interval", default="50ms",
                        help="how often the EPP sees new pod metrics (default 50ms, as --refresh-metrics-interval)")
    parser.add_argument("--horizon", default=None, help="end the run at this virtual time (default: generous)")
    parser.add_argument("--tenants", type=int, default=10, help="tenants shown per policy (default 10)")
    parser.add_argument("--list-workloads", action="store_true", help="list the shipped workloads and exit")


def run(args: argparse.Namespace) -> int:
    from epp.sim.cluster.report import render_text
    from epp.sim.cluster.simulate import expand_policies, simulate
    from epp.sim.cluster.workload import builtin_names, load_workload

    if args.list_workloads:
        for name in builtin_names():
            print(name)
        return 0
    if not args.workload:
        print("error: --workload is required (a file, or one of: " + ", ".join(builtin_names()) + ")",
              file=sys.stderr)
        return 2
    from epp.sim.pool import parse_pods, pool_size

    try:
        pods = parse_pods(args.pods)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        workload = load_workload(args.workload)
        duration = _seconds(args.duration) if args.duration is not None else None
        refresh = _seconds(args.refresh_interval)
        horizon = _seconds(args.horizon) if args.horizon is not None else None
        warmup = _seconds(args.warmup) if args.warmup is not None else None
        if refresh <= 0:
            raise ConfigError("--refresh-interval: must be > 0")
        if args.rate_scale <= 0:
            raise ConfigError("--rate-scale: must be > 0")
        workload = workload.scaled(rate=args.rate_scale, duration=duration, max_requests=args.requests,
                                   warmup=warmup)
        arms = [_arm(path, len(args.config)) for path in args.config]
        policies = expand_policies(args.policy or ["epp"], arms)
        if args.plots:
            from epp.sim.cluster.plots import have_matplotlib

            if not have_matplotlib():
                raise ConfigError("--plots needs matplotlib (pip install 'epp[sim]')")
        reports = simulate(workload, pods=pods, policies=policies, seed=args.seed, refresh_interval=refresh,
                           horizon=horizon, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render_text(reports, max_tenants=args.tenants))
    if args.json:
        data = {"workload": workload.name, "pods": pool_size(pods), "pod_spec": args.pods,
                "reports": [r.to_json() for r in reports]}
        Path(args.json).write_text(json.dumps(data, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plots:
        from epp.sim.cluster.plots import write_plots

        for path in write_plots(reports, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _seconds(text: str) -> float:
    """A duration: bare seconds ("30", "0.05") or a Go-style string ("30s", "50ms")."""
    try:
        return float(text)
    except ValueError:
        return parse_duration(text)


def _arm(path: str, count: int) -> EppArm:
    """An EPP arm from a config file, validated now (with the field path) rather than mid-run."""
    from epp.core import build_core
    from epp.datastore import Datastore
    from epp.sim.cluster.simulate import EppArm

    text = Path(path).read_text()
    build_core(Datastore(), text, tick=0.05)
    return EppArm(name="epp" if count == 1 else f"epp:{Path(path).stem}", config_text=text)
