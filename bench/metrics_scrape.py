"""What scraping the EPP's own `/metrics` costs its requests, after a flood of new model names.

First the EPP is sent `--names` requests, each with a new 200-character model name (the traffic
that once grew `/metrics` to 431 MB); then closed-loop windows alternate between quiet and with
`/metrics` fetched `--scrape-rate` times a second (Prometheus fetches it once every 15-30 s; 10/s
is a dashboard or two and a few eager scrapers, 0 means back to back from two clients). Machine
noise hits both alike; the report gives ratios (scraped / quiet) of throughput and latency, and
the size and fetch time of `/metrics`.

    python -m bench.metrics_scrape [--names 2000] [--duration 4] [--rounds 3] [--scrape-rate 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import aiohttp
import orjson

from bench.common import MODEL, RESULTS, closed_loop, epp_command, free_ports, log, pct, start_process, stop_process, \
    wait_http
from bench.pods import Pods, PodSpec
from epp.local.envoy import EnvoyConfig, EnvoyProcess


async def flood_names(url: str, count: int) -> None:
    """`count` requests, each naming a model nobody serves (the pods answer 404; the EPP counts it)."""
    bodies = [orjson.dumps({"model": f"{i:06d}-" + "n" * 193, "prompt": "hi", "max_tokens": 1}) for i in range(count)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as session:
        async def send(body: bytes) -> None:
            async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
                await r.read()

        for i in range(0, count, 64):
            await asyncio.gather(*(send(b) for b in bodies[i:i + 64]))


async def scrape_forever(url: str, rate: float, sizes: list[int], times: list[float]) -> None:
    """Fetch `url` `rate` times a second (0: back to back) until cancelled."""
    async with aiohttp.ClientSession() as session:
        while True:
            start = time.perf_counter()
            async with session.get(url) as r:
                body = await r.read()
            times.append(time.perf_counter() - start)
            sizes.append(len(body))
            if rate > 0:
                await asyncio.sleep(max(0.0, start + 1 / rate - time.perf_counter()))


async def measure(args: argparse.Namespace) -> str:
    sim = Pods(PodSpec(count=2, profile="h100-llama3-8b", num_gpu_blocks=0, max_num_seqs=256, time_scale=0.0001),
               "metrics-scrape")
    sim.start()
    grpc_port, health, metrics_port, envoy_port, admin_port = free_ports(5)
    epp = start_process(epp_command("serve", "--static-endpoints", ",".join(sim.addresses), "--grpc-port",
                                    str(grpc_port), "--grpc-health-port", str(health), "--metrics-port",
                                    str(metrics_port), "--bind-address", "127.0.0.1", "--v", "1"),
                        "metrics-scrape-epp")
    envoy: EnvoyProcess | None = None
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        wait_http(metrics_url, proc=epp)
        envoy = EnvoyProcess(EnvoyConfig(envoy_port, admin_port, grpc_port, epp_tls=True))
        envoy.start()
        url = envoy.url + "/v1/completions"
        log(f"flooding {args.names} new model names")
        await flood_names(url, args.names)
        body = orjson.dumps({"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
                             "max_tokens": 1})
        await closed_loop(url, body, 4, 1.0)  # warm up
        results = {"quiet": [], "scraped": []}
        sizes: list[int] = []
        times: list[float] = []
        for _ in range(args.rounds):
            for name in results:
                log(f"closed loop: {name}")
                clients = (1 if args.scrape_rate > 0 else 2) if name == "scraped" else 0
                scrapers = [asyncio.create_task(scrape_forever(metrics_url, args.scrape_rate, sizes, times))
                            for _ in range(clients)]
                results[name].append(await closed_loop(url, body, args.concurrency, args.duration))
                for task in scrapers:
                    task.cancel()
                await asyncio.gather(*scrapers, return_exceptions=True)
        merged = {}
        for name, runs in results.items():
            m = runs[0]
            for r in runs[1:]:
                m.merge(r)
            merged[name] = m
        quiet, scraped = merged["quiet"], merged["scraped"]
        figures = {
            "metrics_bytes": max(sizes) if sizes else 0,
            "scrapes": len(times),
            "scrape_p50_ms": pct(times, 0.5) * 1000 if times else 0.0,
            "throughput_ratio": scraped.rps / quiet.rps if quiet.rps else 0.0,
            "p50_ratio": pct(scraped.latencies, 0.5) / pct(quiet.latencies, 0.5),
            "p99_ratio": pct(scraped.latencies, 0.99) / pct(quiet.latencies, 0.99),
        }
        args.figures = figures
        lines = [f"# Scraping the EPP's /metrics under load ({time.strftime('%Y-%m-%d %H:%M')})", "",
                 f"After {args.names} requests with new 200-character model names; 2 simulated pods, Envoy, EPP with "
                 f"TLS and the default config. {args.concurrency} closed-loop clients, {args.rounds} rounds of "
                 f"{args.duration:.0f} s per window, alternating; in the scraped windows /metrics is fetched "
                 + (f"{args.scrape_rate:g} times a second." if args.scrape_rate > 0
                    else "back to back by two clients."),
                 "",
                 "| window | req/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|"]
        for name, m in merged.items():
            lines.append(f"| {name} | {m.rps:,.0f} | {pct(m.latencies, .5) * 1000:.2f} | "
                         f"{pct(m.latencies, .99) * 1000:.2f} | {m.errors} |")
        lines += ["", f"/metrics: {figures['metrics_bytes']:,} bytes, {figures['scrapes']} fetches, "
                      f"p50 {figures['scrape_p50_ms']:.1f} ms.", "",
                  f"**Scraped / quiet: throughput {figures['throughput_ratio']:.2f}, p50 latency "
                  f"{figures['p50_ratio']:.2f}, p99 latency {figures['p99_ratio']:.2f}**", ""]
        return "\n".join(lines)
    finally:
        if envoy is not None:
            envoy.close()
        stop_process(epp)
        sim.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--names", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--scrape-rate", type=float, default=10.0, help="fetches per second; 0: back to back")
    parser.add_argument("--out", default=str(RESULTS / "metrics-scrape.md"))
    args = parser.parse_args(argv)
    report = asyncio.run(measure(args))
    with open(args.out, "w") as f:
        f.write(report)
    with open(str(args.out).removesuffix(".md") + ".json", "w") as f:
        json.dump(getattr(args, "figures", {}), f)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
