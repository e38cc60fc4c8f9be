"""What the picker itself costs: request rate, CPU per request, the pick, scraping, and the token path.

    python -m bench.cost                    # all parts (~4 min)
    python -m bench.cost --parts scrape     # one part: rate | pick | prompt | scrape | tokens | floor | index
    python -m bench.cost --parts scrape --endpoints 100 --scrape-modes process   # some of it
    python -m bench.cost --quick

CPU is the EPP's own user+system time (all threads, and its scraper process) from
/proc/<pid>/stat, read before and after a fixed amount of work, so other processes on the
machine do not count against it. Two Envoy configs are compared wherever responses matter:
`shipped` (this project's: the picking filter has no response phase, an observer filter in
observability mode reports a streamed response's first token and Envoy's access log every usage;
epp/local/envoy.py, manifests/) and `reference`
(the reference's: every response chunk through the EPP, FULL_DUPLEX_STREAMED).

- rate: the highest request rate one EPP process sustains with 10 and 100 endpoints (closed loop
  through Envoy; the endpoints are cheap stub pods in one Envoy, see `bench/stubpods.py`), and
  its CPU per request.
- pick: the scheduling cycle alone, in-process (no gRPC): µs per candidate at 10 and 100
  candidates with the default (predicted-latency) profile, and a whole request through the
  director (admission, pick, accounting, trace, metrics).
- prompt: CPU per request for 8k- and 100k-token prompts, with the default prefix matching (the
  first 256 blocks) and with matching over the whole prompt.
- scrape: CPU to scrape 10 and 100 pods at the default 50 ms interval with vLLM-sized pages and no
  traffic, in the scraper process against the in-loop scraper (`--scrape-in-process`), in the
  same run, with pages whose numbers move on every scrape (`bench/moving_pages.py`) and with
  static ones (which back off); and the metrics' age as the EPP exposes it.
- tokens: inter-token latency and EPP CPU per streamed chunk on both Envoy configs, same EPP,
  same pod, alternating; Envoy without the EPP as the floor (one pod: with two, the routing
  would decide the batch sizes, and with them the ITL).
- floor: the same loads against an ext_proc server that does nothing (`bench/grpc_floor.py`):
  the CPU gRPC in Python costs per request and per chunk before the EPP does any work.
- index: the approximate prefix index's add and end when a pod's requests in flight pin more
  blocks than its cache holds (deep overload), against the same traffic within its capacity.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from bench.client import Outcome, _send
from bench.common import (MODEL, RESULTS, LoadResult, closed_loop, cpu_seconds, epp_command, free_ports, log,
                          machine_load, pct, start_process, stop_process, timed_post, wait_http, write_report)
from bench.pods import Pods, PodSpec
from bench.stubpods import StubPods
from bench.workloads import COMPLETION, WORDS, Planned
from epp.local.envoy import EnvoyConfig, EnvoyProcess

SHIPPED = "shipped"  # responses off the EPP, the observer filter (EnvoyConfig's default)
REFERENCE = "reference"  # every response chunk through the EPP
FULL, NONE = REFERENCE, SHIPPED  # the names other benchmarks import


def envoy_config(listen: int, admin: int, grpc_port: int, mode: str, *, tls: bool = True) -> EnvoyConfig:
    if mode == REFERENCE:
        return EnvoyConfig(listen, admin, grpc_port, epp_tls=tls, response_body_mode="FULL_DUPLEX_STREAMED")
    return EnvoyConfig(listen, admin, grpc_port, epp_tls=tls)


@contextmanager
def mode_envoys(grpc_port: int, modes: tuple[str, ...] = (SHIPPED, REFERENCE), *,
                tls: bool = True) -> Iterator[dict[str, EnvoyProcess]]:
    """One started Envoy per Envoy config in `modes`, in front of the ext_proc server on `grpc_port`."""
    envoys: dict[str, EnvoyProcess] = {}
    try:
        for mode in modes:
            listen, admin = free_ports(2)
            envoys[mode] = EnvoyProcess(envoy_config(listen, admin, grpc_port, mode, tls=tls))
            envoys[mode].start()
        yield envoys
    finally:
        for envoy in envoys.values():
            envoy.close()

FULL_MATCH_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
  parameters: {maxPrefixTokensToMatch: 131072}
- type: active-request-scorer
- type: metrics-data-source
- type: core-metrics-extractor
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: active-request-scorer, weight: 2}
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors: [{pluginRef: core-metrics-extractor}]
"""


