"""The precise index: router keys from token ids, under stores, removes, gaps, replays and restarts."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from tokenizers import Tokenizer

from epp.datalayer.kv_events import BlockStored, decode_payload
from epp.datastore.kv_block_index import KVBlockIndex, chain_seed, router_keys
from tests.precise.helpers import MODEL_DIR, frames, kvreq_prompt

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def tokens(text: str) -> list[int]:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(text).ids


def batches() -> list[list[Any]]:
    return [decode_payload(p)[0].events for _, _, p in frames()]


# -- synthetic engine: vLLM-shaped events for token sequences --


@dataclass
class Stored:  # the class name is what the index dispatches on (duck-typed like the simulator's structs)
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"


Stored.__name__ = "BlockStored"


@dataclass
class Removed:
    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = 0


Removed.__name__ = "BlockRemoved"


class AllBlocksCleared:
    pass


@dataclass
class Engine:
    """Hashes blocks like an engine would (any scheme: the index must not care)."""

    block_size: int = 16
    salt: int = 12345
    chains: dict[tuple[int, ...], int] = field(default_factory=dict)

    def store(self, ids: list[int], start_block: int = 0, **kw: Any) -> Stored:
        n = len(ids) // self.block_size
        hashes, parent = [], None
        for i in range(n):
            h = hash((self.salt, tuple(ids[: (i + 1) * self.block_size]))) & (2**64 - 1)
            if i == start_block - 1:
                parent = h
            if i >= start_block:
                hashes.append(h)
        return Stored(hashes, parent, ids[start_block * self.block_size: n * self.block_size], self.block_size, **kw)

    def hashes(self, ids: list[int]) -> list[int]:
        return [hash((self.salt, tuple(ids[: (i + 1) * self.block_size]))) & (2**64 - 1)
                for i in range(len(ids) // self.block_size)]


def seq(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2000) for _ in range(n)]


# -- the real captures --


def test_captured_prompts_match_what_the_engine_stored() -> None:
    index = KVBlockIndex(block_size=64)
    events = batches()
    index.apply(A, events[0], 1.0)
    index.apply(A, events[1], 1.0)
    for k in (0, 1):
        ids = tokens(kvreq_prompt(k))
        assert len(ids) == 396  # as the server reported (usage.prompt_tokens)
        keys = index.keys_for(ids)
        assert len(keys) == 6  # 396 // 64
        assert index.match(keys).matched == {A: 6}  # 3 engine blocks of 128 = 6 router blocks of 64
    assert index.match(index.keys_for(tokens("w5 w6 w7 " * 100))).matched == {}


def test_captured_evictions_and_the_clear_empty_the_index() -> None:
    index = KVBlockIndex(block_size=64)
    events = batches()
    for batch in events[:10]:
        index.apply(A, batch, 1.0)
    keys = index.keys_for(tokens(kvreq_prompt(0)))
    assert index.match(keys).matched == {A: 6}
    for batch in events[10:14]:
        index.apply(A, batch, 2.0)
    assert index.match(keys).matched == {}  # the flood evicted run C's first prompts
    assert index.engine_blocks(A) == 62  # 63 usable blocks, one in use by the running request
    assert index.stats.unknown_removes == 0
    index.apply(A, events[14], 3.0)
    assert index.size == 0 and index.engine_blocks(A) == 0
    assert index.stats.resets == {"cleared": 1}


def test_same_prompt_on_two_servers_is_kept_per_endpoint() -> None:
    """vLLM 0.32's hashes are equal on every server: the map from engine hash is per endpoint."""
    index = KVBlockIndex(block_size=64)
    events = batches()
    index.apply(A, events[0], 1.0)
    index.apply(B, events[0], 1.0)
    keys = index.keys_for(tokens(kvreq_prompt(0)))
    assert index.match(keys).matched == {A: 6, B: 6}
    index.apply(B, [Removed(events[0][0].block_hashes[2:])], 2.0)
    assert index.match(keys).matched == {A: 6, B: 4}


