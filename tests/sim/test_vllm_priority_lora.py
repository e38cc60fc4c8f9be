"""Priority scheduling, LoRA slots and adapter loads, and cache_salt, as vLLM 0.32 has them.

What `--scheduling-policy priority` does in vLLM 0.32 (`Scheduler.schedule`,
`PriorityRequestQueue`): the waiting queue is ordered by (priority, arrival_time, request_id),
and when a *running* request cannot get a KV block the victim is
`max(running, key=(priority, arrival_time))`. Nothing else: a waiting request never displaces a
running one — not when `max_num_seqs` is the limit (the waiting scan just stops; vLLM issue
#40004, open, PRs unmerged) and not under KV pressure (a refused allocation stops the scan).
So the engine-side benefit of a priority is a better place in the engine's waiting queue.
"""

from __future__ import annotations

import pytest

from epp.sim.config import EngineConfig, SimConfig
from epp.sim.driver import run
from epp.sim.engine import Engine
from epp.sim.factory import RequestFactory
from epp.sim.kv_cache import prepare_block_hashes
from epp.sim.steptime import StepTimeModel


def make(**kw: object) -> tuple[Engine, RequestFactory]:
    cfg = SimConfig(engine=EngineConfig(**kw))  # type: ignore[arg-type]
    return Engine(cfg.engine), RequestFactory(cfg)


def step(eng: Engine):  # type: ignore[no-untyped-def]
    out = eng.schedule(eng.now)
    assert out is not None
    eng.update(out)
    return out


# ---------------------------------------------------------------- priority

def test_capture_run_b_order_of_service() -> None:
    """Fixture run B (README): max_num_seqs 4; eight priority-10 requests at t=0, two priority-5
    at t=0.3 s, 600 tokens each. The server finished four p10 first, then both p5 with two p10,
    then the last two p10: the p5 requests, sent later, went ahead of the waiting p10s."""
    eng, f = make(block_size=128, num_gpu_blocks=64, max_num_seqs=4, max_model_len=1024,
                  max_num_batched_tokens=2048, scheduling_policy="priority")
    p10 = [f.synthetic(6, 600, priority=10, arrival_time=0.0, request_id=f"p10-{i}") for i in range(8)]
    p5 = [f.synthetic(6, 600, priority=5, arrival_time=0.3, request_id=f"p5-{i}") for i in range(2)]
    run(eng, [*p10, *p5])
    finish = sorted({r.finish_time for r in p10 + p5})
    assert len(finish) == 3
    groups = [sorted(r.request_id for r in p10 + p5 if r.finish_time == t) for t in finish]
    assert groups == [["p10-0", "p10-1", "p10-2", "p10-3"], ["p10-4", "p10-5", "p5-0", "p5-1"],
                      ["p10-6", "p10-7"]]


def test_waiting_high_priority_never_displaces_a_running_request_at_max_num_seqs() -> None:
    """vLLM issue #40004, still so in 0.32: `if num_running >= self.max_num_active_reqs: break`
    ends the waiting scan; no preemption is tried for a more important waiting request."""
    eng, f = make(max_num_seqs=2, scheduling_policy="priority")
    low = [f.synthetic(100, 300, priority=10, arrival_time=0.0) for _ in range(2)]
    for r in low:
        eng.add_request(r)
    step(eng)
    urgent = f.synthetic(100, 10, priority=-100, arrival_time=eng.now)
    eng.add_request(urgent)
    run(eng, [])
    assert eng.num_preemptions == 0
    assert urgent.first_scheduled_time >= min(r.finish_time for r in low)


def test_waiting_high_priority_never_preempts_under_kv_pressure() -> None:
    """A waiting request that `allocate_slots` refuses stops the scan (`if new_blocks is None:
    break`); preemption happens only in the running pass, for a running request's growth."""
    eng, f = make(num_gpu_blocks=130, max_model_len=2048, scheduling_policy="priority")
    low = f.synthetic(1500, 200, priority=10, arrival_time=0.0)
    eng.add_request(low)
    step(eng)
    urgent = f.synthetic(1500, 10, priority=-100, arrival_time=eng.now)
    eng.add_request(urgent)
    run(eng, [])
    assert eng.num_preemptions == 0 and low.num_preemptions == 0
    assert urgent.first_scheduled_time >= low.finish_time


def test_priority_victim_may_be_a_request_already_scheduled_in_the_step() -> None:
    """Victim = max(running, key=(priority, arrival_time)) over the whole running list, including
    a request scheduled earlier in this step: it is unscheduled and its tokens go back to the
    budget (`scheduled_running_reqs.remove`, `token_budget += ...`)."""
    eng, f = make(num_gpu_blocks=21, block_size=16, max_model_len=320, scheduling_policy="priority")
    b = f.synthetic(150, 100, priority=5, arrival_time=0.0, request_id="b")  # 10 blocks
    eng.add_request(b)
    step(eng)
    a = f.synthetic(159, 100, priority=1, arrival_time=eng.now, request_id="a")  # 10 blocks
    eng.add_request(a)
    step(eng)  # b decodes, a is admitted: the cache is full
    step(eng)  # a's first decode still fits its 10th block
    out = step(eng)  # a needs an 11th: b, scheduled before it in this step, is the victim
    assert out.scheduled == [a] and out.num_preempted == 1
    assert b.status.name == "PREEMPTED" and a.num_preemptions == 0
    assert out.num_decode_seqs == 1


