"""Behaviour of the engine model in virtual time (no HTTP, no wall clock)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from epp.sim.config import EngineConfig, SimConfig
from epp.sim.driver import QueueSample, run, poisson_times
from epp.sim.engine import Engine, StepResult
from epp.sim.factory import RequestFactory
from epp.sim.request import Request, RequestStatus
from epp.sim.steptime import StepTimeModel, profiles


def make(**engine_kw: object) -> tuple[Engine, RequestFactory]:
    cfg = SimConfig(engine=EngineConfig(**engine_kw))  # type: ignore[arg-type]
    return Engine(cfg.engine), RequestFactory(cfg)


def poisson_workload(f: RequestFactory, rate: float, duration: float, prompt: int, output: int,
                     seed: int = 1) -> list[Request]:
    rng = random.Random(seed)
    return [f.synthetic(prompt, output, arrival_time=t)
            for t in poisson_times(rate, rng, duration=duration)]


# ---------------------------------------------------------------- step time and timestamps

def test_step_time_matches_calibration_checks() -> None:
    """The engine's P/D/K/Q accounting reproduces the calibration's worked examples."""
    durations: list[tuple[int, int, float]] = []

    def record(step: StepResult) -> None:
        o = step.output
        durations.append((o.num_prefill_tokens, o.num_decode_seqs, o.duration))

    eng, f = make(max_num_batched_tokens=8192)
    run(eng, [f.synthetic(2048, 1, arrival_time=0.0)], on_step=record)
    assert durations[0][0] == 2048
    assert durations[0][2] == pytest.approx(0.0526, rel=0.02)  # "a lone 2048-token prompt: 52.6 ms"

    durations.clear()
    eng, f = make()
    reqs = [f.synthetic(992, 40, arrival_time=0.0) for _ in range(64)]
    run(eng, reqs, on_step=record)
    decode_steps = [d for p, n, d in durations if p == 0 and n == 64]
    assert decode_steps
    assert decode_steps[0] == pytest.approx(0.0108, rel=0.05)  # "64 decodes at ~1k context: 10.8 ms"


def test_shipped_coefficients_match_shared_calibration(shared_dir: Path) -> None:
    path = shared_dir / "calibration" / "step-time.json"
    if not path.exists():
        pytest.skip("shared calibration not present")
    shared = json.loads(path.read_text())
    for name in profiles():
        m = StepTimeModel.load(name)
        src = shared[name]
        assert m.c_ms == src["c_ms"]
        assert m.prefill_ms_per_token == src["prefill_ms_per_token"]
        assert m.decode_ms_per_seq == src["decode_ms_per_seq"]
        assert m.attn_ms_per_kv_token == src["attn_ms_per_kv_token"]
        assert m.prefill_attn_ms_per_qk_pair == src["prefill_attn_ms_per_qk_pair"]


def test_request_timestamps_are_ordered_and_complete() -> None:
    eng, f = make()
    reqs = poisson_workload(f, rate=20, duration=5, prompt=300, output=50)
    res = run(eng, reqs)
    assert len(res.finished) == len(reqs)
    for r in res.finished:
        assert r.status is RequestStatus.FINISHED and r.finish_reason == "length"
        assert r.arrival_time <= r.first_scheduled_time < r.first_token_time <= r.finish_time
        assert r.num_output_tokens == 50
        assert r.token_times is not None and len(r.token_times) == 50
        assert r.token_times[0] == r.first_token_time and r.token_times[-1] == r.finish_time
        assert all(x > 0 for x in r.itls())
        assert r.ttft > 0 and r.tpot > 0
    assert eng.kv.usage == 0.0 and not eng.running and not len(eng.waiting)
    assert eng.generation_tokens == 50 * len(reqs)
    assert eng.prompt_tokens == 300 * len(reqs)


def test_runs_are_deterministic() -> None:
    def once() -> list[tuple[float, float]]:
        eng, f = make()
        res = run(eng, poisson_workload(f, rate=30, duration=3, prompt=200, output=64, seed=7))
        return [(r.first_token_time, r.finish_time) for r in res.finished]

    assert once() == once()


# ---------------------------------------------------------------- prefix caching

def test_repeated_prefix_is_cheaper_than_a_new_one() -> None:
    eng, f = make()
    prefix_a = "You are a helpful assistant. " * 140  # ~4060 chars, ~1015 tokens
    prefix_b = "Answer briefly and precisely. " * 140
    first = f.from_text(prefix_a + "Question one?", max_tokens=4, ignore_eos=True, arrival_time=0.0)
    again = f.from_text(prefix_a + "Another question?", max_tokens=4, ignore_eos=True, arrival_time=1.0)
    fresh = f.from_text(prefix_b + "Another question?", max_tokens=4, ignore_eos=True, arrival_time=2.0)
    prefill: dict[str, int] = {}

    def record(step: StepResult) -> None:
        for r in step.output.scheduled:
            prefill[r.request_id] = prefill.get(r.request_id, 0) + (
                step.output.num_prefill_tokens if len(step.output.scheduled) == 1 else 0)

    run(eng, [first, again, fresh], on_step=record)
    assert again.num_cached_tokens >= 992  # all full blocks of the shared prefix
    assert fresh.num_cached_tokens == 0 and first.num_cached_tokens == 0
    assert again.ttft < 0.5 * fresh.ttft
    assert prefill[again.request_id] < prefill[fresh.request_id] - 900
    assert eng.kv.hits == again.num_cached_tokens
    assert eng.kv.queries == first.prompt_len + again.prompt_len + fresh.prompt_len
    assert eng.prompt_tokens_cached == again.num_cached_tokens


def test_identical_prompt_recomputes_at_least_one_token() -> None:
    eng, f = make()
    text = "z" * 64 * 4  # exactly 4 blocks
    a = f.from_text(text, max_tokens=2, ignore_eos=True, arrival_time=0.0)
    b = f.from_text(text, max_tokens=2, ignore_eos=True, arrival_time=1.0)
    run(eng, [a, b])
    assert b.num_cached_tokens == 48  # 3 of 4 blocks: the last token must be computed


def test_idle_cached_blocks_are_evicted_lru_under_pressure() -> None:
    # 300 blocks; each 1600-token prompt takes 100 (+1 for output).
    def scenario(others: int) -> int:
        eng, f = make(num_gpu_blocks=300, max_model_len=2048)
        t = 0.0
        reqs = [f.synthetic(1600, 8, prefix_len=1600, prefix_key=1, arrival_time=t)]
        for k in range(others):
            t += 1.0
            reqs.append(f.synthetic(1600, 8, prefix_len=1600, prefix_key=100 + k, arrival_time=t))
        probe = f.synthetic(1600, 8, prefix_len=1600, prefix_key=1, arrival_time=t + 1.0)
        run(eng, [*reqs, probe])
        assert eng.kv.usage == 0.0
        return probe.num_cached_tokens

    assert scenario(others=1) >= 1584  # still cached: hit
    assert scenario(others=4) == 0  # evicted by newer prompts: miss


# ---------------------------------------------------------------- load, KV pressure, preemption

def test_throughput_levels_off_at_the_step_time_bound() -> None:
    horizon = 20.0
    max_seqs = 64
    throughput: dict[float, float] = {}
    for rate in (5.0, 20.0, 60.0, 120.0):
        eng, f = make(max_num_seqs=max_seqs)
        run(eng, poisson_workload(f, rate, horizon, prompt=256, output=128), until=horizon)
        throughput[rate] = eng.generation_tokens / horizon
    m = StepTimeModel.load()
    # Each step yields at most max_seqs tokens and costs at least c + a_d * D.
    bound = max_seqs / ((m.c_ms + m.decode_ms_per_seq * max_seqs) * 1e-3)
    assert throughput[5.0] == pytest.approx(5.0 * 128, rel=0.15)  # light load: all served
    assert throughput[20.0] == pytest.approx(20.0 * 128, rel=0.15)
    assert throughput[120.0] < 0.6 * 120 * 128  # overload: far less than offered
    assert throughput[120.0] == pytest.approx(throughput[60.0], rel=0.15)  # it has levelled off
    assert throughput[120.0] <= bound


def test_kv_exhaustion_queues_and_preempts_then_recovers() -> None:
    eng, f = make(num_gpu_blocks=200, max_model_len=2048)
    reqs = [f.synthetic(512, 512, arrival_time=0.0) for _ in range(8)]  # 8 x 64 blocks > 199
    seen: list[QueueSample] = []

    def check(step: StepResult) -> None:
        assert 0 <= eng.kv.num_free_blocks <= eng.kv.num_usable_blocks
        seen.append(QueueSample(step.end_time, len(eng.waiting), len(eng.running), eng.kv.usage))

    res = run(eng, reqs, on_step=check)
    assert eng.num_preemptions > 0
    assert any(r.num_preemptions > 0 for r in reqs)
    assert max(s.num_waiting for s in seen) > 0
    assert max(s.kv_cache_usage for s in seen) > 0.95
    assert len(res.finished) == 8 and all(r.num_output_tokens == 512 for r in reqs)
    assert eng.kv.usage == 0.0


def test_fcfs_preempts_the_newest_request() -> None:
    eng, f = make(num_gpu_blocks=130, max_model_len=2048)
    old = f.synthetic(1000, 600, arrival_time=0.0)
    new = f.synthetic(900, 600, arrival_time=0.001)
    run(eng, [old, new])
    assert new.num_preemptions > 0 and old.num_preemptions == 0


# ---------------------------------------------------------------- scheduling policies

def _prio_run(policy: str) -> tuple[list[Request], list[Request]]:
    eng, f = make(scheduling_policy=policy, max_num_seqs=2)
    low = [f.synthetic(100, 50, priority=10, arrival_time=0.0) for _ in range(6)]
    high = [f.synthetic(100, 50, priority=5, arrival_time=0.01) for _ in range(2)]
    run(eng, [*low, *high])
    return low, high


def test_priority_policy_serves_lower_numbers_first() -> None:
    low, high = _prio_run("priority")
    waiting_low = [r for r in low if r.first_scheduled_time > 0.01]
    assert len(waiting_low) == 4
    assert max(r.first_scheduled_time for r in high) < min(r.first_scheduled_time for r in waiting_low)


def test_fcfs_ignores_priority() -> None:
    low, high = _prio_run("fcfs")
    assert min(r.first_scheduled_time for r in high) > max(r.first_scheduled_time for r in low)


def test_priority_preempts_the_lowest_priority_running_request() -> None:
    eng, f = make(num_gpu_blocks=130, max_model_len=2048, scheduling_policy="priority")
    important_late = f.synthetic(900, 600, priority=0, arrival_time=0.001)
    unimportant_early = f.synthetic(1000, 600, priority=9, arrival_time=0.0)
    run(eng, [unimportant_early, important_late])
    assert unimportant_early.num_preemptions > 0 and important_late.num_preemptions == 0


# ---------------------------------------------------------------- LoRA slots

@pytest.mark.parametrize("max_loras", [1, 2])
def test_lora_slots_limit_adapters_per_batch(max_loras: int) -> None:
    eng, f = make(max_loras=max_loras)
    reqs = [f.synthetic(64, 20, lora=("a", "b")[i % 2], arrival_time=0.0) for i in range(6)]
    eng_adapters: list[int] = []
    snaps = []

    def check(step: StepResult) -> None:
        eng_adapters.append(len({r.lora for r in eng.running}))
        snaps.append(eng.snapshot())

    for r in reqs:
        eng.add_request(r)
    first = eng.snapshot()
    assert first.waiting_loras == {"a": 3, "b": 3} and first.running_loras == {}
    run(eng, [], on_step=check)
    assert all(r.num_output_tokens == 20 for r in reqs)
    assert max(eng_adapters) == max_loras
    if max_loras == 1:
        deferred = [s for s in snaps if s.num_waiting_deferred]
        assert deferred and all(len(s.running_loras) == 1 for s in deferred)
        assert deferred[0].num_waiting_deferred == 3


# ---------------------------------------------------------------- chunked prefill and batching

def test_chunked_prefill_keeps_decodes_going_only_when_mixing() -> None:
    def chunk_steps(batching: str) -> tuple[int, int]:
        """(steps that prefilled the long prompt, those that also decoded the talker)."""
        eng, f = make(max_num_batched_tokens=1024, batching=batching)
        talker = f.synthetic(50, 200, arrival_time=0.0)
        long = f.synthetic(6000, 2, arrival_time=0.1)
        counts = [0, 0]

        def record(step: StepResult) -> None:
            sched = step.output.scheduled
            if long in sched and step.output.num_prefill_tokens:
                counts[0] += 1
                counts[1] += talker in sched
                assert step.output.num_tokens <= 1024

        run(eng, [talker, long], on_step=record)
        assert long.num_output_tokens == 2 and talker.num_output_tokens == 200
        return counts[0], counts[1]

    steps, with_talker = chunk_steps("mixed")
    assert steps >= 6 and with_talker == steps  # chunks of <= 1024 tokens, decodes ride along
    steps, with_talker = chunk_steps("prefill_first")
    assert steps >= 6 and with_talker == 0  # the talker stalls for the whole prefill


def test_work_conserving_mixed_batching_is_stable_where_prefill_first_is_not() -> None:
    """Seed 004 (queueing theory of LLM serving): at the same load, a work-conserving mixed
    batching policy keeps its queue bounded, while prefill-first without mixed batching (old
    vLLM) lets it grow without bound."""
    rate, horizon = 100.0, 60.0

    def queue_trace(batching: str) -> list[QueueSample]:
        eng, f = make(batching=batching)
        reqs = poisson_workload(f, rate, horizon, prompt=128, output=128, seed=4)
        return run(eng, reqs, until=horizon, sample_every=5.0).samples

    mixed = queue_trace("mixed")
    separate = queue_trace("prefill_first")
    half = len(mixed) // 2
    assert max(s.num_waiting for s in mixed) < 30
    assert max(s.num_waiting for s in mixed[half:]) <= max(s.num_waiting for s in mixed[:half]) + 30
    # The non-mixing engine runs at its sequence limit and its queue keeps growing.
    first = sum(s.num_waiting for s in separate[:half]) / half
    second = sum(s.num_waiting for s in separate[half:]) / (len(separate) - half)
    assert second > 2 * first
    assert separate[-1].num_waiting > 150
    assert separate[-1].num_running == 256


# ---------------------------------------------------------------- aborts

def test_abort_waiting_running_and_in_flight_requests() -> None:
    eng, f = make(max_num_seqs=1)
    running = f.synthetic(100, 50, arrival_time=0.0, request_id="r")
    waiting = f.synthetic(100, 50, arrival_time=0.0, request_id="w")
    eng.add_request(running)
    eng.add_request(waiting)
    out = eng.schedule(0.0)
    assert out is not None and out.scheduled == [running]
    assert eng.abort_request("w") is waiting  # not in the step: ends now
    assert eng.abort_request("r") is None  # in flight: ends when the step is applied
    step = eng.update(out)
    assert running in step.finished and running.finish_reason == "abort"
    assert waiting.finish_reason == "abort" and eng.finished_by_reason["abort"] == 2
    assert not eng.has_unfinished() and eng.kv.usage == 0.0
    assert eng.schedule(step.end_time) is None
    assert eng.abort_request("r") is None  # already gone


# ---------------------------------------------------------------- accounting invariants

def _check_kv(eng: Engine) -> None:
    """Reference counts equal the holders of each physical block; free = empty + idle cached."""
    kv = eng.kv
    held: dict[int, int] = {}
    for r in eng.running:
        assert len(set(r.blocks)) == len(r.blocks)
        for b in r.blocks:
            held[b] = held.get(b, 0) + 1
    for r in eng.waiting:
        assert not r.blocks and r.num_computed_tokens == 0
    refs = kv._ref
    assert {b: c for b, c in enumerate(refs) if c} == held
    assert set(kv._evictable) == {b for b, c in enumerate(refs) if c == 0 and kv._hash[b] != -1}
    assert set(kv._free_ids) == {b for b in range(1, len(refs)) if refs[b] == 0 and kv._hash[b] == -1}
    assert kv.num_free_blocks == kv.num_usable_blocks - len(held)
    # Every cached block is found under its hash (the oldest copy first, then the duplicates).
    copies: dict[int, list[int]] = {}
    for b, h in enumerate(kv._hash):
        if h != -1:
            copies.setdefault(h, []).append(b)
    assert {h: sorted([b, *kv._dups.get(h, [])]) for h, b in kv._cached.items()} == \
        {h: sorted(bs) for h, bs in copies.items()}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("batching", ["mixed", "prefill_first"])
def test_kv_accounting_stays_consistent_under_churn(policy: str, batching: str) -> None:
    rng = random.Random(11)
    eng, f = make(num_gpu_blocks=400, max_model_len=2048, max_num_seqs=12,
                  max_num_batched_tokens=700, scheduling_policy=policy, batching=batching,
                  max_loras=2)
    t = 0.0
    reqs = []
    for _ in range(150):
        t += rng.expovariate(40)
        reqs.append(f.synthetic(rng.randrange(20, 900), rng.randrange(1, 300),
                                prefix_len=rng.choice((0, 256, 512)), prefix_key=rng.randrange(3),
                                priority=rng.randrange(3), lora=rng.choice((None, "a", "b", "c")),
                                arrival_time=t))
    aborted = set(rng.sample(range(150), 15))

    def on_step(step: StepResult) -> None:
        _check_kv(eng)
        for i in list(aborted):
            r = reqs[i]
            if r.arrival_time <= step.end_time and r.request_id in eng.requests and rng.random() < 0.2:
                eng.abort_request(r.request_id)
                aborted.discard(i)
                _check_kv(eng)

    run(eng, reqs, on_step=on_step)
    assert eng.num_preemptions > 0  # the cache was under pressure
    assert not eng.has_unfinished() and eng.kv.usage == 0.0
    assert all(r.is_finished for r in reqs)
    _check_kv(eng)
