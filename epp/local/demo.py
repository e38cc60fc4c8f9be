"""`make demo`: Envoy + the EPP + simulated vLLM pods on localhost, mixed traffic, a summary.

The traffic mixes what an inference gateway sees: groups of users sharing a system prompt in
multi-turn chats (prefix affinity matters), independent prompts of varied length (load balance
matters) and a few long streamed generations. The summary reads the pods' own `/metrics`, as an
operator would, plus the EPP's decisions.
"""

from __future__ import annotations

import asyncio
import random

import sys
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from epp.local.podstats import PodStats, pod_stats
from epp.local.stack import LocalStack, StackConfig
from epp.sim.config import EngineConfig, SimConfig

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


@dataclass(slots=True)
class Outcome:
    kind: str
    status: int
    latency: float
    ttft: float = 0.0


@dataclass(slots=True)
class Traffic:
    rng: random.Random
    groups: list[str] = field(default_factory=list)
    chats: dict[int, list[dict[str, str]]] = field(default_factory=dict)

    def system_prompt(self, group: int) -> str:
        while len(self.groups) <= group:
            words = " ".join(self.rng.choice(WORDS) for _ in range(1500))  # ~2,500 tokens: a manual
            self.groups.append(f"You are assistant #{len(self.groups)} of the ACME help desk. Manual: {words}")
        return self.groups[group]

    def next_request(self, user: int) -> tuple[str, str, dict[str, object]]:
        roll = self.rng.random()
        if roll < 0.6:  # multi-turn chat in one of 6 groups sharing a system prompt
            history = self.chats.setdefault(user, [{"role": "system", "content": self.system_prompt(user % 6)}])
            history.append({"role": "user", "content": " ".join(self.rng.choice(WORDS) for _ in range(20))})
            if len(history) > 12:
                del history[1:3]
            body = {"messages": list(history), "max_tokens": self.rng.randint(16, 96), "stream": True}
            history.append({"role": "assistant", "content": " ".join(self.rng.choice(WORDS) for _ in range(15))})
            return "chat", "/v1/chat/completions", body
        if roll < 0.92:  # an independent prompt of varied length
            n = int(self.rng.lognormvariate(5.0, 0.8))
            prompt = f"req {self.rng.random()} " + " ".join(self.rng.choice(WORDS) for _ in range(n))
            return "completion", "/v1/completions", {"prompt": prompt, "max_tokens": self.rng.randint(8, 128)}
        prompt = "Write a long story about " + " ".join(self.rng.choice(WORDS) for _ in range(30))
        return "long-stream", "/v1/completions", {"prompt": prompt, "max_tokens": 1024, "ignore_eos": True, "stream": True}


