"""Watch the pods through their own `/metrics`, as an operator would, while a benchmark runs.

Samples give per-pod load over time (running + waiting) and counter snapshots whose differences
are the prefix-cache hit rate, each pod's share of the requests, and the engine's own latency
sums. The engine reports latency in modelled seconds; comparing it with what the client saw tells
whether the simulated pods kept up with wall time on this machine (`engine lag`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp

from epp.local.podstats import PodStats as PodSample
from epp.local.podstats import pod_stats as sample_pod

__all__ = ["Delta", "PodMonitor", "PodSample", "delta", "sample_pod"]


@dataclass(slots=True)
class Delta:
    """What happened on the pods between two snapshots."""

    finished: list[float]
    queries: float
    hits: float
    gen_tokens: float
    engine_e2e_mean: float  # modelled seconds
    engine_ttft_mean: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else float("nan")

    @property
    def share(self) -> list[float]:
        total = sum(self.finished)
        return [f / total if total else 0.0 for f in self.finished]


def delta(before: list[PodSample], after: list[PodSample]) -> Delta:
    e2e_n = sum(a.e2e_count - b.e2e_count for a, b in zip(after, before))
    ttft_n = sum(a.ttft_count - b.ttft_count for a, b in zip(after, before))
    return Delta(
        finished=[a.finished - b.finished for a, b in zip(after, before)],
        queries=sum(a.prefix_queries - b.prefix_queries for a, b in zip(after, before)),
        hits=sum(a.prefix_hits - b.prefix_hits for a, b in zip(after, before)),
        gen_tokens=sum(a.generation_tokens - b.generation_tokens for a, b in zip(after, before)),
        engine_e2e_mean=sum(a.e2e_sum - b.e2e_sum for a, b in zip(after, before)) / e2e_n if e2e_n else float("nan"),
        engine_ttft_mean=sum(a.ttft_sum - b.ttft_sum for a, b in zip(after, before)) / ttft_n if ttft_n else float("nan"),
    )


@dataclass(slots=True)
class PodMonitor:
    """Samples every pod every `interval` seconds in the background; `snapshot()` on demand."""

    urls: list[str]
    interval: float = 0.5
    series: list[list[PodSample]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> PodMonitor:
        self._session = aiohttp.ClientSession()
        self.series = [[] for _ in self.urls]
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def snapshot(self) -> list[PodSample]:
        assert self._session is not None
        return list(await asyncio.gather(*(sample_pod(self._session, u) for u in self.urls)))

    async def _loop(self) -> None:
        while True:
            try:
                for series, sample in zip(self.series, await self.snapshot()):
                    series.append(sample)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                pass  # a missed sample is a gap in a plot, not a failure
            await asyncio.sleep(self.interval)
