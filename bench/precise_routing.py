"""Live B2B routing: approximate vs precise prefix routing vs round-robin, at KV demand 0.7 and 1.5.

    python -m bench.precise_routing            # ~6 min
    python -m bench.precise_routing --quick    # ~2 min

The llm-d benchmark's shape, scaled to this machine: customers each with a long shared context
and several users asking questions about it, on simulated vLLM pods (`epp sim`, one process each)
that publish their real KV-cache events (`--kv-events-config`, connect mode, topic
`kv@{ip}:{port}@{model}`) to the EPP's central socket. "KV demand" is the customers' contexts
summed over the pool's KV capacity: at 0.7 they all fit, at 1.5 the pods must evict.

Arms, each on freshly started pods, same requests:
- `approximate`: the EPP's default profile (the approximate index of where it sent prompts);
- `precise`: the same profile with `prefix-cache-scorer` reading `precise-prefix-cache-producer`;
- `round-robin`: Envoy alone;
- `precise-nospec` (optional, `--arms`): precise without speculative entries.

The simulator's HTTP pods key text by 4 characters per token and publish *synthetic* token ids
for it (`epp.sim.block_hash.synthetic_token_ids` of each block's text hash), not a real
tokenizer's: so the precise arm's request preparer here computes those same ids (with the
simulator's own functions) instead of the `token-producer`'s tokenizer. Everything else — the
events over ZMQ, the index, evictions, the scorer — is the production path.

Index accuracy (precise arm): the tokens the EPP predicted cached on each picked pod, summed,
against the hit tokens the pods' own `vllm:prefix_cache_hits_total` counted for the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from array import array
from dataclasses import dataclass

import aiohttp

from bench.client import replay
from bench.common import RESULTS, epp_command, free_ports, log, pct, start_process, stop_process, wait_http, write_report
from bench.podmon import PodMonitor, delta
from bench.workloads import COMPLETION, WORDS, Planned
from epp.api.preparer import TOKENIZED_PROMPT, RequestPreparer, TokenizedPrompt
from epp.api.request import Api, InferenceRequest
from epp.config.options import Options
from epp.discovery.static import StaticDiscovery, parse_endpoint_list
from epp.local.envoy import EnvoyConfig, EnvoyProcess, free_port
from epp.runner import EndpointPicker
from epp.scheduling.framework import PreRequest, SchedulingResult
from epp.sim.block_hash import synthetic_token_ids
from epp.sim.tokens import namespace_seed, text_block_hashes

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK = 16  # the simulated engine's block size
DEFAULT = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
{prefix}
- type: active-request-scorer
schedulingProfiles:
- name: default
  plugins:
  - {{pluginRef: queue-scorer, weight: 2}}
  - {{pluginRef: kv-cache-utilization-scorer, weight: 2}}
  - {{pluginRef: prefix-cache-scorer, weight: 3}}
  - {{pluginRef: active-request-scorer, weight: 2}}
"""
APPROX = DEFAULT.format(prefix="- type: prefix-cache-scorer")
PRECISE = DEFAULT.format(prefix="""- type: precise-prefix-cache-producer
  parameters:
    kvEventsConfig: {zmqEndpoint: "tcp://127.0.0.1:PORT", topicFilter: "kv@"}
    tokenProcessorConfig: {blockSize: 16}
    speculativeIndexing: true
- type: prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: precise-prefix-cache-producer}""")


class SimTokenIds(RequestPreparer):
    """The token ids the simulator's pods key a text prompt's blocks with (see the module doc)."""

    type = "bench-sim-token-ids"

    def __init__(self) -> None:
        super().__init__("bench-sim-token-ids")
        self.seed = namespace_seed(MODEL)

    async def prepare_request(self, request: InferenceRequest) -> None:
        prompt = request.body.get("prompt") if request.body and request.api is Api.COMPLETIONS else None
        if not isinstance(prompt, str):
            return
        ids = array("i")
        for h in text_block_hashes(prompt, BLOCK, self.seed):
            ids.extend(synthetic_token_ids(h, 0, BLOCK))
        ids = array("I", ids.tobytes())  # the same (positive) ids as uint32
        request.state[TOKENIZED_PROMPT] = TokenizedPrompt(ids)


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
    rate: float = 8.0
    duration: float = 40.0
    warmup: float = 10.0

    @property
    def customers(self) -> int:
        return max(1, round(self.demand * self.pods * self.blocks * BLOCK / self.context))


def plan(shape: Shape, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    contexts = [f"Customer {c} contract and knowledge base: " + " ".join(rng.choices(WORDS, k=shape.context))
                for c in range(shape.customers)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(shape.rate)
        if t >= shape.duration:
            return out
        c = rng.randrange(shape.customers)
        u = c * shape.users + rng.randrange(shape.users)
        body = {"prompt": contexts[c] + f"\nUser {u} asks: " + " ".join(rng.choices(WORDS, k=shape.question)),
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
            text = APPROX if arm == "approximate" else PRECISE.replace("PORT", str(events_port))
            if arm == "precise-nospec":
                text = text.replace("speculativeIndexing: true", "speculativeIndexing: false")
            picker = EndpointPicker(Options(grpc_port=0, grpc_health_port=0, metrics_port=0, admin_port=-1,
                                            bind_address="127.0.0.1", secure_serving=False, config_text=text,
                                            pool_name="bench"),
                                    discovery=StaticDiscovery(parse_endpoint_list(",".join(addresses))))
            await picker.start()
            if arm.startswith("precise"):
                picker.director.preparers = [SimTokenIds()]
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
    parser.add_argument("--rate", type=float, default=8.0)
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
