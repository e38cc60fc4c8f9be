"""What the picker costs a request: Envoy → EPP → pod against Envoy → pod, measured in one run.

The Envoys run side by side in front of the same simulated pods (nearly zero model time), and the
measurements alternate between them, so machine noise hits all alike. Reported as ratios. The
EPP sits behind two Envoy configs: `shipped` (epp/local/envoy.py, manifests/: responses never
wait on the EPP) and `reference` (the reference's, every response chunk through the EPP).

    python -m bench.overhead [--duration 5] [--concurrency 16] [--rates 50,100,200] [--workers-arm/--no-workers-arm]
    python -m bench.overhead --epp-arg=--workers=2 --out bench/results/overhead-workers2.md

The workers arm (`measure_workers`): the same closed loop through `epp serve --workers 1` and
`--workers 2` and Envoy alone, rounds alternating, reported as ratios to Envoy alone, with the
EPP's CPU per request over all its processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import orjson

from bench.common import (RESULTS, closed_loop, cpu_seconds, epp_command, free_ports, machine_load, open_loop, pct,
                          start_process, stop_process, wait_http)
from bench.pods import Pods, PodSpec
from epp.local.envoy import EnvoyConfig, EnvoyProcess

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def row(name: str, result) -> str:  # type: ignore[no-untyped-def]
    return (f"| {name} | {result.rps:,.0f} | {pct(result.latencies, 0.5) * 1000:.2f} | "
            f"{pct(result.latencies, 0.99) * 1000:.2f} | {result.errors} |")


async def measure(args: argparse.Namespace) -> str:
    pods = args.pods
    sim = Pods(PodSpec(count=pods, profile="h100-llama3-8b", num_gpu_blocks=0, max_num_seqs=256, time_scale=0.0001),
               "overhead")
    sim.start()
    addresses = ",".join(sim.addresses)
    grpc_port, health, metrics, *envoy_ports = free_ports(9)
    epp = start_process(epp_command("serve", "--static-endpoints", addresses, "--grpc-port", str(grpc_port),
                                    "--grpc-health-port", str(health), "--metrics-port", str(metrics),
                                    "--bind-address", "127.0.0.1", "--v", "1", *args.epp_arg), "overhead-epp")
    envoys: list[EnvoyProcess] = []
    try:
        wait_http(f"http://127.0.0.1:{metrics}/metrics", proc=epp)
        shipped = EnvoyProcess(EnvoyConfig(envoy_ports[0], envoy_ports[1], grpc_port, epp_tls=True))
        reference = EnvoyProcess(EnvoyConfig(envoy_ports[2], envoy_ports[3], grpc_port, epp_tls=True,
                                             response_body_mode="FULL_DUPLEX_STREAMED"))
        direct = EnvoyProcess(EnvoyConfig(envoy_ports[4], envoy_ports[5], 0, with_ext_proc=False,
                                          upstreams=tuple(addresses.split(","))))
        envoys = [shipped, reference, direct]
        for e in envoys:
            e.start()
        body = orjson.dumps({"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
                             "max_tokens": 1})
        paths = {"envoy + epp (shipped)": shipped.url + "/v1/completions",
                 "envoy + epp (reference)": reference.url + "/v1/completions",
                 "envoy only": direct.url + "/v1/completions"}
        for url in paths.values():  # warm up connections and caches
            await closed_loop(url, body, 4, 1.0)
        extra = f" `epp serve {' '.join(args.epp_arg)}`." if args.epp_arg else ""
        lines = [f"# Picker overhead ({time.strftime('%Y-%m-%d %H:%M')})", "",
                 f"{pods} simulated pods (model time ~0), Envoy --concurrency 1, EPP with TLS and the default "
                 f"config{extra} `shipped`: this project's Envoy config (responses never wait on the EPP); "
                 "`reference`: every response chunk through the EPP. Client: one aiohttp process; load average "
                 f"{machine_load()} at the start.", "",
                 f"## Closed loop, {args.concurrency} concurrent clients, {args.duration:.0f} s each (alternating, "
                 f"{args.rounds} rounds)", "",
                 "| path | req/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|"]
        closed: dict[str, list] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, url in paths.items():
                print(f"closed loop: {name}", file=sys.stderr)
                closed[name].append(await closed_loop(url, body, args.concurrency, args.duration))
        merged = {}
        for name, results in closed.items():
            m = results[0]
            for r in results[1:]:
                m.merge(r)
            merged[name] = m
            lines.append(row(name, m))
        base = merged["envoy only"]
        figures: dict[str, float] = {}
        lines.append("")
        for name in ("envoy + epp (shipped)", "envoy + epp (reference)"):
            ratio = merged[name].rps / base.rps
            added = (pct(merged[name].latencies, .5) - pct(base.latencies, .5)) * 1000
            key = name.split("(")[1].rstrip(")")
            figures[f"throughput_ratio_{key}"] = ratio
            figures[f"added_p50_ms_{key}"] = added
            lines.append(f"**Throughput with the EPP ({key}) / without: {ratio:.2f}** (p50 latency added: {added:.2f} ms)")
        figures["throughput_ratio"] = figures["throughput_ratio_shipped"]
        lines += ["", f"## Open loop at fixed rates, {args.duration:.0f} s each", "",
                  "| rate | path | p50 ms | p99 ms | errors | added p50 ms | added p99 ms |", "|---|---|---|---|---|---|---|"]
        for rate in args.rates:
            results = {}
            for name, url in paths.items():
                print(f"open loop {rate}/s: {name}", file=sys.stderr)
                results[name] = await open_loop(url, body, rate, args.duration)
            b = results["envoy only"]
            for name, r in results.items():
                added = ((pct(r.latencies, .5) - pct(b.latencies, .5)) * 1000,
                         (pct(r.latencies, .99) - pct(b.latencies, .99)) * 1000)
                if name != "envoy only":
                    key = name.split("(")[1].rstrip(")")
                    figures[f"added_p99_ms_{key}_{rate:.0f}"] = added[1]
                extra_cells = f"{added[0]:.2f} | {added[1]:.2f}" if name != "envoy only" else " | "
                lines.append(f"| {rate:.0f}/s | {name} | {pct(r.latencies, .5) * 1000:.2f} | "
                             f"{pct(r.latencies, .99) * 1000:.2f} | {r.errors} | {extra_cells} |")
        args.figures = figures
        return "\n".join(lines) + "\n"
    finally:
        for e in envoys:
            e.close()
        stop_process(epp)
        sim.stop()


def pod_cpu_parts(pid: int) -> dict[str, float]:
    """CPU seconds of a process and its live descendants (an `epp serve --workers N` pod), by part:
    `main` (the process started: a pod's supervisor, or the one EPP process), `scraper` (the
    scraper process), `workers` (the other descendants: the pod's members)."""
    parts = {"main": cpu_seconds(pid), "scraper": 0.0, "workers": 0.0}
    for child in _descendants(pid):
        try:
            command = open(f"/proc/{child}/cmdline", "rb").read()
        except OSError:
            continue
        parts["scraper" if b"scrape_process" in command else "workers"] += cpu_seconds(child)
    return parts


def _descendants(pid: int) -> list[int]:
    try:
        children = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []
    return children + [d for c in children for d in _descendants(c)]


async def measure_workers(args: argparse.Namespace) -> str:
    """Closed-loop req/s through Envoy + `epp serve --workers 1` and `--workers 2`, against Envoy
    alone, in one run. Each EPP Envoy opens a connection per two streams (the kernel spreads
    connections, not streams, over a pod's workers; the chart's standalone Envoy does the same)."""
    sim = Pods(PodSpec(count=args.pods, profile="h100-llama3-8b", num_gpu_blocks=0, max_num_seqs=256,
                       time_scale=0.0001), "overhead-workers")
    sim.start()
    addresses = ",".join(sim.addresses)
    procs, envoys = [], []
    paths: dict[str, str] = {}
    pod_of: dict[str, int] = {}  # path -> the EPP's pid
    try:
        for workers in (1, 2):
            grpc_port, health, metrics, listen, admin = free_ports(5)
            proc = start_process(epp_command(
                "serve", "--workers", str(workers), "--static-endpoints", addresses, "--grpc-port", str(grpc_port),
                "--grpc-health-port", str(health), "--metrics-port", str(metrics), "--admin-port", "-1",
                "--bind-address", "127.0.0.1", "--v", "1"), f"overhead-epp-w{workers}")
            procs.append(proc)
            wait_http(f"http://127.0.0.1:{metrics}/metrics", proc=proc, timeout=120)
            envoy = EnvoyProcess(EnvoyConfig(listen, admin, grpc_port, epp_tls=True,
                                             epp_max_concurrent_streams=args.epp_streams))
            envoy.start()
            envoys.append(envoy)
            paths[f"envoy + epp --workers {workers}"] = envoy.url + "/v1/completions"
            pod_of[f"envoy + epp --workers {workers}"] = proc.pid
        listen, admin = free_ports(2)
        direct = EnvoyProcess(EnvoyConfig(listen, admin, 0, with_ext_proc=False, upstreams=tuple(sim.addresses)))
        direct.start()
        envoys.append(direct)
        paths["envoy only"] = direct.url + "/v1/completions"
        body = orjson.dumps({"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
                             "max_tokens": 1})
        for url in paths.values():
            await closed_loop(url, body, 4, 1.0)
        closed: dict[str, list] = {name: [] for name in paths}
        cpu: dict[str, dict[str, float]] = {name: {"main": 0.0, "scraper": 0.0, "workers": 0.0} for name in paths}
        for _ in range(args.rounds):
            for name, url in paths.items():
                print(f"closed loop: {name}", file=sys.stderr)
                before = pod_cpu_parts(pod_of[name]) if name in pod_of else {}
                closed[name].append(await closed_loop(url, body, args.concurrency, args.duration))
                if name in pod_of:
                    for part, seconds in pod_cpu_parts(pod_of[name]).items():
                        cpu[name][part] += seconds - before.get(part, 0.0)
        merged = {}
        for name, results in closed.items():
            m = results[0]
            for r in results[1:]:
                m.merge(r)
            merged[name] = m
        base = merged["envoy only"].rps
        lines = ["", f"## Workers: closed loop, {args.concurrency} clients, {args.duration:.0f} s x {args.rounds} "
                 "rounds each (alternating)", "",
                 f"{args.pods} simulated pods, default config, TLS; the EPP Envoys cap streams per EPP connection "
                 f"at {args.epp_streams}. Everything (client, Envoys, EPP processes, pods) shares this machine's cores.", "",
                 f"Machine load average at the end: {machine_load()}.", "",
                 "| path | req/s | ÷ envoy only | p50 ms | p99 ms | errors | EPP CPU ms/req (all its processes) | "
                 "of which main / workers / scraper |",
                 "|---|---|---|---|---|---|---|---|"]
        for name, m in merged.items():
            requests = len(m.latencies)
            per_request = parts = ""
            if name in pod_of and requests:
                share = {part: seconds / requests * 1000 for part, seconds in cpu[name].items()}
                per_request = f"{sum(share.values()):.2f}"
                parts = f"{share['main']:.2f} / {share['workers']:.2f} / {share['scraper']:.2f}"
            lines.append(f"| {name} | {m.rps:,.0f} | {m.rps / base:.2f} | {pct(m.latencies, 0.5) * 1000:.2f} | "
                         f"{pct(m.latencies, 0.99) * 1000:.2f} | {m.errors} | {per_request} | {parts} |")
        figures = getattr(args, "figures", {})
        for workers in (1, 2):
            figures[f"throughput_ratio_workers_{workers}"] = merged[f"envoy + epp --workers {workers}"].rps / base
        args.figures = figures
        return "\n".join(lines) + "\n"
    finally:
        for e in envoys:
            e.close()
        for proc in procs:
            stop_process(proc)
        sim.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[50.0, 100.0, 200.0])
    parser.add_argument("--epp-arg", action="append", default=[],
                        help="an extra `epp serve` argument (repeat), e.g. --epp-arg=--workers=2")
    parser.add_argument("--out", default=str(RESULTS / "overhead.md"))
    parser.add_argument("--workers-only", action="store_true", help="only the workers arm")
    parser.add_argument("--epp-streams", type=int, default=2,
                        help="workers arm: streams per Envoy connection to the EPP (more connections to spread)")
    parser.add_argument("--workers-arm", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure epp serve --workers 1 and 2 (measure_workers)")
    args = parser.parse_args(argv)
    report = "" if args.workers_only else asyncio.run(measure(args))
    if args.workers_arm:
        report += asyncio.run(measure_workers(args))
    with open(args.out, "w") as f:
        f.write(report)
    with open(str(args.out).removesuffix(".md") + ".json", "w") as f:
        json.dump(getattr(args, "figures", {}), f)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