@dataclass(slots=True)
class Epp:
    proc: subprocess.Popen[bytes]
    grpc_port: int
    metrics_port: int = 0
    envoys: dict[str, EnvoyProcess] = field(default_factory=dict)

    def children(self) -> list[int]:
        try:
            text = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def cpu(self) -> float:
        """The EPP's CPU seconds, its scraper process's included."""
        return self.main_cpu() + self.child_cpu()

    def main_cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def child_cpu(self) -> float:
        total = 0.0
        for pid in self.children():
            try:
                total += cpu_seconds(pid)
            except OSError:
                pass
        return total


@contextmanager
def epp_stack(endpoints: list[str], tag: str, modes: tuple[str, ...] = (SHIPPED, REFERENCE),
              extra: tuple[str, ...] = (), config_text: str = "") -> Iterator[Epp]:
    """An `epp serve` process over `endpoints` with one Envoy per response body mode."""
    grpc_port, health, metrics = free_ports(3)
    args = ["serve", "--static-endpoints", ",".join(endpoints), "--grpc-port", str(grpc_port),
            "--grpc-health-port", str(health), "--metrics-port", str(metrics), "--bind-address", "127.0.0.1",
            "--v", "1", *extra]
    tmp = None
    if config_text:
        tmp = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="bench-epp-", delete=False)
        tmp.write(config_text)
        tmp.close()
        args += ["--config-file", tmp.name]
    proc = start_process(epp_command(*args), f"cost-{tag}-epp")
    epp = Epp(proc, grpc_port, metrics)
    try:
        wait_http(f"http://127.0.0.1:{metrics}/metrics", proc=proc)
        with mode_envoys(grpc_port, modes) as envoys:
            epp.envoys.update(envoys)
            time.sleep(0.5)
            yield epp
    finally:
        stop_process(proc)
        if tmp is not None:
            Path(tmp.name).unlink(missing_ok=True)


@contextmanager
def plain_envoy(endpoints: list[str]) -> Iterator[EnvoyProcess]:
    listen, admin = free_ports(2)
    envoy = EnvoyProcess(EnvoyConfig(listen, admin, 0, with_ext_proc=False, upstreams=tuple(endpoints)))
    try:
        envoy.start()
        yield envoy
    finally:
        envoy.close()


def prompt_bodies(rng: random.Random, tokens: int, count: int) -> list[bytes]:
    """Distinct completion bodies of about `tokens` tokens (4 characters each), max_tokens 1."""
    return [orjson.dumps({"model": MODEL, "prompt": f"req {i} {rng.random()} " + " ".join(rng.choices(WORDS, k=tokens)),
                          "max_tokens": 1}) for i in range(count)]


# --------------------------------------------------------------------------- rate


