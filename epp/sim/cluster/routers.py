"""Routing policies the cluster can run: the interface, and the reference policies the EPP is
measured against.

A router gets each request (`route`, which may wait: flow control queues), returns the index of
the pod that serves it, and hears when it ends (`finished`). Routers that read metrics get every
pod's scrapes through `observe`, on the same schedule and with the same staleness as the EPP.

- `random`: uniform over the pods.
- `round-robin`: pod 0, 1, 2, ... in turn.
- `least-queue`: the shortest *scraped* waiting queue (ties: fewest scraped running, then
  random) — what a metrics-only balancer without the EPP's in-flight accounting does.
- `greedy-oracle` (alias `oracle`): sees the true engine state at the moment of the decision —
  each pod's real prefix-cache hit for this prompt, its real queue, batch and free KV blocks —
  and sends the request where its estimated time to first token is lowest, with the pod's own
  step-time model including prefill attention (the Q term: the prefill ahead of it and its own).
  Greedy, not a bound: it knows the present perfectly and the future not at all, so a policy can
  beat it.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from epp.datastore import EndpointMetrics
from epp.sim.cluster.traffic import Job

if TYPE_CHECKING:
    from epp.sim.cluster.cluster import Cluster

REFERENCE_POLICIES = ("random", "round-robin", "least-queue", "greedy-oracle")
# Old names still accepted; a run asked for by an old name keeps that name in its report, so
# scripts that look it up (bench/scale.py) keep working.
POLICY_ALIASES = {"oracle": "greedy-oracle"}


class Router(ABC):
    """A routing policy under test."""

    name: str = ""
    wants_metrics: bool = False
    wants_first_token: bool = False
    cluster: Cluster  # set by `attach`

    def attach(self, cluster: Cluster) -> None:
        """Called once, on the cluster's loop, before any request."""
        self.cluster = cluster

    async def start(self) -> None:
        """Background work (the EPP's flow-control dispatch loop)."""

    async def stop(self) -> None:
        """End background work; requests still queued end with an error."""

    @abstractmethod
    async def route(self, job: Job) -> int:
        """The pod that serves `job`; raise `EppError` to reject it."""

    def finished(self, job: Job) -> None:
        """`job` ended (served, or failed after routing)."""

    def first_token(self, job: Job) -> None:
        """`job`'s first token reached the client (only when `wants_first_token`)."""

    def belief(self, job: Job) -> tuple[int, float]:
        """For the report, right after `route(job)`: the prompt tokens the router believed the
        chosen pod had cached (-1: it keeps no prefix index) and its predicted TTFT (nan: none)."""
        return -1, math.nan

    def predicted_ttfts(self) -> list[float] | None:
        """Right after `route`: the TTFT the router predicted on each pod for that pick, by pod
        index (inf: none for that pod; None: the router predicts none)."""
        return None

    def observe(self, pod: int, metrics: EndpointMetrics) -> None:
        """A scrape of `pod` (only when `wants_metrics`)."""

    def queued(self) -> int:
        """Requests waiting in the router (flow-control queue), for the queue-length series."""
        return 0


class RandomRouter(Router):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(f"{seed}:random")

    async def route(self, job: Job) -> int:
        return self.rng.randrange(len(self.cluster.pods))


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, seed: int = 0) -> None:
        self.next = 0

    async def route(self, job: Job) -> int:
        i = self.next
        self.next = (i + 1) % len(self.cluster.pods)
        return i


class LeastQueueRouter(Router):
    name = "least-queue"
    wants_metrics = True

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(f"{seed}:least-queue")
        self.metrics: list[EndpointMetrics] = []

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        self.metrics = [EndpointMetrics() for _ in cluster.pods]

    def observe(self, pod: int, metrics: EndpointMetrics) -> None:
        self.metrics[pod] = metrics

    async def route(self, job: Job) -> int:
        best: list[int] = []
        best_key = (math.inf, math.inf)
        for i, m in enumerate(self.metrics):
            key = (m.waiting_queue_size, m.running_requests)
            if key < best_key:
                best_key, best = key, [i]
            elif key == best_key:
                best.append(i)
        return best[0] if len(best) == 1 else self.rng.choice(best)