async def send(session: aiohttp.ClientSession, url: str, model: str, kind: str, path: str,
               body: dict[str, object]) -> Outcome:
    body = {"model": model, **body}
    start = time.perf_counter()
    ttft = 0.0
    try:
        async with session.post(url + path, data=orjson.dumps(body), headers={"content-type": "application/json"}) as r:
            if body.get("stream"):
                async for _ in r.content.iter_any():
                    if not ttft:
                        ttft = time.perf_counter() - start
            else:
                await r.read()
            return Outcome(kind, r.status, time.perf_counter() - start, ttft or time.perf_counter() - start)
    except aiohttp.ClientError:
        return Outcome(kind, 0, time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def drive(stack: LocalStack, model: str, duration: float, users: int, seed: int) -> list[Outcome]:
    traffic = Traffic(random.Random(seed))
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + duration

    async def user_loop(user: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(seed * 1000 + user)
        while time.monotonic() < deadline:
            kind, path, body = traffic.next_request(user)
            outcomes.append(await send(session, stack.url, model, kind, path, body))
            await asyncio.sleep(rng.expovariate(4.0))

    connector = aiohttp.TCPConnector(limit=users)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        progress = asyncio.create_task(_progress(outcomes, duration))
        await asyncio.gather(*(user_loop(u, session) for u in range(users)))
        progress.cancel()
    print(file=sys.stderr)
    return outcomes


async def _progress(outcomes: list[Outcome], duration: float) -> None:
    start = time.monotonic()
    while True:
        await asyncio.sleep(1.0)
        print(f"\r  traffic: {time.monotonic() - start:4.0f}/{duration:.0f} s, {len(outcomes)} requests done",
              end="", file=sys.stderr, flush=True)


def summary(stack: LocalStack, outcomes: list[Outcome], per_pod: list[PodStats], elapsed: float) -> str:
    lines = ["", "== epp demo summary ==", f"{len(stack.pods)} simulated vLLM pods behind Envoy + EPP, "
             f"{len(outcomes)} requests in {elapsed:.1f} s ({len(outcomes) / elapsed:.1f} req/s)", ""]
    lines.append(f"{'pod':<22}{'requests':>10}{'share':>8}{'prefix-cache hit':>18}{'prompt tok':>12}{'output tok':>12}")
    total = sum(p.finished for p in per_pod) or 1
    for pod, stats in zip(stack.pods, per_pod):
        hit = stats.prefix_hits / stats.prefix_queries if stats.prefix_queries else 0.0
        lines.append(f"{pod.address:<22}{stats.finished:>10.0f}{stats.finished / total:>8.0%}{hit:>18.1%}"
                     f"{stats.prompt_tokens:>12.0f}{stats.generation_tokens:>12.0f}")
    queries = sum(p.prefix_queries for p in per_pod)
    hits = sum(p.prefix_hits for p in per_pod)
    lines.append(f"{'all pods':<22}{total:>10.0f}{'':>8}{(hits / queries if queries else 0):>18.1%}")
    lines.append("")
    lines.append(f"{'traffic':<14}{'requests':>10}{'errors':>8}{'p50 latency':>14}{'p99 latency':>14}{'p50 TTFT':>12}")
    for kind in ("chat", "completion", "long-stream"):
        rows = [o for o in outcomes if o.kind == kind]
        ok = [o for o in rows if o.status == 200]
        lines.append(f"{kind:<14}{len(rows):>10}{len(rows) - len(ok):>8}"
                     f"{pct([o.latency for o in ok], 0.5) * 1000:>12.0f}ms{pct([o.latency for o in ok], 0.99) * 1000:>12.0f}ms"
                     f"{pct([o.ttft for o in ok], 0.5) * 1000:>10.0f}ms")
    statuses: dict[int, int] = {}
    for o in outcomes:
        if o.status != 200:
            statuses[o.status] = statuses.get(o.status, 0) + 1
    lines.append("")
    lines.append("errors by status: " + (", ".join(f"{s or 'connection'}: {n}" for s, n in sorted(statuses.items())) or "none"))
    if stack.picker is not None:
        registry = stack.picker.metrics.registry
        count = registry.get_sample_value("inference_extension_scheduler_e2e_duration_seconds_count") or 0
        total_s = registry.get_sample_value("inference_extension_scheduler_e2e_duration_seconds_sum") or 0
        if count:
            lines.append(f"EPP: {count:.0f} scheduling decisions, mean {total_s / count * 1e6:.0f} µs each; "
                         f"in flight now: {sum(ep.inflight_requests for ep in stack.picker.datastore.endpoints())}")
    return "\n".join(lines)


async def run_traffic(stack_config: StackConfig, duration: float, users: int, seed: int,
                      label: str) -> tuple[LocalStack, list[Outcome], list[PodStats], float]:
    print(f"starting {stack_config.pods} simulated vLLM pods{' and the EPP' if stack_config.with_epp else ''} "
          f"behind Envoy ({label}) ...", file=sys.stderr)
    async with LocalStack(stack_config) as stack:
        async with aiohttp.ClientSession() as session:
            before = [await pod_stats(session, p.url) for p in stack.pods]
            print(f"sending mixed traffic from {users} users for {duration:.0f} s through {stack.url} ...",
                  file=sys.stderr)
            start = time.monotonic()
            outcomes = await drive(stack, stack_config.sim.model, duration, users, seed)
            elapsed = time.monotonic() - start
            after = [await pod_stats(session, p.url) for p in stack.pods]
        return stack, outcomes, [a.minus(b) for a, b in zip(after, before)], elapsed


def comparison(epp: tuple[list[Outcome], list[PodStats]], rr: tuple[list[Outcome], list[PodStats]]) -> str:
    def row(name: str, outcomes: list[Outcome], pods: list[PodStats]) -> str:
        chat = [o.ttft for o in outcomes if o.status == 200 and o.kind == "chat"]
        hits, queries = sum(p.prefix_hits for p in pods), sum(p.prefix_queries for p in pods)
        return (f"{name:<22}{(hits / queries if queries else 0):>18.1%}{pct(chat, 0.5) * 1000:>12.0f}ms"
                f"{pct(chat, 0.9) * 1000:>12.0f}ms{pct(chat, 0.99) * 1000:>12.0f}ms{len(outcomes):>10}")
    return "\n".join(["", "== the same traffic, EPP against Envoy round-robin ==",
                      f"{'':<22}{'prefix-cache hit':>18}{'chat TTFT p50':>14}{'p90':>14}{'p99':>14}{'requests':>10}",
                      row("Envoy + EPP", *epp), row("Envoy round-robin", *rr)])


async def demo(duration: float, pods: int, users: int = 24, seed: int = 7, compare: bool = False) -> str:
    # Small KV caches (12.8k tokens a pod, fewer than the six manuals need) so that where a
    # conversation lands matters: spread at random, every pod keeps evicting every manual.
    sim = SimConfig(time_scale=1.0, seed=seed,
                    engine=EngineConfig(max_num_seqs=16, num_gpu_blocks=800, max_model_len=8192))
    stack, outcomes, per_pod, elapsed = await run_traffic(StackConfig(pods=pods, sim=sim), duration, users, seed,
                                                          "EPP")
    text = summary(stack, outcomes, per_pod, elapsed)
    if compare:
        _, rr_outcomes, rr_pods, _ = await run_traffic(StackConfig(pods=pods, sim=sim, with_epp=False), duration,
                                                       users, seed, "round-robin")
        text += "\n" + comparison((outcomes, per_pod), (rr_outcomes, rr_pods))
    return text


def run_demo(duration: float = 20.0, pods: int = 3, compare: bool = False) -> int:
    try:
        import uvloop

        text = uvloop.run(demo(duration, pods, compare=compare))
    except ImportError:
        text = asyncio.run(demo(duration, pods, compare=compare))
    print(text)
    return 0