async def part_rate(args: argparse.Namespace) -> list[str]:
    rng = random.Random(5)
    bodies = prompt_bodies(rng, 200, 2000)
    lines = ["## Highest request rate of one EPP process", "",
             f"Closed loop, {args.concurrency} concurrent clients, {args.duration:g} s per path, two alternating "
             "rounds; distinct ~200-token prompts, max_tokens 1 (not streamed); endpoints are stub pods (Envoy "
             "direct responses) that the EPP also scrapes every 50 ms. `EPP CPU` is the EPP's CPU time ÷ wall "
             "time (its request-path process and its scraper process); `CPU/req` the request-path process's CPU "
             "time per request (scraping is not in it: it runs in the scraper process), so 1 / (CPU/req) is the "
             "rate one fully busy core would sustain. Goal: ≤ 0.5 ms at 10 endpoints, ≤ 1 ms at 100.", "",
             "| endpoints | path | req/s | p50 ms | p99 ms | errors | EPP CPU (cores) | CPU/req (request path) | "
             "1 core would do |", "|---|---|---|---|---|---|---|---|---|"]
    for n in args.endpoints:
        log(f"rate: {n} endpoints")
        with StubPods(n) as stubs, epp_stack(stubs.addresses, f"rate{n}") as epp, plain_envoy(stubs.addresses) as bare:
            paths = {f"envoy + epp ({SHIPPED})": epp.envoys[SHIPPED].url,
                     f"envoy + epp ({REFERENCE})": epp.envoys[REFERENCE].url, "envoy only": bare.url}
            for url in paths.values():
                await closed_loop(url + "/v1/completions", bodies, 4, 0.5)
            merged: dict[str, tuple[LoadResult, float, float, float]] = {}
            for _ in range(2):
                for name, url in paths.items():
                    c0, m0, t0 = epp.cpu(), epp.main_cpu(), time.perf_counter()
                    r = await closed_loop(url + "/v1/completions", bodies, args.concurrency, args.duration)
                    c1, m1, t1 = epp.cpu(), epp.main_cpu(), time.perf_counter()
                    if name in merged:
                        prev, cpu, main, wall = merged[name]
                        prev.merge(r)
                        merged[name] = (prev, cpu + c1 - c0, main + m1 - m0, wall + t1 - t0)
                    else:
                        merged[name] = (r, c1 - c0, m1 - m0, t1 - t0)
                    log(f"  {name}: {r.rps:,.0f} req/s")
            for name, (r, cpu, main, wall) in merged.items():
                per = main / len(r.latencies) if r.latencies and "epp" in name else float("nan")
                args.figures.setdefault("rate", {})[f"{n} {name}"] = {"rps": r.rps, "cpu_per_req": per,
                                                                         "cores": cpu / wall,
                                                                         "p50": pct(r.latencies, .5)}
                lines.append(f"| {n} | {name} | {r.rps:,.0f} | {pct(r.latencies, .5) * 1e3:.1f} | "
                             f"{pct(r.latencies, .99) * 1e3:.1f} | {r.errors} | {cpu / wall:.2f} | "
                             + (f"{per * 1e3:.2f} ms | {1 / per:,.0f} req/s |" if per == per else "– | – |"))
            shipped, bare_r = merged[f"envoy + epp ({SHIPPED})"][0], merged["envoy only"][0]
            lines.append(f"| {n} | **with the EPP (shipped) ÷ without** | **{shipped.rps / bare_r.rps:.2f}×** | "
                         "| | | | | |")
    return lines


# --------------------------------------------------------------------------- prompt size


async def part_prompt(args: argparse.Namespace) -> list[str]:
    rng = random.Random(8)
    sizes = [(8_000, args.prompt_requests[0]), (100_000, args.prompt_requests[1])]
    lines = ["## CPU per request by prompt size", "",
             "Distinct prompts (no shared prefix: every block is new to the index), Envoy + EPP on the shipped "
             f"config, 10 stub endpoints, {args.prompt_concurrency} concurrent clients, a fixed "
             "number of requests. Cores per request/s equals CPU-seconds per request. The reference's successor "
             "documents about **0.5–1 core per request/s** at 100k-token prompts (its sizing guide).", "",
             "| prefix matching | prompt tokens | body KB | requests | EPP CPU/req | cores per req/s | "
             "client p50 ms |", "|---|---|---|---|---|---|---|"]
    with StubPods(10) as stubs:
        for label, config in (("default (first 256 blocks)", ""), ("whole prompt (maxPrefixTokensToMatch 131072)",
                                                                   FULL_MATCH_CONFIG)):
            with epp_stack(stubs.addresses, "prompt", modes=(SHIPPED,), config_text=config) as epp:
                url = epp.envoys[SHIPPED].url + "/v1/completions"
                for tokens, count in sizes:
                    log(f"prompt: {tokens:,} tokens, {label}")
                    bodies = prompt_bodies(rng, tokens, count)
                    await closed_loop(url, bodies[:2], 1, 0.3)  # warm up
                    c0 = epp.cpu()
                    r = await _fixed(url, bodies, args.prompt_concurrency)
                    cpu = epp.cpu() - c0
                    per = cpu / max(1, len(r.latencies))
                    args.figures.setdefault("prompt", {})[f"{tokens} {'default' if not config else 'whole'}"] = per
                    lines.append(f"| {label} | {tokens:,} | {len(bodies[0]) / 1024:,.0f} | {len(r.latencies)} "
                                 f"(+{r.errors} errors) | {per * 1e3:.1f} ms | {per:.3f} | "
                                 f"{pct(r.latencies, .5) * 1e3:.1f} |")
    return lines


