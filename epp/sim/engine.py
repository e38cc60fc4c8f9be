"""A vLLM v1-style engine model: continuous batching with chunked prefill, steppable on any clock.

Pure state and arithmetic, no I/O and no clock of its own: the caller passes `now` to
`schedule()`, lets `output.duration` pass on its clock (real sleep, or a virtual event queue), then
calls `update()`. Per step the work is O(requests scheduled), so thousands of engines can run in
virtual time on one core.

Scheduling follows vLLM 0.32's `Scheduler.schedule` (`vllm/v1/core/sched/scheduler.py`):

- Running requests first, in order (decodes and unfinished prefill chunks). One that cannot get a
  block preempts the last running request (fcfs) or the lowest-priority one, the largest
  `(priority, arrival_time)` (priority), possibly itself; once it preempted itself, no further
  running request is scheduled in that step.
- Then, only if nothing was preempted in the step, waiting requests in queue order while the token
  budget, `max_num_seqs`, KV blocks (the whole sequence must fit: `scheduler_reserve_full_isl`)
  and LoRA slots (adapters of the requests scheduled in this step) allow. A waiting request never
  displaces a running one, whatever its priority: priority orders the waiting queue and picks
  preemption victims, nothing more (vLLM issue #40004 is still open in 0.32).
- A request's full blocks are cached as they are allocated, so a request admitted later in the
  same step hits them (see kv_cache.py).
- A step in which everything runnable was preempted runs empty in vLLM; the next step, which
  admits the requeued requests, starts at once. Here both happen in one `schedule` call.

Not modelled: async scheduling (vLLM 0.32's default overlaps scheduling with the GPU step; the
step time has no CPU part by default, which is what that overlap achieves), speculative decoding,
`long_prefill_token_threshold` (0 by default) and the `watermark` (0 by default).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from epp.sim.config import EngineConfig
from epp.sim.kv_cache import KVCacheManager, prepare_block_hashes
from epp.sim.kv_events import KVEvent
from epp.sim.queues import make_queue
from epp.sim.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Request, RequestStatus
from epp.sim.steptime import StepTimeModel

_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED


@dataclass(slots=True)
class SchedulerOutput:
    """One planned step: which requests compute how many tokens, and how long it takes."""

    start_time: float
    duration: float
    # Each request's token count for this step is in its `num_scheduled_tokens`.
    scheduled: list[Request]
    num_prefill_tokens: int
    num_decode_seqs: int
    kv_tokens_read: int
    qk_pairs: float
    num_preempted: int
    # Adapters loaded for this step (already in `duration`), and whether the step leaves the range
    # the step-time model was calibrated on (tokens per step, or a sequence's context).
    num_lora_loads: int = 0
    out_of_range: bool = False

    @property
    def end_time(self) -> float:
        return self.start_time + self.duration

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs


@dataclass(slots=True)
class StepResult:
    """What a finished step produced."""

    output: SchedulerOutput
    # Requests that got one new token at `end_time` (including those that finished).
    new_tokens: list[Request]
    # Requests that ended in this step (normally, or by an abort that arrived during the step).
    finished: list[Request]

    @property
    def end_time(self) -> float:
        return self.output.end_time


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """The engine's state as its metrics would show it."""

    num_running: int
    num_waiting: int
    num_waiting_deferred: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    running_loras: dict[str, int] = field(default_factory=dict)
    waiting_loras: dict[str, int] = field(default_factory=dict)


