"""KV cache in blocks with automatic prefix caching, modelled on vLLM v1's block pool (0.32).

What follows vLLM (`vllm/v1/core/block_pool.py`, `kv_cache_manager.py`,
`single_type_kv_cache_manager.py`):

- Physical blocks with reference counts; block 0 is the null block, never handed out.
- A request's full blocks enter the prefix cache *when they are allocated*
  (`KVCacheManager.allocate_slots` caches up to the tokens the step will have computed), so a
  request admitted later in the same step already hits them.
- The cache does not deduplicate (`BlockHashToBlockMap`): a block computed by two requests at once
  is cached twice under one hash; a lookup takes the oldest copy, and evicting one copy leaves
  the other.
- The free queue (`FreeKVCacheBlockQueue`): freed blocks without a hash are reused first, cached
  ones go to the tail in the order `free_blocks` gets them — a request's blocks tail first — so
  eviction is least-recently-freed, a sequence's last block before its parents. Empty blocks are
  interchangeable, so they are kept as a stack of ids; cached free blocks in an ordered dict.
- Lookups stop one token short of the sequence (`get_computed_blocks`: at least one token is
  recomputed to get logits).
- With `enable_kv_cache_events`, the pool records vLLM's `BlockStored` (on caching), `BlockRemoved`
  (on eviction) and `AllBlocksCleared` (on reset) as it goes; `take_events` hands them over.

Prefix-cache statistics count tokens once per request, at its first admission (preempted requests
are left out, as vLLM keeps them in separate `preempted_*` counters).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

from epp.sim.block_hash import (event_extra_keys, extra_keys_seed, hash_block, hash_blocks,
                                synthetic_token_bytes, synthetic_token_ids)
from epp.sim.kv_events import (FULL_ATTENTION, MEDIUM_GPU, AllBlocksCleared, BlockRemoved,
                               BlockStored, KVEvent)
from epp.sim.request import Request

_NO_HASH = -1  # block hashes are unsigned 64-bit ints, so -1 marks "not cached"
_hash = xxhash.xxh3_64_intdigest


def prepare_block_hashes(req: Request, block_size: int) -> None:
    """Make `req.block_hashes` final, as vLLM computes them engine-side (once; idempotent): from
    the token ids with the LoRA and `cache_salt` when the producer gave ids but no hashes; for
    hashes made without ids, with the salt mixed into each, so only requests with the same salt
    share blocks. A router that looks requests up in a pod's cache calls this first."""
    if req.hashes_prepared:
        return
    req.hashes_prepared = True
    ids = req.prompt_token_ids
    if ids is not None:
        if not req.block_hashes and req.prompt_len >= block_size:
            req.block_hashes = hash_blocks(ids, block_size, lora=req.lora, cache_salt=req.cache_salt)
    elif req.cache_salt and req.block_hashes:
        key = b"cache_salt:" + req.cache_salt.encode()
        req.block_hashes = [_hash(key, seed=h) for h in req.block_hashes]


