"""KV cache in blocks with automatic prefix caching, modelled on vLLM v1's block pool.

Physical blocks are only counted; a block is identified by its chained hash once it is full and
registered. Blocks no request references stay cached in an LRU and are evicted on demand, so a
later request with the same prefix skips that prefill, exactly as long as memory allows.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

from epp.sim.request import Request

_hash_with_seed = xxhash.xxh3_64_intdigest


class KVCacheManager:
    """Block accounting plus the prefix cache (hash -> reference count, LRU of idle blocks)."""

    __slots__ = ("block_size", "num_usable_blocks", "num_free_blocks", "enable_prefix_caching",
                 "_ref", "_evictable", "queries", "hits", "num_evicted")

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        # vLLM keeps one block as the null block; usage is measured against the rest.
        self.num_usable_blocks = num_gpu_blocks - 1
        # Blocks no request references: empty ones plus cached ones waiting in the LRU.
        self.num_free_blocks = self.num_usable_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Prefix-cache statistics in tokens, counted once per new request (as vLLM does).
        self.queries = 0
        self.hits = 0
        self.num_evicted = 0

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or idle."""
        return len(self._ref)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._ref

    def cached_prefix_blocks(self, req: Request) -> int:
        """Leading blocks of `req` found in the cache; at least one token is always recomputed."""
        if not self.enable_prefix_caching:
            return 0
        hashes = req.block_hashes
        limit = min((req.num_tokens - 1) // self.block_size, len(hashes))
        ref = self._ref
        n = 0
        while n < limit and hashes[n] in ref:
            n += 1
        return n

    def admit(self, req: Request, hit_blocks: int, num_new_tokens: int) -> bool:
        """Give a request without blocks its cache hits plus room for `num_new_tokens`.

        Returns False, changing nothing, if the free blocks do not suffice. Touched idle cache
        blocks leave the free pool, so they count against the free blocks too.
        """
        bs = self.block_size
        hashes = req.block_hashes
        ref = self._ref
        idle_hits = 0
        for i in range(hit_blocks):
            if ref[hashes[i]] == 0:
                idle_hits += 1
        computed = hit_blocks * bs
        new_blocks = -(-(computed + num_new_tokens) // bs) - hit_blocks
        if new_blocks + idle_hits > self.num_free_blocks:
            return False
        blocks = req.blocks
        evictable = self._evictable
        for i in range(hit_blocks):
            h = hashes[i]
            c = ref[h]
            if c == 0:
                del evictable[h]
                self.num_free_blocks -= 1
            ref[h] = c + 1
            blocks.append(h)
        self._take(new_blocks)
        blocks.extend([None] * new_blocks)
        req.num_computed_tokens = computed
        return True

    def grow(self, req: Request, num_new_tokens: int) -> bool:
        """Room for `num_new_tokens` more tokens of a running request, or False if out of blocks."""
        need = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False
        self._take(need)
        req.blocks.extend([None] * need)
        return True

    def register_full_blocks(self, req: Request, num_new_tokens: int) -> None:
        """Publish the blocks that become full once `num_new_tokens` more tokens are computed.

        Like vLLM this happens at schedule time. A block whose hash another request registered
        first stays private to this request (a duplicate copy), as in vLLM.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start = req.num_computed_tokens // bs
        end = (req.num_computed_tokens + num_new_tokens) // bs
        if start >= end:
            return
        hashes = req.block_hashes
        blocks = req.blocks
        ref = self._ref
        for j in range(start, end):
            if j < len(hashes):
                h = hashes[j]
            else:
                # An output block: unique to this request (its salt), so only its own recompute
                # after a preemption can hit it.
                parent = hashes[j - 1] if j else req.salt
                h = _hash_with_seed(j.to_bytes(8, "little"), seed=(parent ^ req.salt) & 0xFFFFFFFFFFFFFFFF)
                hashes.append(h)
            if blocks[j] is None and h not in ref:
                ref[h] = 1
                blocks[j] = h

    def free(self, req: Request) -> None:
        """Release a finished or preempted request's blocks; cached ones go to the LRU tail-first."""
        ref = self._ref
        evictable = self._evictable
        freed = 0
        for h in reversed(req.blocks):
            if h is None:
                freed += 1
                continue
            c = ref[h] - 1
            ref[h] = c
            if c == 0:
                evictable[h] = None
                freed += 1
        self.num_free_blocks += freed
        req.blocks.clear()

    def record_query(self, num_tokens: int, hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget idle cached blocks (vLLM's /reset_prefix_cache); False if any block is in use."""
        if len(self._ref) != len(self._evictable):
            return False
        self._ref.clear()
        self._evictable.clear()
        return True

    def _take(self, n: int) -> None:
        """Use `n` free blocks, evicting least-recently-freed cached blocks if no empty ones remain."""
        if n <= 0:
            return
        evictable = self._evictable
        shortfall = n - (self.num_free_blocks - len(evictable))
        if shortfall > 0:
            ref = self._ref
            for _ in range(shortfall):
                h, _ = evictable.popitem(last=False)
                del ref[h]
            self.num_evicted += shortfall
        self.num_free_blocks -= n