async def _fixed(url: str, bodies: list[bytes], concurrency: int) -> LoadResult:
    """Send every body once, `concurrency` at a time."""
    import aiohttp

    result = LoadResult()
    queue = list(reversed(bodies))
    start = time.perf_counter()

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            await timed_post(session, url, queue.pop(), result)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    result.elapsed = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------- the pick, in-process


def _pick_core(n: int, seed: int):  # type: ignore[no-untyped-def]
    """The default config's core over `n` endpoints with scraped metrics, as `epp serve` builds it."""
    from epp.core import build_core
    from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
    from epp.observability.metrics import EppMetrics
    from epp.observability.trace import DecisionTrace

    rng = random.Random(seed)
    datastore = Datastore()
    core = build_core(datastore, None, tick=0.05, metrics=EppMetrics(datastore), trace=DecisionTrace(), seed=seed)
    for i in range(n):
        ep = datastore.upsert(EndpointSpec(f"pod-{i}", f"10.1.{i // 250}.{i % 250}", 8000))
        ep.update_metrics(EndpointMetrics(
            waiting_queue_size=rng.randint(0, 4), running_requests=rng.randint(0, 20),
            kv_cache_usage=rng.random() * 0.6, models=frozenset({MODEL}), cache_block_size=16,
            cache_num_blocks=4096, update_time=datastore.clock()))
    return datastore, core


async def part_pick(args: argparse.Namespace) -> list[str]:
    from epp.api.request import parse_request

    lines = ["## The pick alone (in-process, no gRPC)", "",
             "The default profile (predicted-latency: approximate prefix producer, predicted-latency producer, "
             "SLO filter, latency scorer, max-score picker) over endpoints with scraped metrics and a ledger of "
             f"outstanding requests (2 per endpoint, booked by earlier picks); {args.pick_requests} distinct "
             "~200-token prompts. `pick` is `Scheduler.schedule`; `request` is the director's whole request "
             "(admission, pick, accounting, decision trace, metrics) and its release. Goal: the pick ≤ 20 µs "
             "per candidate (100 candidates ≤ 2 ms).", "",
             "| candidates | pick | per candidate | request (director) |", "|---|---|---|---|"]
    for n in args.endpoints:
        datastore, core = _pick_core(n, seed=3)
        rng = random.Random(4)
        bodies = prompt_bodies(rng, 200, args.pick_requests + 2 * n)

        def parsed(i: int, body: bytes):  # type: ignore[no-untyped-def]
            return parse_request(body, path="/v1/completions", request_id=str(i), headers={})

        for i, body in enumerate(bodies[:2 * n]):  # outstanding work on every endpoint
            await core.director.handle_request(parsed(i, body))
        requests = [parsed(i, b) for i, b in enumerate(bodies[2 * n:])]
        candidates = list(datastore.endpoints())
        scheduler = core.config.scheduler
        half = len(requests) // 2
        t0 = time.perf_counter()
        for request in requests[:half]:
            scheduler.schedule(request, candidates)
        t1 = time.perf_counter()
        for request in requests[half:]:
            _, record = await core.director.handle_request(request)
            core.director.release(record)
        t2 = time.perf_counter()
        pick = (t1 - t0) / half
        whole = (t2 - t1) / (len(requests) - half)
        args.figures.setdefault("pick", {})[str(n)] = {"pick": pick, "per_candidate": pick / n, "request": whole}
        lines.append(f"| {n} | {pick * 1e6:,.0f} µs | {pick / n * 1e6:.1f} µs | {whole * 1e6:,.0f} µs |")
    return lines