class OracleRouter(Router):
    """Least estimated time to first token, from the true engine state (greedy)."""

    name = "greedy-oracle"

    def __init__(self, seed: int = 0, name: str = "greedy-oracle") -> None:
        self.name = name
        self.rng = random.Random(f"{seed}:oracle")
        # Per pod: (steps, waiting, tokens, query-key pairs) memo of the prefill work ahead.
        self._ahead: list[tuple[int, int, int, float]] = []

    def attach(self, cluster: Cluster) -> None:
        super().attach(cluster)
        self._ahead = [(-1, -1, 0, 0.0) for _ in cluster.pods]

    def _work_ahead(self, i: int) -> tuple[int, float]:
        """Prefill queued in front of a new request (waiting + unfinished prefills): its tokens
        and its attention query-key pairs, Σ n·(k + n/2) for n tokens still to compute after k."""
        engine = self.cluster.pods[i].engine
        memo = self._ahead[i]
        if memo[0] == engine.num_steps and memo[1] == len(engine.waiting):
            return memo[2], memo[3]
        total = 0
        qk = 0.0
        for r in engine.waiting:
            n = r.prompt_len + r.num_output_tokens - r.num_computed_tokens
            total += n
            qk += n * (r.num_computed_tokens + n * 0.5)
        for r in engine.running:
            if r.num_output_tokens == 0:
                n = r.prompt_len - r.num_computed_tokens
                total += n
                qk += n * (r.num_computed_tokens + n * 0.5)
        self._ahead[i] = (engine.num_steps, len(engine.waiting), total, qk)
        return total, qk

    def estimate(self, i: int, job: Job) -> float:
        """Seconds until `job`'s first token if it were sent to pod `i` now."""
        pod = self.cluster.pods[i]
        engine = pod.engine
        cfg = engine.config
        req = job.request
        assert req is not None
        hit = engine.kv.cached_prefix_blocks(req) * cfg.block_size
        mine = req.prompt_len - hit
        ahead, qk_ahead = self._work_ahead(i)
        work = ahead + mine
        budget = cfg.max_num_batched_tokens
        running = len(engine.running)
        decodes = min(running, cfg.max_num_seqs)
        kv_tokens = int(engine.kv.usage * engine.kv.num_usable_blocks * cfg.block_size)
        st = engine.step_time
        step = st.seconds(min(budget, work), decodes, kv_tokens, 0.0, decodes + 1)
        steps = 1.0 + work / budget
        # Prefill attention is additive over chunks (Σ c·(k + c/2) telescopes to n·(k0 + n/2)),
        # so the whole queue's and this prompt's Q terms are added once, not per step.
        qk = qk_ahead + mine * (hit + mine * 0.5)
        est = steps * step + st.prefill_attn_ms_per_qk_pair * qk * 1e-3
        free = engine.kv.num_free_blocks * cfg.block_size
        if work > free:  # it waits for running requests to finish and free their blocks
            est += 4.0 * step * (work - free) / budget
        if running >= cfg.max_num_seqs:
            est += step * (running - cfg.max_num_seqs + 1 + len(engine.waiting))
        if req.lora and cfg.max_loras:
            active = {r.lora for r in engine.running if r.lora}
            if req.lora not in active and len(active) >= cfg.max_loras:
                est += 10.0 * step
        return est

    async def route(self, job: Job) -> int:
        best: list[int] = []
        best_key = (math.inf, math.inf)
        for i, pod in enumerate(self.cluster.pods):
            key = (round(self.estimate(i, job), 6), len(pod.engine.running))
            if key < best_key:
                best_key, best = key, [i]
            elif key == best_key:
                best.append(i)
        return best[0] if len(best) == 1 else self.rng.choice(best)


def reference_router(name: str, seed: int = 0) -> Router:
    """A reference policy by name (or old alias: `oracle` is `greedy-oracle`)."""
    canonical = POLICY_ALIASES.get(name, name)
    if canonical == "greedy-oracle":
        return OracleRouter(seed, name=name)
    routers: dict[str, type[Router]] = {
        "random": RandomRouter, "round-robin": RoundRobinRouter, "least-queue": LeastQueueRouter,
    }
    cls = routers.get(canonical)
    if cls is None:
        raise ValueError(f"unknown policy {name!r} (known: epp, {', '.join(REFERENCE_POLICIES)}; "
                         f"alias: {', '.join(POLICY_ALIASES)})")
    return cls(seed)  # type: ignore[call-arg]
