"""Live B2B routing: approximate vs precise prefix routing vs round-robin, at KV demand 0.7 and 1.5.

    python -m bench.precise_routing            # ~6 min
    python -m bench.precise_routing --quick    # ~2 min

The llm-d benchmark's shape, scaled to this machine: customers each with a long shared context
and several users asking questions about it, on simulated vLLM pods (`epp sim`, one process each)
that publish their real KV-cache events (`--kv-events-config`, connect mode, topic
`kv@{ip}:{port}@{model}`) to the EPP's central socket. "KV demand" is the customers' contexts
summed over the pool's KV capacity: at 0.7 they all fit, at 1.5 the pods must evict.

Arms, each on freshly started pods, same requests:
- `approximate`: the EPP's built-in default (predicted latency; the approximate index of where it
  sent prompts);
- `precise`: the same profile with its cache credit from `precise-prefix-cache-producer`, over the
  prompt tokenized by a `token-producer` with the pods' own tokenizer (the simulator's shipped
  byte-level BPE; the pods tokenize and hash blocks as vLLM does), speculative entries and
  eviction foresight on;
- `round-robin`: Envoy alone;
- optional (`--arms`): `precise-nospec` (no speculative entries), `precise-noforesight` (no
  eviction foresight).

Everything on the precise path — tokenization, the events over ZMQ, the index, evictions, the
scorer — is the production path.

Index accuracy (precise arm): the tokens the EPP predicted cached on each picked pod, summed,
against the hit tokens the pods' own `vllm:prefix_cache_hits_total` counted for the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from dataclasses import dataclass

import aiohttp

from bench.client import replay
from bench.common import RESULTS, epp_command, free_ports, log, pct, start_process, stop_process, wait_http, write_report
from bench.podmon import PodMonitor, delta
from bench.workloads import COMPLETION, WORDS, Planned
from bench.sim_configs import precise_config
from epp.api.request import InferenceRequest
from epp.config.defaults import DEFAULT_CONFIG
from epp.config.options import Options
from epp.discovery.static import StaticDiscovery, parse_endpoint_list
from epp.local.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.runner import EndpointPicker
from epp.scheduling.framework import PreRequest, SchedulingResult
from epp.sim.tokens import load_tokenizer

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK = 16  # the simulated engine's block size


def arm_config(arm: str, events_port: int) -> str:
    """`approximate`: the built-in default; `precise*`: the same profile with the cache credit from
    the pods' KV events over the prompt tokenized as the pods do (`bench.sim_configs.precise_config`:
    the simulator's shipped tokenizer, router blocks of the engines' size)."""
    if arm == "approximate":
        return DEFAULT_CONFIG
    text = precise_config(MODEL, BLOCK).replace("tcp://*:5557", f"tcp://127.0.0.1:{events_port}")
    text = text.replace(", offloadChars: 0", "")  # live: long prompts tokenize off the event loop
    if arm == "precise-nospec":
        text = text.replace("speculativeIndexing: true", "speculativeIndexing: false")
    elif arm == "precise-noforesight":
        text = text.replace("speculativeIndexing: true", "speculativeIndexing: true\n    evictionForesight: false")
    return text


class Predictions(PreRequest):
    """Sums the tokens the precise producer predicted cached on each picked endpoint."""

    type = "bench-predictions"

    def __init__(self, producer: str) -> None:
        super().__init__("bench-predictions")
        self.producer = producer
        self.predicted = 0
        self.requests = 0
        self.start = math.inf

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        if time.monotonic() < self.start:
            return
        match = result.cycle.data.get(self.producer)
        if match is not None:
            self.predicted += match.tokens(result.primary.address)
            self.requests += 1


@dataclass(slots=True)
class Shape:
    demand: float
    pods: int = 4
    blocks: int = 1200  # per pod: 19,200 tokens
    context: int = 3000  # tokens per customer
    users: int = 3
    question: int = 150
    output: int = 48
    rate: float = 12.0
    duration: float = 40.0
    warmup: float = 10.0

    @property
    def customers(self) -> int:
        return max(1, round(self.demand * self.pods * self.blocks * BLOCK / self.context))


def words_per_token() -> float:
    """The shape is in tokens as the pods count them (their shipped tokenizer): words per token of
    the benchmark's vocabulary."""
    sample = " ".join(random.Random(0).choices(WORDS, k=2000))
    return 2000 / len(load_tokenizer().encode(sample))