async def part_index(args: argparse.Namespace) -> list[str]:
    """The approximate prefix index's add and end when a pod's requests in flight pin more blocks
    than its cache holds (deep overload: up to 2.6× on the mixed B2B overload), against the same
    traffic within the capacity, in one run."""
    from epp.scheduling.plugins._prefix_index import PrefixIndex

    blocks, capacity, ends = 80, 1200, 4000

    def per_request(in_flight: int) -> float:
        index, keys, flying = PrefixIndex(), itertools.count(), collections.deque()

        def pick() -> None:  # a new request's blocks, pinned on the pod
            flying.append([next(keys) for _ in range(blocks)])
            index.add(flying[-1], "pod", capacity, 20)

        for _ in range(in_flight):
            pick()
        started = time.perf_counter()
        for _ in range(ends):
            pick()
            index.touch(flying.popleft(), "pod")
        return (time.perf_counter() - started) / ends

    within, beyond = per_request(10), per_request(40)
    args.figures["index"] = {"within": within, "beyond": beyond}
    return ["## The prefix index in deep overload (in-process)", "",
            f"A pod's LRU of {capacity} blocks; each request pins {blocks} blocks (and 20 unhashed) from its "
            f"pick to its end; {ends} requests added and ended, with 10 (800 pinned blocks, within the "
            "capacity) or 40 (3,200 pinned, 2.7× it) in flight.", "",
            "| requests in flight | add + end | ratio |", "|---|---|---|",
            f"| 10 (within) | {within * 1e6:.0f} µs | 1.00× |",
            f"| 40 (2.7× the capacity) | {beyond * 1e6:.0f} µs | {beyond / within:.2f}× |"]


# --------------------------------------------------------------------------- scraping


