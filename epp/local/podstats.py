"""What a simulated (or real) vLLM pod reports about itself, read from its own `/metrics`."""

from __future__ import annotations

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
])


@dataclass(slots=True)
class PodStats:
    finished: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0

    def minus(self, before: PodStats) -> PodStats:
        """Counters as a difference; gauges as they are now."""
        return PodStats(self.finished - before.finished, self.prefix_queries - before.prefix_queries,
                        self.prefix_hits - before.prefix_hits, self.running, self.waiting,
                        self.prompt_tokens - before.prompt_tokens,
                        self.generation_tokens - before.generation_tokens)


async def pod_stats(session: aiohttp.ClientSession, base_url: str) -> PodStats:
    async with session.get(f"{base_url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as response:
        body = await response.read()
    samples = parse_wanted(body, _WANTED)

    def total(name: str) -> float:
        return sum(s.value for s in samples.get(name, ()))

    return PodStats(
        finished=total("vllm:request_success_total"),
        prefix_queries=total("vllm:prefix_cache_queries_total"),
        prefix_hits=total("vllm:prefix_cache_hits_total"),
        running=total("vllm:num_requests_running"),
        waiting=total("vllm:num_requests_waiting"),
        prompt_tokens=total("vllm:prompt_tokens_total"),
        generation_tokens=total("vllm:generation_tokens_total"),
    )