def plan(shape: Shape, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    ratio = words_per_token()
    context, question = round(shape.context * ratio), round(shape.question * ratio)
    contexts = [f"Customer {c} contract and knowledge base: " + " ".join(rng.choices(WORDS, k=context))
                for c in range(shape.customers)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(shape.rate)
        if t >= shape.duration:
            return out
        c = rng.randrange(shape.customers)
        u = c * shape.users + rng.randrange(shape.users)
        body = {"prompt": contexts[c] + f"\nUser {u} asks: " + " ".join(rng.choices(WORDS, k=question)),
                "max_tokens": shape.output, "ignore_eos": True}
        out.append(Planned(t, COMPLETION, body, "b2b", user=u))


def start_pods(shape: Shape, events_port: int, tag: str) -> tuple[list, list[str]]:
    procs, addresses = [], []
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:%d", '
              '"topic": "kv@{ip}:{port}@{model}"}' % events_port)
    for i, port in enumerate(free_ports(shape.pods)):
        cmd = epp_command("sim", "--pods", "1", "--base-port", str(port), "--profile", "a100-llama3-8b",
                          "--max-num-seqs", "12", "--num-gpu-blocks", str(shape.blocks), "--seed", str(i),
                          "--kv-events-config", config)
        procs.append(start_process(cmd, f"{tag}-pod{i}"))
        addresses.append(f"127.0.0.1:{port}")
    for proc, address in zip(procs, addresses):
        wait_http(f"http://{address}/health", proc=proc)
    return procs, addresses


async def run_arm(arm: str, shape: Shape, requests: list[Planned]) -> dict[str, float]:
    events_port = free_port()
    procs, addresses = start_pods(shape, events_port, f"precise-{arm}")
    picker: EndpointPicker | None = None
    envoy: EnvoyProcess | None = None
    predictions: Predictions | None = None
    try:
        if arm == "round-robin":
            envoy = EnvoyProcess(EnvoyConfig(listen_port=free_port(), admin_port=free_port(), epp_port=free_port(),
                                             with_ext_proc=False, upstreams=tuple(addresses)))
        else:
            picker = EndpointPicker(Options(grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=-1,
                                            bind_address="127.0.0.1", secure_serving=False,
                                            config_text=arm_config(arm, events_port),
                                            pool_name="bench"),
                                    discovery=StaticDiscovery(parse_endpoint_list(",".join(addresses))))
            await picker.start()
            if arm.startswith("precise"):
                predictions = Predictions("precise-prefix-cache-producer")
                picker.director.pre_request.append(predictions)
            envoy = EnvoyProcess(EnvoyConfig(listen_port=free_port(), admin_port=free_port(), epp_port=picker.grpc_port))
        envoy.start()
        urls = [f"http://{a}" for a in addresses]
        async with PodMonitor(urls, interval=1.0) as monitor:
            task = asyncio.create_task(replay(envoy.url, MODEL, requests, shape.duration, drain=20.0))
            await asyncio.sleep(shape.warmup)
            before = await monitor.snapshot()
            if predictions is not None:
                predictions.start = time.monotonic()
            await asyncio.sleep(shape.duration - shape.warmup)
            if predictions is not None:
                predictions.start = math.inf
            run = await task
            after = await monitor.snapshot()
        window = [o for o in run.outcomes if shape.warmup <= o.sent < shape.duration]
        ok = [o for o in window if o.ok]
        ttft = [o.ttft for o in ok if not math.isnan(o.ttft)]
        d = delta(before, after)
        result = {"ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9), "ok": len(ok), "sent": len(window),
                  "rps": len(ok) / (shape.duration - shape.warmup), "hit_rate": d.hit_rate}
        if predictions is not None and picker is not None:
            real = d.hits
            result["accuracy"] = 1 - abs(predictions.predicted - real) / real if real else math.nan
            result["predicted"] = predictions.predicted
            result["real"] = real
            sub = picker.kv_subscribers[0].stats
            result["events"] = sub.messages
            result["gaps"] = sub.gaps
        return result
    finally:
        if envoy is not None:
            envoy.close()
        if picker is not None:
            await picker.stop(grace=0)
        for p in procs:
            stop_process(p)


async def main_async(args: argparse.Namespace) -> str:
    lines = ["# Live B2B routing: approximate vs precise prefix routing vs round-robin", "",
             "`python -m bench.precise_routing` — simulated vLLM pods (`epp sim`, a100-llama3-8b step times, "
             "16-token blocks) publishing their KV events; Envoy + the EPP in front; open-loop Poisson arrivals, "
             "a user's turns in order. Requests sent during the warm-up are left out.", ""]
    results: dict[tuple[float, str], dict[str, float]] = {}
    for demand in args.demands:
        shape = Shape(demand=demand, duration=args.duration, warmup=args.warmup, rate=args.rate)
        requests = plan(shape, seed=int(demand * 10))
        lines += [f"## KV demand {demand:g}: {shape.customers} customers × {shape.context:,}-token contexts "
                  f"({shape.customers * shape.context:,} tokens) over {shape.pods} pods × "
                  f"{shape.blocks * BLOCK:,} tokens; {shape.users} users each, {shape.question}-token questions, "
                  f"{shape.output} output tokens, {shape.rate:g} req/s for {shape.duration:g} s", "",
                  "| arm | ok / sent | req/s | TTFT p50 ms | TTFT p90 ms | prefix-cache hit rate | index accuracy |",
                  "|---|---|---|---|---|---|---|"]
        for arm in args.arms:
            log(f"demand {demand}: {arm}")
            r = results[(demand, arm)] = await run_arm(arm, shape, requests)
            acc = f"{r['accuracy']:.1%} ({r['predicted']:,.0f} predicted / {r['real']:,.0f} real tokens)" \
                if "accuracy" in r else "–"
            lines.append(f"| {arm} | {r['ok']}/{r['sent']} | {r['rps']:.2f} | {r['ttft_p50'] * 1e3:,.0f} | "
                         f"{r['ttft_p90'] * 1e3:,.0f} | {r['hit_rate']:.1%} | {acc} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--arms", default="approximate,precise,round-robin")
    parser.add_argument("--demands", default="0.7,1.5")
    parser.add_argument("--rate", type=float, default=12.0)
    parser.add_argument("--duration", type=float, default=0.0)
    parser.add_argument("--warmup", type=float, default=0.0)
    args = parser.parse_args()
    args.arms = args.arms.split(",")
    args.demands = [float(d) for d in args.demands.split(",")]
    args.duration = args.duration or (25.0 if args.quick else 50.0)
    args.warmup = args.warmup or (8.0 if args.quick else 15.0)
    report = asyncio.run(main_async(args))
    print(report)
    write_report(RESULTS / "precise-routing.md", report)


if __name__ == "__main__":
    main()