@pytest.mark.parametrize("router_block", [16, 48, 64, 128, 200])
@pytest.mark.parametrize("engine_block", [16, 128])
def test_router_keys_do_not_depend_on_the_engine_block_size(router_block: int, engine_block: int) -> None:
    ids = seq(1000)
    engine = Engine(block_size=engine_block)
    index = KVBlockIndex(block_size=router_block)
    first = engine.store(ids[:512])
    index.apply(A, [first], 1.0)
    index.apply(A, [engine.store(ids, start_block=512 // engine_block)], 1.0)
    cached_tokens = (len(ids) // engine_block) * engine_block
    assert index.match(index.keys_for(ids)).matched == {A: cached_tokens // router_block}


def test_lora_and_cache_salt_key_blocks_apart() -> None:
    ids = seq(256)
    engine = Engine()
    index = KVBlockIndex(block_size=16)
    index.apply(A, [engine.store(ids, lora_name="ad1", extra_keys=[("ad1",)] * 16)], 1.0)
    index.apply(B, [engine.store(ids, extra_keys=[("s3cret",)] + [None] * 15)], 1.0)
    assert index.match(index.keys_for(ids)).matched == {}
    assert index.match(index.keys_for(ids, lora_name="ad1")).matched == {A: 16}
    assert index.match(index.keys_for(ids, cache_salt="s3cret")).matched == {B: 16}


def test_multimodal_blocks_never_match_text() -> None:
    ids = seq(64)
    index = KVBlockIndex(block_size=16)
    index.apply(A, [Engine().store(ids, extra_keys=[None, [("img-hash", 0)], None, None])], 1.0)
    assert index.match(index.keys_for(ids)).matched == {A: 1}  # only the block before the image


def test_interleaved_stores_and_removes_on_several_endpoints() -> None:
    """A random interleaving against a model of what each endpoint holds."""
    rng = random.Random(3)
    index = KVBlockIndex(block_size=16)
    engine = Engine()
    prompts = [seq(rng.randrange(32, 400), seed=s) for s in range(30)]
    for p in prompts[10:]:
        p[:160] = prompts[0][:160]  # a shared prefix
    held: dict[str, set[int]] = {A: set(), B: set()}
    for step in range(600):
        ep = rng.choice((A, B))
        p = rng.choice(prompts)
        hs = engine.hashes(p)
        if not hs:
            continue
        if rng.random() < 0.6:
            # store from the first block not held (the engine stores only new blocks)
            start = 0
            while start < len(hs) and hs[start] in held[ep]:
                start += 1
            if start == len(hs):
                continue
            index.apply(ep, [engine.store(p, start_block=start)], float(step))
            held[ep].update(hs)
        else:
            # evict the tail of a chain, as vLLM's free queue does
            mine = [h for h in hs if h in held[ep]]
            k = rng.randrange(1, len(mine) + 1) if mine else 0
            victims = mine[len(mine) - k:]
            index.apply(ep, [Removed(victims)], float(step))
            held[ep].difference_update(victims)
        for q in prompts[:12]:
            want = {}
            qh = engine.hashes(q)
            for e in (A, B):
                n = 0
                while n < len(qh) and qh[n] in held[e]:
                    n += 1
                if n:
                    want[e] = n
            assert index.match(index.keys_for(q)).matched == want


def test_orphans_under_claim_never_over_claim() -> None:
    """Events missed before the EPP started: a child whose parent it never saw is not indexed."""
    ids = seq(256)
    engine = Engine()
    index = KVBlockIndex(block_size=16)
    index.apply(A, [engine.store(ids, start_block=8)], 1.0)  # parent (blocks 0-7) never seen
    assert index.match(index.keys_for(ids)).matched == {}
    assert index.stats.skipped_blocks["orphan"] == 8
    index.apply(A, [engine.store(ids[:128])], 2.0)  # the prefix arrives later (re-stored)
    assert index.match(index.keys_for(ids)).matched == {A: 8}
    index.apply(A, [engine.store(ids, start_block=8)], 3.0)  # and the child again: now keyed
    assert index.match(index.keys_for(ids)).matched == {A: 16}


def test_reset_drops_one_endpoint_only() -> None:
    ids = seq(128)
    index = KVBlockIndex(block_size=16)
    for ep in (A, B):
        index.apply(ep, [Engine().store(ids)], 1.0)
    index.reset(A, "restart")
    assert index.match(index.keys_for(ids)).matched == {B: 8}
    assert index.has_events(A)  # it still publishes: precise, just empty
    index.apply(B, [AllBlocksCleared()], 2.0)
    assert index.match(index.keys_for(ids)).matched == {}
    assert index.size == 0


def test_tiers_are_counted_apart() -> None:
    ids = seq(128)
    engine = Engine()
    index = KVBlockIndex(block_size=16)
    index.apply(A, [engine.store(ids)], 1.0)
    hashes = engine.hashes(ids)
    index.apply(A, [Stored(hashes[4:], hashes[3], [], 16, medium="CPU")], 1.0)  # offloaded copies, no tokens
    index.apply(A, [Removed(hashes[4:], medium="GPU")], 1.0)  # GPU copies evicted
    found = index.match(index.keys_for(ids))
    assert found.matched == {A: 8}
    assert found.off_gpu == {A: {"CPU": 4}}
    index.apply(A, [Removed(hashes[4:], medium="CPU")], 2.0)
    assert index.match(index.keys_for(ids)).matched == {A: 4}


def test_sliding_window_groups_are_not_indexed_as_prefixes() -> None:
    ids = seq(128)
    index = KVBlockIndex(block_size=16)
    index.apply(A, [Engine().store(ids, group_idx=1, kv_cache_spec_kind="sliding_window")], 1.0)
    index.apply(A, [Engine().store(ids, kv_cache_spec_kind="something-new")], 1.0)
    assert index.match(index.keys_for(ids)).matched == {}
    assert index.stats.skipped_blocks == {"sliding_window": 8, "other_kind": 8}


def test_malformed_events_are_skipped() -> None:
    index = KVBlockIndex(block_size=16)
    index.apply(A, [Stored([1, 2], None, [1] * 17, 16), Stored([3], None, [2**40] * 16, 16)], 1.0)
    assert index.size == 0 and index.stats.skipped_blocks["malformed"] == 3
    index.apply(A, [Removed([99])], 1.0)
    assert index.stats.unknown_removes == 1


def test_memory_is_bounded() -> None:
    index = KVBlockIndex(block_size=16, max_keys=100)
    engine = Engine()
    for s in range(20):
        index.apply(A, [engine.store(seq(160, seed=s))], float(s))
    assert index.size <= 100
    assert index.stats.capacity_evictions >= 100
    assert index.match(index.keys_for(seq(160, seed=19))).matched == {A: 10}  # the newest is kept


def test_speculative_entries_expire_or_are_confirmed() -> None:
    ids = seq(128)
    index = KVBlockIndex(block_size=16, speculative_ttl=2.0)
    keys = index.keys_for(ids)
    index.speculate(A, keys, now=10.0)
    assert index.match(keys, now=10.5).matched == {A: 8}
    assert index.match(keys, now=12.5).matched == {}
    assert index.stats.speculative_expired == 8
    index.speculate(A, keys, now=20.0)
    index.apply(A, [Engine().store(ids)], 20.1)
    assert index.stats.speculative_confirmed == 8
    assert index.match(keys, now=30.0).matched == {A: 8}  # confirmed: no longer expires


def test_removed_endpoint_leaves_nothing() -> None:
    ids = seq(128)
    index = KVBlockIndex(block_size=16)
    index.apply(A, [Engine().store(ids)], 1.0)
    index.speculate(B, index.keys_for(ids), now=1.0)
    index.remove_endpoint(A)
    index.remove_endpoint(B)
    assert index.size == 0 and index.endpoints() == []
    assert index.match(index.keys_for(ids)).matched == {}


def test_router_keys_are_a_chain() -> None:
    ids = seq(100)
    keys = router_keys(ids, 16, chain_seed())
    assert len(keys) == 6
    assert router_keys(ids[:64], 16, chain_seed()) == keys[:4]
    assert router_keys(ids, 16, chain_seed("lora")) != keys


def test_the_simulators_event_structs_and_raw_payloads_feed_the_index() -> None:
    """How the virtual-time cluster feeds the EPP in-process: its `EventBatch`es as they are, or
    the raw msgpack payload through the subscriber's decoder."""
    from epp.sim.kv_events import BlockStored as SimStored
    from epp.sim.kv_events import EventBatch as SimBatch
    from epp.sim.kv_events import encode_batch

    ids = seq(64)
    stored = SimStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=ids, block_size=32, lora_id=None,
                       medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                       kv_cache_spec_kind="full_attention")
    index = KVBlockIndex(block_size=16)
    index.apply(A, SimBatch(ts=1.0, events=[stored]).events, now=1.0)
    index.apply(B, decode_payload(encode_batch(SimBatch(ts=1.0, events=[stored])))[0].events, now=1.0)
    assert index.match(index.keys_for(ids)).matched == {A: 4, B: 4}
