"""What a simulated (or real) vLLM pod reports about itself, read from its own `/metrics`.

Shared by the demo, the tests and the live benchmarks: counters whose differences give the
prefix-cache hit rate and each pod's share of the requests, gauges for load over time, and the
engine's own latency sums.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp

from epp.datalayer.promparse import WantedNames, parse_wanted

_WANTED = WantedNames([
    "vllm:request_success_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
])


@dataclass(slots=True)
class PodStats:
    t: float = 0.0  # time.monotonic() when read
    finished: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    e2e_sum: float = 0.0  # engine-reported, modelled seconds
    e2e_count: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0

    def minus(self, before: PodStats) -> PodStats:
        """Counters as a difference; gauges as they are now."""
        return PodStats(
            t=self.t, finished=self.finished - before.finished,
            prefix_queries=self.prefix_queries - before.prefix_queries,
            prefix_hits=self.prefix_hits - before.prefix_hits, running=self.running, waiting=self.waiting,
            prompt_tokens=self.prompt_tokens - before.prompt_tokens,
            generation_tokens=self.generation_tokens - before.generation_tokens,
            e2e_sum=self.e2e_sum - before.e2e_sum, e2e_count=self.e2e_count - before.e2e_count,
            ttft_sum=self.ttft_sum - before.ttft_sum, ttft_count=self.ttft_count - before.ttft_count,
        )


async def pod_stats(session: aiohttp.ClientSession, base_url: str) -> PodStats:
    async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as response:
        body = await response.read()
    now = time.monotonic()
    samples = parse_wanted(body, _WANTED)

    def total(name: str) -> float:
        return sum(s.value for s in samples.get(name, ()))

    return PodStats(
        t=now,
        finished=total("vllm:request_success_total"),
        prefix_queries=total("vllm:prefix_cache_queries_total"),
        prefix_hits=total("vllm:prefix_cache_hits_total"),
        running=total("vllm:num_requests_running"),
        waiting=total("vllm:num_requests_waiting"),
        prompt_tokens=total("vllm:prompt_tokens_total"),
        generation_tokens=total("vllm:generation_tokens_total"),
        e2e_sum=total("vllm:e2e_request_latency_seconds_sum"),
        e2e_count=total("vllm:e2e_request_latency_seconds_count"),
        ttft_sum=total("vllm:time_to_first_token_seconds_sum"),
        ttft_count=total("vllm:time_to_first_token_seconds_count"),
    )
