"""The virtual-time cluster: N simulated pods, a workload and a router, on one virtual clock.

Why an asyncio loop with a virtual clock (see `vloop`) rather than a hand-written event queue:
the EPP's request path is asyncio code — `Director.handle_request`, flow control's futures and
its dispatch loop with its tick and TTL timers. On this loop that code runs unchanged, so what
is measured is the production code, not a re-implementation of it. The loop's own timer heap is
the simulator's event queue: one timer per pod step, per scrape and per arrival.

Per request: it arrives (a timer), a task runs the router (which may hold it in flow control),
the engine request is added to the chosen pod, and when that pod's step finishes it the router
hears about it (`finished`, with usage for the EPP) and a chat schedules its next turn. Every pod
is scraped every `refresh_interval` at its own phase (one of `SCRAPE_SLOTS`); routers that read metrics only see
those scrapes. The run ends when every request has ended, or at `horizon` (requests still open
then are reported as unfinished).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from epp.errors import EppError
from epp.sim.cluster.kv_feed import DEFAULT_DELAY, KVEventFeed
from epp.sim.cluster.diagnostics import PickInfo, QueuedPrefill
from epp.sim.cluster.pods import ClusterPod
from epp.sim.cluster.routers import Router
from epp.sim.cluster.traffic import Job, Traffic
from epp.sim.cluster.vloop import VirtualTimeLoop, run_virtual
from epp.sim.cluster.workload import Workload
from epp.sim.config import EngineConfig, SimConfig
from epp.sim.factory import RequestFactory
from epp.sim.kv_cache import prepare_block_hashes
from epp.sim.pool import PodGroup, describe_pool, engine_configs, parse_pods
from epp.sim.request import FINISH_ABORT, Request
from epp.sim.steptime import StepTimeModel

log = logging.getLogger("epp.sim.cluster")

SCRAPE_SLOTS = 10  # distinct scrape phases per refresh interval (5 ms apart at the default 50 ms)


@dataclass(slots=True)
class Sample:
    """The cluster at one instant: engine queues, batches and the router's own queue."""

    time: float
    waiting: int
    running: int
    router_queued: int
    kv_usage: float  # mean over pods
    per_pod: list[int]  # waiting + running per pod
    completed: int  # requests served so far
    generated: int  # output tokens generated so far, all pods


@dataclass(slots=True)
class PodStats:
    prefix_queries: int
    prefix_hits: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    busy_time: float
    served: int
    # The pod's shape (`PodGroup.describe()`: profile and settings), its model steps, and those
    # outside the step-time model's calibrated range (tokens per step, or context).
    shape: str = "base"
    steps: int = 0
    steps_out_of_range: int = 0
    lora_loads: int = 0


@dataclass(slots=True)
class RunResult:
    """Everything a report needs from one run."""

    policy: str
    workload: Workload
    pods: int
    seed: int
    jobs: list[Job]
    samples: list[Sample]
    pod_stats: list[PodStats]
    end_time: float
    unfinished: int
    flow_control: bool = False
    sample_interval: float = 1.0
    # Per-token inter-token latency: step duration (rounded to 0.1 ms) -> decode tokens, all pods.
    itl_hist: dict[float, int] = field(default_factory=dict)
    picks: list[PickInfo] = field(default_factory=list)  # one per dispatch (see diagnostics)
    # The pool, e.g. "8 x h100-llama3-8b, 8 x a100-llama3-8b" (`pool.describe_pool`).
    pool: str = ""

    @property
    def steps_out_of_range_share(self) -> float:
        """Share of all model steps outside the calibrated step-time range (0..1): how much of
        the run's timing is extrapolated ("N% of steps outside the calibrated range")."""
        steps = sum(p.steps for p in self.pod_stats)
        return sum(p.steps_out_of_range for p in self.pod_stats) / steps if steps else 0.0