def _ages(metrics_port: int) -> tuple[list[float], list[float]]:
    """Every endpoint's metrics age and scrape interval, as the EPP's /metrics shows them now."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    ages: list[float] = []
    intervals: list[float] = []
    for family in text_string_to_metric_families(text):
        if family.name == "inference_pool_endpoint_metrics_age_seconds":
            ages += [s.value for s in family.samples if s.value >= 0]
        elif family.name == "inference_pool_endpoint_scrape_interval_seconds":
            intervals += [s.value for s in family.samples]
    return ages, intervals


async def part_scrape(args: argparse.Namespace) -> list[str]:
    from bench.moving_pages import MovingPages

    lines = ["## Scraping cost (no traffic)", "",
             f"The EPP scrapes every endpoint's /metrics (a {_page_kb()} KB vLLM page) every 50 ms (the default) "
             f"for {args.scrape_seconds:g} s after a {args.settle:g} s settle. `moving`: pages whose queue, KV "
             "use and counters change on every scrape (a busy pod), served as vLLM serves them: the scraper asks "
             "for the series it reads (`?name[]=`, prometheus_client's filter, which vLLM's /metrics has), "
             f"a {_page_kb(True)} KB page; `whole`: the same moving pages from pods that ignore that filter (a "
             "server without it: the whole page every time); `static`: the whole page, the same every time (an idle pod, served "
             "by Envoy, which ignores the filter; the scraper backs off to 100 ms). `in-loop` is `--scrape-in-process` (today's scraper on the "
             "request loop), `process` the default (a scraper process publishing through shared memory); CPU is "
             "the EPP's main process plus its scraper process. Age: `inference_pool_endpoint_metrics_age_seconds` "
             f"sampled {args.age_samples} times over the window. The reference's successor reports about "
             "**7.5 cores at 100 model pods** from scraping. Goal: 100 pods every 50 ms ≤ 0.15 core, age unchanged.",
             "", "| endpoints | pages | scraper | scrapes/s | EPP CPU (cores) | of which scraper process | CPU per "
             "scrape | age mean ms | age p99 ms | interval mean ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n in args.endpoints:
        kinds = ("moving", "whole", "static") if n == max(args.endpoints) else ("moving", "static")
        for pages in (k for k in kinds if k in args.scrape_pages):
            source = MovingPages(n, whole=pages == "whole") if pages != "static" else StubPods(n)
            with source as pods:
                for mode in (m for m in ("in-loop", "process") if m in args.scrape_modes):
                    log(f"scrape: {n} endpoints, {pages} pages, {mode}")
                    extra = ("--scrape-in-process",) if mode == "in-loop" else ()
                    with epp_stack(pods.addresses, f"scrape{n}", modes=(), extra=extra) as epp:
                        await asyncio.sleep(args.settle)
                        s0, c0, k0, t0 = pods.requests_served(), epp.cpu(), epp.child_cpu(), time.perf_counter()
                        ages: list[float] = []
                        intervals: list[float] = []
                        for _ in range(args.age_samples):
                            await asyncio.sleep(args.scrape_seconds / args.age_samples)
                            a, i = _ages(epp.metrics_port)
                            ages += a
                            intervals += i
                        s1, c1, k1, t1 = pods.requests_served(), epp.cpu(), epp.child_cpu(), time.perf_counter()
                    wall = t1 - t0
                    rate = (s1 - s0) / wall
                    cores = (c1 - c0) / wall
                    child = (k1 - k0) / wall
                    per = (c1 - c0) / (s1 - s0) if s1 > s0 else float("nan")
                    key = f"{n} {pages} {mode}"
                    args.figures.setdefault("scrape", {})[key] = {
                        "scrapes": rate, "cores": cores, "child_cores": child, "per_scrape": per,
                        "age_mean": sum(ages) / len(ages) if ages else float("nan"), "age_p99": pct(ages, .99),
                        "interval_mean": sum(intervals) / len(intervals) if intervals else float("nan")}
                    f = args.figures["scrape"][key]
                    lines.append(f"| {n} | {pages} | {mode} | {rate:,.0f} | {cores:.3f} | {child:.3f} | "
                                 f"{per * 1e6:,.0f} µs | {f['age_mean'] * 1e3:.1f} | {f['age_p99'] * 1e3:.1f} | "
                                 f"{f['interval_mean'] * 1e3:.0f} |")
        base = args.figures["scrape"].get(f"{n} moving in-loop")
        new = args.figures["scrape"].get(f"{n} moving process")
        if base and new:
            def ratio(key: str) -> str:  # a tiny window can read 0 CPU ticks
                return f"**{new[key] / base[key]:.2f}×**" if base[key] > 0 else "n/a"

            lines.append(f"| {n} | moving | **process ÷ in-loop** | | {ratio('cores')} | | {ratio('per_scrape')} | "
                         f"{ratio('age_mean')} | | |")
    return lines


def _page_kb(asked: bool = False) -> str:
    """The whole page's size, or (`asked`) that of the page of the series a vLLM scrape asks for."""
    from urllib.parse import parse_qs

    from epp.sim.exposition import restrict
    from bench.stubpods import metrics_page
    from epp.datalayer.engines import BUILTIN_ENGINES

    page = metrics_page()
    if asked:
        page = restrict(page, set(parse_qs(BUILTIN_ENGINES["vllm"].query)["name[]"]))
    return f"{len(page) / 1024:.0f}"


# --------------------------------------------------------------------------- token path


async def _stream_loop(url: str, concurrency: int, duration: float, max_tokens: int) -> list[Outcome]:
    import aiohttp

    outcomes: list[Outcome] = []
    item = Planned(0.0, COMPLETION, {"prompt": "Tell me a long story about " + " ".join(WORDS[:40]),
                                     "max_tokens": max_tokens, "ignore_eos": True}, "stream")
    deadline = time.perf_counter() + duration
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def worker() -> None:
            while time.perf_counter() < deadline:
                await _send(session, url, MODEL, item, t0, outcomes)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