class KVCacheManager:
    """The block pool of one engine: reference counts, the prefix cache and the free queue."""

    __slots__ = ("block_size", "num_usable_blocks", "enable_prefix_caching", "events", "lora_ids",
                 "_free_ids", "_evictable", "_ref", "_hash", "_cached", "_dups",
                 "queries", "hits", "num_evicted")

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 enable_kv_cache_events: bool = False) -> None:
        self.block_size = block_size
        # vLLM keeps block 0 as the null block; usage is measured against the rest.
        self.num_usable_blocks = num_gpu_blocks - 1
        self.enable_prefix_caching = enable_prefix_caching
        # Events since the last `take_events` (None: not recording, and no cost).
        self.events: list[KVEvent] | None = [] if enable_kv_cache_events else None
        # LoRA adapter name -> the int id vLLM publishes (`lora_int_id`), numbered as first seen.
        self.lora_ids: dict[str, int] = {}
        self._free_ids: list[int] = list(range(self.num_usable_blocks, 0, -1))  # empty free blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached free blocks, LRU first
        self._ref = [0] * num_gpu_blocks
        self._hash = [_NO_HASH] * num_gpu_blocks
        self._cached: dict[int, int] = {}  # hash -> the block a lookup returns (the oldest copy)
        self._dups: dict[int, list[int]] = {}  # hash -> further copies, oldest first
        # Prefix-cache statistics in tokens (vllm:prefix_cache_queries / _hits).
        self.queries = 0
        self.hits = 0
        self.num_evicted = 0

    # ------------------------------------------------------------------ state

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references: empty ones plus cached ones waiting in the LRU."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - (len(self._free_ids) + len(self._evictable)) / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Distinct block hashes in the prefix cache, referenced or idle."""
        return len(self._cached)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    # ------------------------------------------------------------------ lookup and allocation

    def cached_prefix_blocks(self, req: Request) -> int:
        """Leading blocks of `req` found in the cache; at least one token is always recomputed
        (`KVCacheManager.get_computed_blocks`: the hit is capped at num_tokens - 1)."""
        if not self.enable_prefix_caching:
            return 0
        hashes = req.block_hashes
        limit = min((req.num_tokens - 1) // self.block_size, len(hashes))
        cached = self._cached
        n = 0
        while n < limit and hashes[n] in cached:
            n += 1
        return n

    def allocate_new(self, req: Request, hit_blocks: int, num_new_tokens: int,
                     full_sequence_must_fit: bool = True) -> bool:
        """Admit a request without blocks: take its `hit_blocks` cached blocks, allocate room for
        `num_new_tokens` more and cache what is full once they are computed (`allocate_slots`).

        With `full_sequence_must_fit` (vLLM's `scheduler_reserve_full_isl`, on by default) the
        free blocks must hold the whole sequence, not just this chunk. Returns False, changing
        nothing, if they do not. Idle hit blocks leave the free queue, so they count as needed.
        """
        bs = self.block_size
        hashes = req.block_hashes
        cached = self._cached
        ref = self._ref
        hit_ids = [cached[hashes[i]] for i in range(hit_blocks)]
        idle = 0
        for b in hit_ids:
            if ref[b] == 0:
                idle += 1
        computed = hit_blocks * bs
        end = computed + num_new_tokens
        new_blocks = -(-end // bs) - hit_blocks
        need = new_blocks
        if full_sequence_must_fit:
            need = max(need, -(-req.num_tokens // bs) - hit_blocks)
        if need + idle > len(self._free_ids) + len(self._evictable):
            return False
        evictable = self._evictable
        for b in hit_ids:  # BlockPool.touch
            c = ref[b]
            if c == 0:
                del evictable[b]
            ref[b] = c + 1
        req.blocks.extend(hit_ids)
        req.num_cached_blocks = hit_blocks
        req.num_computed_tokens = computed
        if new_blocks > 0:
            self._take(req, new_blocks)
        if end // bs > hit_blocks:
            self._cache_full_blocks(req, end)
        req.kv_fast_until = min(len(req.blocks) * bs, (req.num_cached_blocks + 1) * bs - 1)
        return True

    def allocate_running(self, req: Request, num_new_tokens: int) -> bool:
        """Room for `num_new_tokens` more tokens of a running request (False: out of blocks), and
        cache the blocks they fill. Callers may skip it while the request's computed tokens plus
        the new ones stay <= `req.kv_fast_until` (nothing to do then)."""
        bs = self.block_size
        end = req.num_computed_tokens + num_new_tokens
        need = -(-end // bs) - len(req.blocks)
        if need > 0:
            if need > len(self._free_ids) + len(self._evictable):
                return False
            self._take(req, need)
        if end // bs > req.num_cached_blocks:
            self._cache_full_blocks(req, end)
        req.kv_fast_until = min(len(req.blocks) * bs, (req.num_cached_blocks + 1) * bs - 1)
        return True

    def free(self, req: Request) -> None:
        """Release a finished or preempted request's blocks, tail first (`free_blocks`): empty
        ones are reused first, cached ones join the LRU tail."""
        ref = self._ref
        hashes = self._hash
        evictable = self._evictable
        free_ids = self._free_ids
        for b in reversed(req.blocks):
            c = ref[b] - 1
            ref[b] = c
            if c == 0:
                if hashes[b] == _NO_HASH:
                    free_ids.append(b)
                else:
                    evictable[b] = None
        req.blocks.clear()
        req.num_cached_blocks = 0
        req.kv_fast_until = -1

    def record_query(self, num_tokens: int, hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (`BlockPool.reset_prefix_cache`); False if any is in use."""
        if len(self._free_ids) + len(self._evictable) != self.num_usable_blocks:
            return False
        hashes = self._hash
        for b in self._evictable:
            hashes[b] = _NO_HASH
            self._free_ids.append(b)
        self._evictable.clear()
        self._cached.clear()
        self._dups.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call (`BlockPool.take_events`)."""
        events = self.events
        if not events:
            return []
        self.events = []
        return events

    # ------------------------------------------------------------------ internals

    def _take(self, req: Request, n: int) -> None:
        """Give `req` `n` free blocks: empty ones first, then the least recently freed cached ones,
        evicting them (`get_new_blocks` + `_maybe_evict_cached_block`)."""
        free_ids = self._free_ids
        blocks = req.blocks
        ref = self._ref
        m = len(free_ids)
        if n <= m:
            new = free_ids[m - n:]
            del free_ids[m - n:]
        else:
            new = free_ids[:]
            free_ids.clear()
            evictable = self._evictable
            block_hash = self._hash
            cached = self._cached
            events = self.events
            for _ in range(n - m):
                b = evictable.popitem(last=False)[0]
                h = block_hash[b]
                block_hash[b] = _NO_HASH
                if cached[h] == b and h not in self._dups:
                    del cached[h]
                else:
                    self._forget_copy(h, b)
                if events is not None:
                    events.append(BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU, group_idx=0))
                new.append(b)
            self.num_evicted += n - m
        for b in new:
            ref[b] = 1
        blocks.extend(new)

    def _forget_copy(self, h: int, b: int) -> None:
        """Drop block `b` from the copies cached under `h` (one of several)."""
        dups = self._dups[h]
        if self._cached[h] == b:
            self._cached[h] = dups.pop(0)
        else:
            dups.remove(b)
        if not dups:
            del self._dups[h]

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Enter the request's blocks that are full at `num_tokens` into the prefix cache
        (`BlockPool.cache_full_blocks`), hashing blocks of generated tokens as they fill."""
        bs = self.block_size
        start = req.num_cached_blocks
        end = num_tokens // bs
        req.num_cached_blocks = end
        if not self.enable_prefix_caching:
            return
        hashes = req.block_hashes
        if len(hashes) < end:
            self._extend_hashes(req, end)
        blocks = req.blocks
        block_hash = self._hash
        cached = self._cached
        for j in range(start, end):
            b = blocks[j]
            h = hashes[j]
            block_hash[b] = h
            if h in cached:
                self._dups.setdefault(h, []).append(b)
            else:
                cached[h] = b
        if self.events is not None:
            self.events.append(self._stored_event(req, start, end))

    def _extend_hashes(self, req: Request, upto: int) -> None:
        """Hash the request's blocks up to `upto` from their token ids, vLLM's way (the request's
        block hasher runs as tokens are appended; here when a block is first cached)."""
        hashes = req.block_hashes
        bs = self.block_size
        lora = req.lora
        salt = req.cache_salt
        for j in range(len(hashes), upto):
            parent = hashes[j - 1] if j else None
            lo = j * bs
            if lo >= req.prompt_len and parent is not None:  # all generated: no copy of the ids
                seed = extra_keys_seed(parent, lora, salt, False)
                hashes.append(_hash(synthetic_token_bytes(req.salt, lo, bs), seed=seed))
            else:
                hashes.append(hash_block(self._block_token_ids(req, j), parent, index=j, lora=lora,
                                         cache_salt=salt))

    def _block_token_ids(self, req: Request, j: int) -> array:
        """Token ids of block `j`: the prompt's real ids where known, else synthetic ones (from the
        block's hash for a full prompt block, so blocks that share a hash share ids; from the
        request's salt for the prompt's tail and every generated token)."""
        bs = self.block_size
        lo = j * bs
        hi = lo + bs
        prompt = req.prompt_len
        ids = req.prompt_token_ids
        if hi <= prompt:
            if ids is not None:
                return array("i", ids[lo:hi])
            if j < len(req.block_hashes):
                return synthetic_token_ids(req.block_hashes[j], 0, bs)
            return synthetic_token_ids(req.salt, lo, bs)
        out = array("i")
        if lo < prompt:
            if ids is not None:
                out.extend(ids[lo:prompt])
            else:
                out.extend(synthetic_token_ids(req.salt, lo, prompt - lo))
            lo = prompt
        out.extend(synthetic_token_ids(req.salt, lo, hi - lo))
        return out

    def _stored_event(self, req: Request, start: int, end: int) -> BlockStored:
        token_ids = array("i")
        for j in range(start, end):
            token_ids.extend(self._block_token_ids(req, j))
        lora = req.lora
        lora_id = None
        if lora:
            lora_id = self.lora_ids.get(lora)
            if lora_id is None:
                lora_id = self.lora_ids[lora] = len(self.lora_ids) + 1
        salt = req.cache_salt
        return BlockStored(
            block_hashes=req.block_hashes[start:end],
            parent_block_hash=req.block_hashes[start - 1] if start else None,
            token_ids=token_ids.tolist(),
            block_size=self.block_size,
            lora_id=lora_id,
            medium=MEDIUM_GPU,
            lora_name=lora,
            extra_keys=[event_extra_keys(lora, salt, j) for j in range(start, end)],
            group_idx=0,
            kv_cache_spec_kind=FULL_ATTENTION,
        )