class Cluster:
    """Runs one workload against one router; `run()` returns a `RunResult`."""

    def __init__(self, workload: Workload, router: Router, *, pods: int | str | Sequence[PodGroup],
                 seed: int | None = None, refresh_interval: float = 0.05, sample_interval: float = 1.0,
                 horizon: float | None = None, sim_config: SimConfig | None = None,
                 scrape_phase: bool = True, pause_gc: bool = True,
                 kv_events_delay: float = DEFAULT_DELAY) -> None:
        """`pods`: a count, a `--pods` spec ("8:h100,8:a100") or its parsed groups; every pod
        starts from the workload's engine configuration (or `sim_config`'s)."""
        if refresh_interval <= 0:
            raise ValueError("refresh_interval must be > 0")
        if isinstance(pods, int) and pods < 1:
            raise ValueError("pods must be >= 1")
        self.workload = workload
        self.router = router
        self.seed = workload.seed if seed is None else seed
        self.refresh_interval = refresh_interval
        self.sample_interval = sample_interval
        self.sim_config = sim_config or workload.sim_config()
        self.groups = parse_pods(pods) if isinstance(pods, (int, str)) else list(pods)
        # A workload's own engine settings are explicit: a GPU profile's KV capacity does not undo them.
        explicit = workload.engine if sim_config is None else ()
        self.pod_configs: list[EngineConfig] = engine_configs(self.groups, self.sim_config.engine, explicit)
        base_profile = self.sim_config.engine.step_profile
        self.pod_shapes = [g.describe(base_profile) for g in self.groups for _ in range(g.count)]
        self.pool = describe_pool(self.groups, base_profile)
        self.num_pods = len(self.pod_configs)
        sizes = {c.block_size for c in self.pod_configs}
        if len(sizes) > 1:
            raise ValueError(f"--pods: the pods of one run must share block_size (got {sorted(sizes)}): "
                             "a request's block hashes are made once, before it is routed")
        self.horizon = horizon if horizon is not None else workload.duration * 10 + 600.0
        self.scrape_phase = scrape_phase
        self.pause_gc = pause_gc
        self.loop = VirtualTimeLoop()
        # Routers subscribe in `attach` to get every pod's KV-cache events (see kv_feed).
        self.kv_events = KVEventFeed(self.loop, kv_events_delay)
        self.pods: list[ClusterPod] = []
        self.jobs: list[Job] = []
        self.samples: list[Sample] = []
        self._open = 0
        self.completed = 0
        self._done: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.picks: list[PickInfo] = []

    # -- running --

    def run(self) -> RunResult:
        # The cyclic GC would repeatedly walk the millions of live objects of a big run (block
        # hash lists, index entries) for nothing: requests are freed by reference counting.
        paused = self.pause_gc and gc.isenabled()
        if paused:
            gc.disable()
        try:
            return run_virtual(self._main(), self.loop)
        finally:
            if paused:
                gc.enable()

    async def _main(self) -> RunResult:
        loop = self.loop
        cfg = self.sim_config
        models: dict[tuple[str, bool], StepTimeModel] = {}
        self.pods = []
        for i, engine_cfg in enumerate(self.pod_configs):
            key = (engine_cfg.step_profile, engine_cfg.cpu_overhead)
            step_time = models.get(key)
            if step_time is None:
                step_time = models[key] = engine_cfg.step_time_model()
            self.pods.append(ClusterPod(i, engine_cfg, loop, self._finished, step_time))
        for pod in self.pods:
            pod.serves(cfg.model)
        self._queued = QueuedPrefill(self.num_pods)
        self.factory = RequestFactory(cfg, seed=self.seed)
        self.traffic = Traffic(self.workload, pods=self.num_pods, seed=self.seed,
                               max_model_len=cfg.engine.max_model_len, tokenizer=self.factory.tokenizer)
        self._done = loop.create_future()
        self.router.attach(self)
        if self.router.wants_first_token:
            for pod in self.pods:
                pod.on_first_token = self._first_token
        if self.kv_events.active:
            for pod in self.pods:
                pod.publish_kv_events(self.kv_events)
        await self.router.start()
        if self.router.wants_metrics:
            # Every pod is scraped at its own phase of the interval, as independent scrape loops
            # are; phases are drawn from a few slots so one timer serves several pods.
            rng = random.Random(f"{self.seed}:scrape")
            slots: dict[int, list[ClusterPod]] = {}
            nslots = min(len(self.pods), SCRAPE_SLOTS) if self.scrape_phase else 1
            for pod in self.pods:
                self.router.observe(pod.index, pod.scrape(0.0))  # the first scrape, at start
                slots.setdefault(rng.randrange(nslots), []).append(pod)
            for slot, pods in sorted(slots.items()):
                phase = self.refresh_interval * slot / nslots
                loop.call_at(phase, self._scrape, pods, phase)
        loop.call_at(0.0, self._sample)
        self._schedule_next_arrival()
        self._check_done()
        try:
            await asyncio.wait_for(self._done, timeout=self.horizon)
        except TimeoutError:
            pass
        end = loop.time()
        unfinished = sum(1 for j in self.jobs if j.finish < 0 and not j.error)
        for task in list(self._tasks):
            task.cancel()
        await self.router.stop()
        for j in self.jobs:
            if j.finish < 0 and not j.error:
                j.error = "unfinished"
        return self._result(end, unfinished)

    def _result(self, end: float, unfinished: int) -> RunResult:
        stats = []
        for pod in self.pods:
            e = pod.engine
            stats.append(PodStats(prefix_queries=e.kv.queries, prefix_hits=e.kv.hits, prompt_tokens=e.prompt_tokens,
                                  generation_tokens=e.generation_tokens, preemptions=e.num_preemptions,
                                  busy_time=pod.busy_time, served=sum(e.finished_by_reason.values()),
                                  shape=self.pod_shapes[pod.index], steps=e.num_steps,
                                  steps_out_of_range=e.num_steps_out_of_range, lora_loads=e.num_lora_loads))
        itl_hist: dict[float, int] = {}
        for pod in self.pods:
            for k, v in pod.itl_hist.items():
                key = k / 10000.0
                itl_hist[key] = itl_hist.get(key, 0) + v
        flow = bool(getattr(self.router, "flow_control", False))
        return RunResult(policy=self.router.name, workload=self.workload, pods=self.num_pods, seed=self.seed,
                         jobs=self.jobs, samples=self.samples, pod_stats=stats, end_time=end, unfinished=unfinished,
                         flow_control=flow, sample_interval=self.sample_interval, itl_hist=itl_hist,
                         picks=self.picks, pool=self.pool)

    # -- arrivals --

    def _schedule_next_arrival(self) -> None:
        t = self.traffic.peek_time()
        if t is not None:
            self.loop.call_at(t, self._arrive_open)

    def _arrive_open(self) -> None:
        job = self.traffic.next_arrival()
        self._schedule_next_arrival()
        if job is not None:
            self._arrive(job)

    def _arrive(self, job: Job, owed: bool = False) -> None:
        """A request arrives; `owed`: a chat turn already counted as open when it was planned."""
        self.jobs.append(job)
        if not owed:
            self._open += 1
        assert job.prompt_ids is not None
        job.request = self.factory.from_token_ids(job.prompt_ids, max_tokens=job.output_tokens, ignore_eos=True,
                                                  lora=job.lora, arrival_time=job.arrival, request_id=str(job.id))
        job.prompt_ids = None  # the engine request holds them now
        job.request.user_data = job
        # Final hashes (cache_salt mixed in) before routing: what routers look up in the pods.
        prepare_block_hashes(job.request, self.sim_config.engine.block_size)
        task = self.loop.create_task(self._route(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _route(self, job: Job) -> None:
        try:
            pod = await self.router.route(job)
        except EppError as exc:
            self._end(job, exc.reason or exc.code.value)
            return
        except Exception:  # a bug in a router: end the request visibly instead of leaving it open
            log.exception("routing request %s failed", job.id)
            self._end(job, "internal")
            return
        req = job.request
        assert req is not None
        now = self.loop.time()
        job.dispatch = now
        job.pod = pod
        believed, predicted = self.router.belief(job)
        excess = self._queued.excess(pod, [p.engine for p in self.pods])
        self.picks.append(PickInfo(job.id, excess, believed, predicted))
        job.prompt = ""  # the engine request has its blocks; the text is no longer needed
        req.arrival_time = now  # the engine's own clock starts when it receives the request
        try:
            self.pods[pod].add(req)
        except ValueError:
            self._end(job, "bad_request", routed=True)

    # -- completions --

    def _first_token(self, req: Request) -> None:
        job = req.user_data
        if isinstance(job, Job):
            job.first_token = req.first_token_time
            self.router.first_token(job)

    def _finished(self, req: Request) -> None:
        job = req.user_data
        assert isinstance(job, Job)
        if req.finish_reason == FINISH_ABORT:
            self._end(job, "aborted", routed=True)
            return
        job.first_token = req.first_token_time
        job.finish = req.finish_time
        job.generated = req.num_output_tokens
        job.cached_tokens = max(0, req.num_cached_tokens)
        self.completed += 1
        self._end(job, "", routed=True)

    def _end(self, job: Job, error: str, *, routed: bool = False) -> None:
        if error:
            job.error = error
        if routed:
            self.router.finished(job)
        nxt = self.traffic.follow_up(job, self.loop.time())
        if nxt is not None:
            self._open += 1  # the next turn is owed from now on, so the run does not end before it
            self.loop.call_at(nxt.arrival, self._arrive, nxt, True)
        job.request = None
        job.session = None
        self._open -= 1
        self._check_done()

    def _check_done(self) -> None:
        if self._open == 0 and self.traffic.exhausted and self._done is not None and not self._done.done():
            self._done.set_result(None)

    # -- observation --

    def _scrape(self, pods: list[ClusterPod], when: float) -> None:
        now = self.loop.time()
        observe = self.router.observe
        for pod in pods:
            observe(pod.index, pod.scrape(now))
        nxt = when + self.refresh_interval
        self.loop.call_at(nxt, self._scrape, pods, nxt)

    def _sample(self) -> None:
        now = self.loop.time()
        per_pod = []
        waiting = running = generated = 0
        kv = 0.0
        for pod in self.pods:
            e = pod.engine
            w, r = len(e.waiting), len(e.running)
            waiting += w
            running += r
            generated += e.generation_tokens
            kv += e.kv.usage
            per_pod.append(w + r)
        self.samples.append(Sample(now, waiting, running, self.router.queued(), kv / len(self.pods), per_pod,
                                   self.completed, generated))
        self.loop.call_at(now + self.sample_interval, self._sample)


def run_cluster(workload: Workload, router: Router, *, pods: int | str | Sequence[PodGroup],
                seed: int | None = None,
                **kwargs: object) -> RunResult:
    """Convenience: build a `Cluster` and run it."""
    return Cluster(workload, router, pods=pods, seed=seed, **kwargs).run()  # type: ignore[arg-type]