def test_priority_ties_preempt_the_later_arrival() -> None:
    eng, f = make(num_gpu_blocks=40, block_size=16, max_model_len=512, scheduling_policy="priority")
    a = f.synthetic(200, 300, priority=1, arrival_time=0.0, request_id="a")
    b = f.synthetic(200, 300, priority=5, arrival_time=0.0, request_id="b")
    c = f.synthetic(200, 300, priority=5, arrival_time=0.001, request_id="c")
    run(eng, [a, b, c])
    assert a.num_preemptions == 0 and c.num_preemptions >= 1
    assert c.num_preemptions >= b.num_preemptions


def test_fcfs_victim_is_the_last_running_request() -> None:
    eng, f = make(num_gpu_blocks=40, block_size=16, max_model_len=512)
    reqs = [f.synthetic(200, 300, priority=9 - i, arrival_time=0.0, request_id=f"r{i}") for i in range(3)]
    run(eng, reqs)
    assert reqs[0].num_preemptions == 0 and reqs[2].num_preemptions >= 1


# ---------------------------------------------------------------- LoRA

def test_lora_slots_count_the_adapters_scheduled_in_this_step() -> None:
    """`scheduled_loras` starts from the running requests scheduled in this step and grows with
    each admission; a request for another adapter is skipped (and keeps its place) when it is
    full — the base model never is."""
    eng, f = make(max_loras=1, lora_load_ms=0.0)
    a = f.synthetic(64, 50, lora="a", arrival_time=0.0)
    b = f.synthetic(64, 10, lora="b", arrival_time=0.0)
    base = f.synthetic(64, 10, arrival_time=0.0)
    for r in (a, b, base):
        eng.add_request(r)
    out = step(eng)
    assert out.scheduled == [a, base]
    assert [r.request_id for r in eng.waiting] == [b.request_id]
    run(eng, [])
    assert b.first_scheduled_time >= a.finish_time


def test_a_non_resident_adapter_costs_a_load_in_the_step_that_needs_it() -> None:
    """vLLM's LRU worker LoRA manager loads an adapter the batch needs that is not in a slot
    (`LRUCacheWorkerLoRAManager.add_adapter`) before the forward pass; the step waits for it."""
    eng, f = make(max_loras=1, lora_load_ms=20.0)
    m = StepTimeModel.load()
    a = f.synthetic(64, 3, lora="a", arrival_time=0.0)
    eng.add_request(a)
    first = step(eng)
    plain = m.seconds(first.num_prefill_tokens, first.num_decode_seqs, first.kv_tokens_read,
                      first.qk_pairs, 1)
    assert first.num_lora_loads == 1 and first.duration == pytest.approx(plain + 0.020)
    second = step(eng)
    assert second.num_lora_loads == 0  # resident now
    run(eng, [])
    b = f.synthetic(64, 3, lora="b", arrival_time=eng.now)
    again = f.synthetic(64, 3, lora="a", arrival_time=eng.now)
    run(eng, [b])
    run(eng, [again])
    assert eng.num_lora_loads == 3  # one slot: b evicts a, a evicts b


def test_adapters_that_fit_the_slots_load_once() -> None:
    eng, f = make(max_loras=2, lora_load_ms=20.0)
    run(eng, [f.synthetic(64, 5, lora=("a", "b")[i % 2], arrival_time=i * 0.2) for i in range(8)])
    assert eng.num_lora_loads == 2


# ---------------------------------------------------------------- cache_salt

def test_cache_salt_separates_requests_without_token_ids_too() -> None:
    """vLLM puts `cache_salt` in the first block's extra keys, so every block of a salted prompt
    differs from the unsalted one's; requests with the same salt still share."""
    eng, f = make()
    text = "You are a helpful assistant. " * 40
    reqs = []
    for i, salt in enumerate((None, "t1", "t2", "t1", None)):
        r = f.from_text(text + f"q{i}", max_tokens=2, ignore_eos=True, arrival_time=float(i))
        r.cache_salt = salt
        reqs.append(r)
    salted = list(reqs[1].block_hashes)
    prepare_block_hashes(reqs[1], 16)
    prepare_block_hashes(reqs[1], 16)  # once only: a router may prepare before the engine does
    assert reqs[1].block_hashes != salted
    run(eng, reqs)
    hits = [r.num_cached_tokens for r in reqs]
    assert hits[0] == hits[1] == hits[2] == 0
    assert hits[3] > 0 and hits[4] > 0 and hits[3] == hits[4]