async def part_tokens(args: argparse.Namespace) -> list[str]:
    lines = ["## The token path", "",
             f"1 simulated pod (H100 step times, real time), {args.stream_concurrency} concurrent streams of "
             f"{args.stream_tokens} tokens, {args.duration:g} s per path, two alternating rounds, one EPP behind "
             "two Envoys: `shipped` (responses never wait on the EPP; the observer filter reports each streamed "
             "response's first token, Envoy's access log its usage and end) and `reference` (every chunk through "
             "the EPP); Envoy "
             "without the EPP as the floor. ITL = gap between SSE token events at the client; `added` is the "
             "difference to Envoy alone in the same run. EPP CPU per chunk includes the per-request work spread "
             "over the chunks. One pod, so that every path's streams share the same decode batch: with two, the "
             "EPP's split of the streams differs from Envoy's round-robin (its picks are not round-robin), "
             "their batch sizes with it, and the difference in ITL is the routing's, not the path's. Goal on "
             "the shipped config: ITL added ≤ 0.1 ms p99.", "",
             "| path | streams done | token events | ITL p50 ms | ITL p99 ms | ITL p99 added ms | TTFT p50 ms | "
             "EPP CPU (cores) | EPP CPU per chunk |", "|---|---|---|---|---|---|---|---|---|"]
    # One pod: the same decode batch on every path (the table's description says why).
    spec = PodSpec(count=1, profile="h100-llama3-8b", num_gpu_blocks=0, max_num_seqs=256, time_scale=1.0)
    with Pods(spec, "cost-tokens") as sims, epp_stack(sims.addresses, "tokens") as epp, \
            plain_envoy(sims.addresses) as bare:
        paths = {f"envoy + epp ({SHIPPED})": epp.envoys[SHIPPED].url,
                 f"envoy + epp ({REFERENCE})": epp.envoys[REFERENCE].url, "envoy only": bare.url}
        acc: dict[str, tuple[list[Outcome], float, float]] = {name: ([], 0.0, 0.0) for name in paths}
        for _ in range(2):
            for name, url in paths.items():
                log(f"tokens: {name}")
                c0, t0 = epp.cpu(), time.perf_counter()
                outs = await _stream_loop(url, args.stream_concurrency, args.duration, args.stream_tokens)
                c1, t1 = epp.cpu(), time.perf_counter()
                prev, cpu, wall = acc[name]
                acc[name] = (prev + outs, cpu + c1 - c0, wall + t1 - t0)
        floor = pct([g for o in acc["envoy only"][0] if o.ok for g in o.itls], .99)
        for name, (outs, cpu, wall) in acc.items():
            ok = [o for o in outs if o.ok]
            itls = [g for o in ok for g in o.itls]
            chunks = sum(o.tokens for o in outs)
            per = f"{cpu / chunks * 1e6:,.0f} µs" if chunks and "epp" in name else "–"
            added = f"{(pct(itls, .99) - floor) * 1e3:.2f}" if "epp" in name else "–"
            args.figures.setdefault("tokens", {})[name] = {
                "itl_p50": pct(itls, .5), "itl_p99": pct(itls, .99), "itl_p99_added": pct(itls, .99) - floor,
                "cores": cpu / wall, "cpu_per_chunk": cpu / chunks if chunks else float("nan")}
            lines.append(f"| {name} | {len(ok)} | {chunks:,} | {pct(itls, .5) * 1e3:.2f} | {pct(itls, .99) * 1e3:.2f} | "
                         f"{added} | {pct([o.ttft for o in ok], .5) * 1e3:.1f} | {cpu / wall:.2f} | {per} |")
    return lines


# --------------------------------------------------------------------------- the gRPC floor