class Engine:
    """The scheduler, KV cache and step-time model of one vLLM engine."""

    def __init__(self, config: EngineConfig | None = None, step_time: StepTimeModel | None = None) -> None:
        self.config = config or EngineConfig()
        self.config.validate()
        self.step_time = step_time or self.config.step_time_model()
        self.kv = KVCacheManager(self.config.num_gpu_blocks, self.config.block_size,
                                 self.config.enable_prefix_caching,
                                 self.config.enable_kv_cache_events)
        self.waiting = make_queue(self.config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._in_flight: SchedulerOutput | None = None
        self._pending_aborts: list[Request] = []
        self._seq = 0
        # The latest time the engine was told about (start of the last step, or end of it once updated).
        self.now = 0.0
        # Cumulative counters (vLLM's *_total metrics); prompt tokens count at the first token.
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.generation_tokens = 0
        self.num_steps = 0
        # Model steps outside the step-time model's calibrated range; steps that ran empty because
        # everything runnable was preempted; adapter loads (LoRA not resident when scheduled).
        self.num_steps_out_of_range = 0
        self.num_empty_steps = 0
        self.num_lora_loads = 0
        # Adapters in the GPU's LoRA slots, least recently used first (vLLM's LRU worker manager).
        self._resident_loras: OrderedDict[str, None] = OrderedDict()
        self.finished_by_reason: dict[str, int] = {FINISH_STOP: 0, FINISH_LENGTH: 0, FINISH_ABORT: 0}

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req: Request) -> None:
        """Queue a request. Its output is capped so that prompt + output fits max_model_len."""
        max_len = self.config.max_model_len
        if req.prompt_len < 1 or req.prompt_len >= max_len:
            raise ValueError(f"prompt of {req.prompt_len} tokens does not fit max_model_len {max_len}")
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        room = max_len - req.prompt_len
        ids = req.prompt_token_ids
        if ids is not None and len(ids) != req.prompt_len:
            raise ValueError(f"{len(ids)} prompt token ids for a prompt of {req.prompt_len} tokens")
        if self.config.enable_prefix_caching:
            prepare_block_hashes(req, self.config.block_size)
        req.max_tokens = max(1, min(req.max_tokens, room))
        req.output_len = max(1, min(req.output_len, req.max_tokens))
        req.status = RequestStatus.WAITING
        req.seq = self._seq
        self._seq += 1
        if self.config.record_token_times and req.token_times is None:
            req.token_times = array("d")
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def abort_request(self, request_id: str, now: float | None = None) -> Request | None:
        """End a request early (client went away). Returns it if it ended now.

        `now` stamps its finish time (default: the engine's last known time).
        A request inside the step in flight ends when that step is updated; it then appears in
        that StepResult's `finished` with reason "abort" (unless it finished normally first).
        """
        req = self.requests.get(request_id)
        if req is None or req.status is _FINISHED:
            return None
        if req.num_scheduled_tokens:
            self._pending_aborts.append(req)
            return None
        self._finish_abort(req, self.now if now is None else now)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def busy(self) -> bool:
        """A step is in flight (scheduled, not yet updated)."""
        return self._in_flight is not None

    # ------------------------------------------------------------------ stepping

    def step(self, now: float) -> StepResult | None:
        """Schedule and immediately complete one step starting at `now` (virtual-time helper)."""
        out = self.schedule(now)
        return self.update(out) if out is not None else None

    def schedule(self, now: float) -> SchedulerOutput | None:
        """Plan the next step at time `now`; None if there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError("update() the step in flight before scheduling another")
        cfg = self.config
        self.now = now
        total_preempted = 0
        while True:
            scheduled: list[Request] = []
            budget = cfg.max_num_batched_tokens
            if cfg.batching == "prefill_first":
                budget, preempted = self._schedule_running(scheduled, budget, want=1)
                if not preempted:
                    budget = self._schedule_waiting(scheduled, budget, now)
                if not scheduled:
                    budget, more = self._schedule_running(scheduled, budget, want=0)
                    preempted += more
            else:
                budget, preempted = self._schedule_running(scheduled, budget, want=-1)
                if not preempted:
                    budget = self._schedule_waiting(scheduled, budget, now)
            total_preempted += preempted
            if scheduled or not preempted:
                break
            # Everything runnable was preempted: vLLM runs this step with no tokens (no forward
            # pass) and schedules again at once, admitting the requeued requests.
            self.num_empty_steps += 1
        if not scheduled:
            return None
        # (`num_preempted` counts the preemptions of an empty step folded into this one too.)

        prefill_tokens = decode_seqs = kv_tokens = longest = 0
        qk = 0.0
        for r in scheduled:
            n = r.num_scheduled_tokens
            c = r.num_computed_tokens
            if n == 1 and r.num_output_tokens and c + 1 == r.prompt_len + r.num_output_tokens:
                decode_seqs += 1
                kv_tokens += c
            else:
                prefill_tokens += n
                qk += n * (c + n * 0.5)
            if c + n > longest:
                longest = c + n
        st = self.step_time
        duration = st.seconds(prefill_tokens, decode_seqs, kv_tokens, qk, len(scheduled))
        loads = self._load_loras(scheduled) if cfg.max_loras else 0
        if loads:
            duration += loads * cfg.lora_load_ms * 1e-3
        out = SchedulerOutput(now, duration, scheduled, prefill_tokens, decode_seqs, kv_tokens, qk,
                              total_preempted, loads,
                              prefill_tokens + decode_seqs > st.max_tokens_per_step
                              or longest > st.max_context)
        self._in_flight = out
        return out

    def update(self, out: SchedulerOutput) -> StepResult:
        """Apply a planned step's results as of its end time: new tokens, finished requests."""
        if out is not self._in_flight:
            raise RuntimeError("update() must get the output of the last schedule()")
        self._in_flight = None
        self.num_steps += 1
        if out.out_of_range:
            self.num_steps_out_of_range += 1
        end = out.start_time + out.duration
        self.now = end
        new_tokens: list[Request] = []
        finished: list[Request] = []
        prompt_tokens = 0
        cached_tokens = 0
        for r in out.scheduled:
            r.num_computed_tokens += r.num_scheduled_tokens
            r.num_scheduled_tokens = 0
            if r.num_computed_tokens < r.prompt_len + r.num_output_tokens:
                continue  # a prefill chunk that does not reach the end of the sequence
            r.num_output_tokens += 1
            if r.first_token_time < 0:
                r.first_token_time = end
                prompt_tokens += r.prompt_len
                cached_tokens += r.num_cached_tokens
            else:
                r.last_itl = end - r.last_token_time
            r.last_token_time = end
            if r.token_times is not None:
                r.token_times.append(end)
            new_tokens.append(r)
            if r.num_output_tokens >= r.output_len:
                r.status = _FINISHED
                r.finish_reason = FINISH_LENGTH if r.num_output_tokens >= r.max_tokens else FINISH_STOP
                r.finish_time = end
                self.kv.free(r)
                self.finished_by_reason[r.finish_reason] += 1
                del self.requests[r.request_id]
                finished.append(r)
        self.prompt_tokens += prompt_tokens
        self.prompt_tokens_cached += cached_tokens
        self.generation_tokens += len(new_tokens)
        if finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        if self._pending_aborts:
            for r in self._pending_aborts:
                if r.status is not _FINISHED:
                    self._finish_abort(r, end)
                    finished.append(r)
            self._pending_aborts.clear()
        return StepResult(out, new_tokens, finished)

    # ------------------------------------------------------------------ state

    def snapshot(self) -> EngineSnapshot:
        """Gauges and counters as vLLM's /metrics would report them now."""
        running_loras: dict[str, int] = {}
        waiting_loras: dict[str, int] = {}
        deferred = 0
        if self.config.max_loras:
            for r in self.running:
                if r.lora:
                    running_loras[r.lora] = running_loras.get(r.lora, 0) + 1
            full = len(running_loras) >= self.config.max_loras
            for r in self.waiting:
                if r.lora:
                    waiting_loras[r.lora] = waiting_loras.get(r.lora, 0) + 1
                    if full and r.lora not in running_loras:
                        deferred += 1
        return EngineSnapshot(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_deferred=deferred,
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.queries,
            prefix_cache_hits=self.kv.hits,
            num_preemptions=self.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            running_loras=running_loras,
            waiting_loras=waiting_loras,
        )

    def take_kv_events(self) -> list[KVEvent]:
        """KV-cache events recorded since the last call, oldest first (empty unless
        `enable_kv_cache_events`). vLLM's scheduler takes them once per step and the engine core
        publishes them as one batch: call this after each `update()`."""
        return self.kv.take_events()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's `/reset_prefix_cache` (`Scheduler.reset_prefix_cache`): forget every cached
        block. Fails (False) while requests hold blocks, unless `reset_running_requests`, which
        first preempts every running request (call it between steps). The `AllBlocksCleared`
        event is recorded now and so goes out with the next step's batch, as on vLLM."""
        if reset_running_requests:
            if self._in_flight is not None:
                raise RuntimeError("reset running requests between steps, not during one")
            while self.running:
                self._preempt(self.running.pop())
        return self.kv.reset_prefix_cache()

    # ------------------------------------------------------------------ internals

    def _load_loras(self, scheduled: list[Request]) -> int:
        """Adapters of this batch that are not in a GPU LoRA slot are loaded before the forward
        pass (`LRUCacheWorkerLoRAManager.add_adapter`), evicting the least recently used."""
        wanted = {r.lora for r in scheduled if r.lora}
        if not wanted:
            return 0
        resident = self._resident_loras
        names = sorted(wanted)
        for name in names:
            if name in resident:
                resident.move_to_end(name)
        loads = 0
        for name in names:
            if name not in resident:
                if len(resident) >= self.config.max_loras:
                    resident.popitem(last=False)
                resident[name] = None
                loads += 1
        self.num_lora_loads += loads
        return loads

    def _schedule_running(self, scheduled: list[Request], budget: int, want: int) -> tuple[int, int]:
        """Give running requests their next tokens; want: -1 any, 1 prefill only, 0 decode only.

        Returns the remaining budget and how many requests were preempted.
        """
        running = self.running
        kv = self.kv
        priority = self.config.scheduling_policy == "priority"
        preempted = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = req.prompt_len + req.num_output_tokens - req.num_computed_tokens
            if want >= 0:
                is_prefill = num_new > 1 or not req.num_output_tokens
                if is_prefill != bool(want):
                    i += 1
                    continue
            if num_new > budget:
                num_new = budget
            # Fast path: no new block needed and none filled (15 of 16 decode steps).
            if req.num_computed_tokens + num_new > req.kv_fast_until:
                ok = kv.allocate_running(req, num_new)
                while not ok:
                    if priority:
                        victim = max(running, key=_victim_key)
                        idx = running.index(victim)
                        del running[idx]
                        if idx < i:
                            i -= 1
                        if victim.num_scheduled_tokens:
                            budget += victim.num_scheduled_tokens
                            scheduled.remove(victim)
                    else:
                        victim = running.pop()
                    self._preempt(victim)
                    preempted += 1
                    if victim is req:
                        break
                    ok = kv.allocate_running(req, num_new)
                if not ok:
                    break  # vLLM schedules no further running request in this step
            req.num_scheduled_tokens = num_new
            scheduled.append(req)
            budget -= num_new
            i += 1
        return budget, preempted

    def _schedule_waiting(self, scheduled: list[Request], budget: int, now: float) -> int:
        """Admit waiting requests while budget, sequence slots, blocks and LoRA slots allow."""
        cfg = self.config
        waiting = self.waiting
        running = self.running
        kv = self.kv
        bs = cfg.block_size
        full = cfg.scheduler_reserve_full_isl
        caching = kv.enable_prefix_caching
        max_loras = cfg.max_loras
        # The adapters of the requests scheduled so far in this step (vLLM's `scheduled_loras`).
        loras = {r.lora for r in scheduled if r.lora} if max_loras else None
        skipped: list[Request] = []
        while budget > 0 and len(waiting) and len(running) < cfg.max_num_seqs:
            req = waiting.peek()
            if (loras is not None and req.lora and req.lora not in loras
                    and len(loras) >= max_loras):
                skipped.append(waiting.pop())
                continue
            hit_blocks = kv.cached_prefix_blocks(req)
            hit_tokens = hit_blocks * bs
            num_new = req.prompt_len + req.num_output_tokens - hit_tokens
            if num_new > budget:
                num_new = budget
            if not kv.allocate_new(req, hit_blocks, num_new, full):
                break
            waiting.pop()
            if req.num_cached_tokens < 0:  # first admission (vLLM: num_preemptions == 0)
                req.num_cached_tokens = hit_tokens
                if caching:
                    kv.record_query(req.prompt_len, hit_tokens)
            if req.first_scheduled_time < 0:
                req.first_scheduled_time = now
            req.status = _RUNNING
            running.append(req)
            if loras is not None and req.lora:
                loras.add(req.lora)
            req.num_scheduled_tokens = num_new
            scheduled.append(req)
            budget -= num_new
        for r in reversed(skipped):
            waiting.prepend(r)
        return budget

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV blocks and requeue at the front."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_scheduled_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)

    def _finish_abort(self, req: Request, now: float) -> None:
        if req.status is _RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = _FINISHED
        req.finish_reason = FINISH_ABORT
        req.finish_time = now
        self.finished_by_reason[FINISH_ABORT] += 1
        self.requests.pop(req.request_id, None)


def _victim_key(r: Request) -> tuple[int, float]:
    """vLLM's preemption order under the priority policy: the largest (priority, arrival_time)
    goes first; on a tie, the earliest in the running list (Python's max keeps the first)."""
    return (r.priority, r.arrival_time)
