"""One simulated pod in the virtual-time cluster: an engine stepped by loop timers, and what a
metrics scrape of it would return.

Stepping: `add` queues a request and, if the engine is idle, plans a step at once; each planned
step sets one timer at its end time, whose callback applies it (tokens, finished requests) and
plans the next. An idle engine sets no timer, so 100 idle pods cost nothing.

Scraping: `scrape(now)` builds the `EndpointMetrics` the EPP's data layer would have built from
this pod's `/metrics` at `now` — waiting and running requests, KV-cache use, LoRA adapters,
cache geometry (vLLM's `cache_config_info`) and the mean inter-token latency over the window
since the previous scrape, with the data layer's rules (first scrape sets the baseline; an idle
window reads 0 on an idle pod and keeps the last value on a busy one). `update_time` is the
scrape's time: between scrapes the EPP sees the past, not the truth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from epp.datastore import EndpointMetrics
from epp.sim.config import EngineConfig
from epp.sim.engine import Engine, SchedulerOutput
from epp.sim.request import Request
from epp.sim.steptime import StepTimeModel

if TYPE_CHECKING:
    from epp.sim.cluster.kv_feed import KVEventFeed


class ClusterPod:
    """An engine on the loop's clock; `on_finish(request)` is called as requests end."""

    __slots__ = ("index", "engine", "loop", "on_finish", "on_first_token", "itl_sum", "itl_count", "last_scrape",
                 "_max_loras", "_num_blocks", "_block_size", "_max_model_len", "busy_time", "itl_hist", "kv_feed", "_models")

    def __init__(self, index: int, config: EngineConfig, loop: asyncio.AbstractEventLoop,
                 on_finish: Callable[[Request], None], step_time: StepTimeModel | None = None) -> None:
        self.index = index
        self.engine = Engine(config, step_time)
        self.loop = loop
        self.on_finish = on_finish
        # Set when the router listens for first tokens (the EPP learns from them, as from a stream).
        self.on_first_token: Callable[[Request], None] | None = None
        # Cumulative inter-token latency histogram totals (what vLLM's _sum/_count would show).
        self.itl_sum = 0.0
        self.itl_count = 0
        self.busy_time = 0.0  # seconds spent in steps
        # Per-token ITL distribution: step duration in units of 0.1 ms -> decode tokens.
        self.itl_hist: dict[int, int] = {}
        self.last_scrape: EndpointMetrics | None = None
        self._max_loras = config.max_loras
        self._models: frozenset[str] = frozenset()  # the served model's name, as vLLM labels its metrics
        self._num_blocks = config.num_gpu_blocks
        self._block_size = config.block_size
        self._max_model_len = config.max_model_len  # as vLLM's cache_config_info says it
        self.kv_feed: KVEventFeed | None = None

    def publish_kv_events(self, feed: KVEventFeed) -> None:
        """Record KV-cache events from now on and hand each step's to `feed` (before any request)."""
        engine = self.engine
        if engine.requests:
            raise RuntimeError("enable KV events before the pod gets requests")
        self.engine = Engine(replace(engine.config, enable_kv_cache_events=True), engine.step_time)
        self.kv_feed = feed

    # -- requests and steps --

    def add(self, request: Request) -> None:
        """Queue a request now (ValueError if it can never fit, as vLLM answers 400)."""
        self.engine.add_request(request)
        if not self.engine.busy:
            self._plan()

    def _plan(self) -> None:
        engine = self.engine
        now = self.loop.time()
        if now < engine.now:
            now = engine.now
        out = engine.schedule(now)
        if out is not None:
            self.loop.call_at(out.start_time + out.duration, self._step_done, out)

    def _step_done(self, out: SchedulerOutput) -> None:
        step = self.engine.update(out)
        feed = self.kv_feed
        if feed is not None:  # one batch per step with events, at the step's end, as vLLM
            events = self.engine.take_kv_events()
            if events:
                feed.publish(self.index, events)
        decodes = out.num_decode_seqs
        if decodes:
            # Each decode's token came one step after its previous one: ITL = the step's duration.
            self.itl_sum += out.duration * decodes
            self.itl_count += decodes
            key = int(out.duration * 10000.0 + 0.5)
            hist = self.itl_hist
            hist[key] = hist.get(key, 0) + decodes
        self.busy_time += out.duration
        first = self.on_first_token
        if first is not None:
            for r in step.new_tokens:
                if r.num_output_tokens == 1:
                    first(r)
        for r in step.finished:
            self.on_finish(r)
        if not self.engine.busy:
            self._plan()

    def serves(self, model: str) -> None:
        """The base model's name, which the scraped metrics carry (vLLM's `model_name` label)."""
        self._models = frozenset({model})

    # -- what a scrape sees --

    def scrape(self, now: float) -> EndpointMetrics:
        engine = self.engine
        running = len(engine.running)
        prev = self.last_scrape
        itl = 0.0
        if prev is not None:
            itl = prev.inter_token_latency
            d_count = self.itl_count - prev.itl_count
            if d_count > 0:
                itl = (self.itl_sum - prev.itl_sum) / d_count
            elif running == 0:
                itl = 0.0
        active: frozenset[str] = frozenset()
        waiting_models: frozenset[str] = frozenset()
        if self._max_loras:
            active = frozenset(r.lora for r in engine.running if r.lora)
            waiting_models = frozenset(r.lora for r in engine.waiting if r.lora)
        m = EndpointMetrics(
            models=self._models,
            waiting_queue_size=len(engine.waiting),
            running_requests=running,
            kv_cache_usage=engine.kv.usage,
            active_models=active,
            waiting_models=waiting_models,
            max_active_models=self._max_loras,
            cache_block_size=self._block_size,
            cache_num_blocks=self._num_blocks,
            max_model_len=self._max_model_len,
            update_time=now,
            inter_token_latency=itl,
            itl_sum=self.itl_sum,
            itl_count=float(self.itl_count),
        )
        self.last_scrape = m
        return m