@contextmanager
def floor_server(endpoints: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`bench.grpc_floor`: an ext_proc server that does nothing but answer (no TLS)."""
    import sys as _sys

    with tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp:
        port_file = Path(tmp) / "port"
        proc = start_process([_sys.executable, "-m", "bench.grpc_floor", str(port_file), *endpoints], "grpc-floor")
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists() or not port_file.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the gRPC floor server did not start")
                time.sleep(0.05)
            yield proc, int(port_file.read_text())
        finally:
            stop_process(proc)


async def part_floor(args: argparse.Namespace) -> list[str]:
    lines = ["## The floor: an ext_proc server that does nothing", "",
             "`bench/grpc_floor.py` speaks the protocol on the EPP's stack (grpc.aio on uvloop, one process, no "
             "TLS) and only answers: the destination, the body re-streamed, response chunks echoed on the "
             "reference config, nothing to an observer (which runs, as with the EPP's default, for every streamed response); a plain response is marked for Envoy's access log, whose entries it reads and drops. Same "
             "clients, stubs and pods as above. What the EPP costs above this row is its own work.", "",
             "| load | Envoy config | rate | server CPU per request / chunk |", "|---|---|---|---|"]
    rng = random.Random(5)
    bodies = prompt_bodies(rng, 200, 500)
    with StubPods(10) as stubs, floor_server(stubs.addresses) as (proc, port), \
            mode_envoys(port, tls=False) as envoys:
        for mode, envoy in envoys.items():
            url = envoy.url + "/v1/completions"
            await closed_loop(url, bodies, 4, 0.3)
            c0 = cpu_seconds(proc.pid)
            r = await closed_loop(url, bodies, args.concurrency, args.duration)
            per = (cpu_seconds(proc.pid) - c0) / max(1, len(r.latencies))
            args.figures.setdefault("floor", {})[f"requests {mode}"] = per
            lines.append(f"| small requests, 10 stubs | {mode} | {r.rps:,.0f} req/s | {per * 1e3:.2f} ms |")
    spec = PodSpec(count=1, profile="h100-llama3-8b", num_gpu_blocks=0, max_num_seqs=256, time_scale=1.0)
    with Pods(spec, "cost-floor") as sims, floor_server(sims.addresses) as (proc, port), \
            mode_envoys(port, tls=False) as envoys:
        for mode, envoy in envoys.items():
            c0 = cpu_seconds(proc.pid)
            outs = await _stream_loop(envoy.url, args.stream_concurrency, args.duration, args.stream_tokens)
            chunks = sum(o.tokens for o in outs)
            per = (cpu_seconds(proc.pid) - c0) / max(1, chunks)
            args.figures.setdefault("floor", {})[f"tokens {mode}"] = per
            lines.append(f"| {args.stream_concurrency} streams × {args.stream_tokens} tokens | {mode} | "
                         f"{chunks:,} chunks | {per * 1e6:,.0f} µs per chunk |")
    return lines


# --------------------------------------------------------------------------- CLI

PARTS = {"rate": part_rate, "pick": part_pick, "prompt": part_prompt, "scrape": part_scrape, "tokens": part_tokens,
         "floor": part_floor, "index": part_index}


async def measure(args: argparse.Namespace) -> str:
    lines = [f"# Picker cost ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"`python -m bench.cost` on this machine (2 cores shared by the client, Envoy, the pods and the EPP; "
             f"load average {machine_load()} at the start). "
             "The EPP runs with TLS on its gRPC port and the default config unless a row says otherwise.", ""]
    for name in args.parts:
        started = time.monotonic()
        lines += await PARTS[name](args)
        lines += ["", f"_({name}: {time.monotonic() - started:.0f} s)_", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=lambda s: s.split(","), default=list(PARTS), help=",".join(PARTS))
    parser.add_argument("--quick", action="store_true", help="shorter runs, fewer requests")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measured path (rate, tokens)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--endpoints", type=lambda s: [int(x) for x in s.split(",")], default=[10, 100])
    parser.add_argument("--prompt-requests", type=lambda s: [int(x) for x in s.split(",")], default=[200, 40],
                        help="requests at 8k and 100k tokens")
    parser.add_argument("--prompt-concurrency", type=int, default=2)
    parser.add_argument("--scrape-seconds", type=float, default=8.0)
    parser.add_argument("--age-samples", type=int, default=8, help="metrics-age samples per scrape window")
    parser.add_argument("--scrape-pages", type=lambda s: s.split(","), default=["moving", "whole", "static"],
                        help="scrape part: which pages (moving,whole,static)")
    parser.add_argument("--scrape-modes", type=lambda s: s.split(","), default=["in-loop", "process"],
                        help="scrape part: which scrapers (in-loop,process)")
    parser.add_argument("--pick-requests", type=int, default=600, help="requests per in-process pick measurement")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before a scrape measurement starts")
    parser.add_argument("--stream-concurrency", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--out", default=str(RESULTS / "cost.md"))
    args = parser.parse_args(argv)
    args.figures = {}
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    if args.quick:
        args.duration, args.scrape_seconds, args.prompt_requests, args.pick_requests = 2.0, 3.0, [40, 8], 200
    try:
        report = asyncio.run(measure(args))
    except KeyboardInterrupt:
        log("interrupted; every process started has been stopped")
        return 130
    write_report(Path(args.out), report)
    Path(args.out).with_suffix(".json").write_text(json.dumps(args.figures, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
