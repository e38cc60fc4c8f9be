"""The precise prefix index: which endpoint's engine holds which prompt blocks, from its KV events.

A pure data structure (no I/O, no clock of its own): the data layer's KV-event subscriber writes
it (`apply`), the `precise-prefix-cache-producer` reads it during scheduling (`match`), and the
simulator can feed it in-process with the same event objects.

Keys are *router keys* the EPP computes from token ids (`router_keys`): xxhash3 chained over
fixed-size blocks of uint32 token ids, seeded by the LoRA adapter and `cache_salt`. The engine's
own block hashes are opaque ids: at `BlockStored` each engine block is mapped to the router keys
its tokens complete (the chain continues from its parent's state), and `BlockRemoved` resolves
through that map. So the engine's hash seed, hash algorithm and block size never need to match
ours, and since vLLM's default hash is the same on every server, the map is kept per endpoint.

What is indexed, and what is not:
- only groups whose `kv_cache_spec_kind` caches a contiguous prefix (full / MLA attention);
  sliding-window, Mamba or chunked-local groups are counted and skipped (a prefix "held" by such
  a group is not reusable as one, llm-d-router#2362);
- a block whose parent the index never saw (events missed before the EPP started) cannot be
  keyed: it is remembered as an orphan so its children are too (the index under-claims, never
  over-claims);
- blocks whose extra keys carry more than the LoRA name and `cache_salt` (multimodal ids,
  prompt-embedding digests) are keyed apart, so a text-only request never matches them;
- tiers: each block carries the media it is held on (GPU, CPU offload, storage); a lookup counts
  the leading blocks held on any tier and weighs them per tier.

Memory is bounded: at most `max_keys` router keys summed over endpoints; past it the oldest
engine blocks of the endpoint being written are dropped (counted as capacity evictions).
Speculative entries (the picked endpoint, before its events arrive) live `speculative_ttl`
seconds unless a `BlockStored` confirms them.

Eviction foresight: each endpoint's engine blocks are kept least recently used first (stored, or
used by a request the EPP sent there: `dispatched`, `released`), with the keys the requests sent
there are expected to store; `foresee` says how much of a prefix an endpoint whose cache is full
will still hold once those allocations have evicted its oldest blocks — the events of the step
that evicts them arrive only after it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import msgspec
import xxhash

TIER_GPU = 1
TIER_CPU = 2
TIER_STORAGE = 4
TIERS = {"GPU": TIER_GPU, "CPU": TIER_CPU, "STORAGE": TIER_STORAGE}
TIER_NAMES = {bit: name for name, bit in TIERS.items()}
PREFIX_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})
# vLLM's other `KVCacheSpecKind` values: skipped, counted under their name (anything else: "other_kind").
OTHER_KINDS = frozenset({"sliding_window", "sliding_window_mla", "mamba", "chunked_local_attention",
                         "encoder_only_attention", "cross_attention", "unknown"})

# Engine blocks a request's use makes recent, at most: 128k tokens of 16-token blocks; a pod that
# publishes tiny blocks cannot make every request walk a hundred thousand.
MAX_RECENCY_WALK = 8192

_hash = xxhash.xxh3_64_intdigest
_SEED_TAG = b"epp-router-key\x00"
_EXTRA_TAG = b"epp-extra\x00"
_extra_encoder = msgspec.msgpack.Encoder()
EngineHash = int | bytes


def chain_seed(lora_name: str = "", cache_salt: str = "") -> int:
    """The seed of a sequence's router-key chain: blocks of different adapters or salts never
    share keys, exactly as the engine keeps them apart."""
    return _hash(_SEED_TAG + lora_name.encode() + b"\x00" + cache_salt.encode())


def token_bytes(token_ids: Sequence[int] | array) -> bytes:
    """Token ids as the little-endian uint32 bytes router keys hash (C speed, no Python loop)."""
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids.tobytes()
    return array("I", token_ids).tobytes()


def chain_keys(seed: int, data: bytes, block_size: int, pending: bytes = b"") -> tuple[list[int], int, bytes]:
    """Continue a chain: (keys of the blocks completed, the new chain state, leftover bytes).

    `data` is uint32 token bytes; `pending` the bytes of an unfinished block carried over from
    the previous call (engine and router block sizes need not divide each other)."""
    if pending:
        data = pending + data
    step = block_size * 4
    full = len(data) - len(data) % step
    view = memoryview(data)
    keys: list[int] = []
    h = seed
    for off in range(0, full, step):
        h = _hash(view[off:off + step], seed=h)
        keys.append(h)
    return keys, h, bytes(view[full:])


def router_keys(token_ids: Sequence[int] | array, block_size: int, seed: int) -> list[int]:
    """Router keys of a prompt's full blocks (the partial tail block is not cached by the engine)."""
    return chain_keys(seed, token_bytes(token_ids), block_size)[0]


@dataclass(slots=True)
class _EngineBlock:
    """One engine block on one endpoint: the router keys it completes and the chain state after it."""

    hash: EngineHash
    parent: _EngineBlock | None  # the block before it in its sequence, when known
    keys: tuple[int, ...]
    state: int  # chain state after this block (0 for an orphan)
    pending: bytes  # token bytes of an unfinished router block
    tiers: int  # TIER_* bits it is held on
    orphan: bool = False
    seq: int = 0  # recency stamp on its endpoint (the order of `_Endpoint.blocks`)


@dataclass(slots=True)
class EndpointEvents:
    """Per-endpoint event bookkeeping, read by the producer (fallback) and the metrics."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    batches: int = 0
    last_event: float = 0.0  # on the caller's clock; 0: never
    first_event: float = 0.0


@dataclass(slots=True)
class IndexStats:
    """Counters for metrics (Prometheus reads them at scrape time)."""

    admissions: int = 0  # router keys added (kvcache_index_admissions_total)
    evictions: int = 0  # router keys removed, any reason (kvcache_index_evictions_total)
    capacity_evictions: int = 0  # of which: the memory bound
    lookups: int = 0  # match() calls (kvcache_index_lookup_requests_total)
    lookup_blocks: int = 0  # request blocks looked up
    lookup_hits: int = 0  # blocks found on the best endpoint (kvcache_index_lookup_hits_total)
    last_hit: float = 0.0  # clock of the last lookup that matched anything
    skipped_blocks: dict[str, int] = field(default_factory=dict)  # reason -> engine blocks not indexed
    unknown_removes: int = 0  # BlockRemoved of a hash never stored (or already gone)
    speculative_added: int = 0
    speculative_confirmed: int = 0
    speculative_expired: int = 0
    foreseen_blocks: int = 0  # router blocks held at lookup but not credited: evicted before admission
    resets: dict[str, int] = field(default_factory=dict)  # reason -> endpoint resets


class _Endpoint:
    __slots__ = ("address", "blocks", "keys", "speculative", "expected", "non_gpu", "group", "events",
                 "engine_block_size", "clock", "evicting")

    def __init__(self, address: str) -> None:
        self.address = address
        # Least recently stored or used first: the engine's own eviction order, as far as we see it.
        self.blocks: dict[EngineHash, _EngineBlock] = {}
        self.keys: dict[int, _EngineBlock] = {}  # router key -> the engine block that completes it
        self.speculative: dict[int, float] = {}  # router key -> expiry (insertion order = expiry order)
        # Router keys the requests sent here will store, not yet confirmed -> expiry: the blocks
        # the engine will allocate before it admits the next request.
        self.expected: dict[int, float] = {}
        self.engine_block_size = 0  # tokens per engine block (from its events)
        self.clock = 0  # the last recency stamp given
        self.evicting = False  # it has evicted a GPU block since its cache was last empty
        self.non_gpu = 0  # keys held but not on the GPU tier (tier breakdown is skipped when 0)
        self.group: int | None = None  # the prefix-cache group indexed (the first one seen)
        self.events = EndpointEvents()


@dataclass(slots=True)
class BlockMatch:
    """One lookup: leading blocks per endpoint, and how many of them are held off the GPU."""

    matched: dict[str, int]
    off_gpu: dict[str, dict[str, int]]  # endpoint -> {tier name: blocks} for blocks not on the GPU


class KVBlockIndex:
    """Router-key index over every endpoint that publishes KV events."""

    def __init__(self, block_size: int = 64, *, max_keys: int = 4_000_000, speculative_ttl: float = 2.0) -> None:
        if block_size < 1:
            raise ValueError("block size must be >= 1")
        self.block_size = block_size
        self.max_keys = max_keys
        self.speculative_ttl = speculative_ttl
        self.stats = IndexStats()
        self._endpoints: dict[str, _Endpoint] = {}
        self._holders: dict[int, set[str]] = {}  # router key -> endpoints holding it (any tier or speculative)
        self._keys = 0  # router keys summed over endpoints (confirmed)

    # -- reading (scheduling) --

    def keys_for(self, token_ids: Sequence[int] | array, lora_name: str = "", cache_salt: str = "") -> list[int]:
        return router_keys(token_ids, self.block_size, chain_seed(lora_name, cache_salt))

    def match(self, keys: Sequence[int], now: float = 0.0) -> BlockMatch:
        """Leading blocks each endpoint holds: an endpoint counts from block 0 until the first block
        it lacks (a block held after a gap is useless to the engine, as to its own prefix cache).

        The set of endpoints still matching only shrinks, and consecutive blocks usually have the
        same holders, so each block costs one C-level subset test, whatever the pool size."""
        if now:
            self._expire(now)
        counts: dict[str, int] = {}
        holders = self._holders
        alive: set[str] = set()
        last: set[str] | None = None
        depth = 0
        for key in keys:
            servers = holders.get(key)
            if not servers:
                break
            if last is None:
                alive = set(servers)
            elif servers is not last and not alive <= servers:
                for gone in alive - servers:
                    counts[gone] = depth
                alive &= servers
                if not alive:
                    break
            last = servers
            depth += 1
        for address in alive:
            counts[address] = depth
        off_gpu: dict[str, dict[str, int]] = {}
        for address, n in counts.items():
            ep = self._endpoints.get(address)
            if ep is not None and ep.non_gpu:
                tiers: dict[str, int] = {}
                for key in keys[:n]:
                    block = ep.keys.get(key)
                    bits = block.tiers if block is not None else TIER_GPU
                    if not bits & TIER_GPU:
                        name = TIER_NAMES.get(bits & -bits, "CPU")  # the fastest tier it is on
                        tiers[name] = tiers.get(name, 0) + 1
                if tiers:
                    off_gpu[address] = tiers
        stats = self.stats
        stats.lookups += 1
        stats.lookup_blocks += len(keys)
        best = max(counts.values(), default=0)
        stats.lookup_hits += best
        if best and now:
            stats.last_hit = now
        return BlockMatch(counts, off_gpu)

    def has_events(self, address: str) -> bool:
        ep = self._endpoints.get(address)
        return ep is not None and ep.events.batches > 0

    def events(self, address: str) -> EndpointEvents | None:
        ep = self._endpoints.get(address)
        return ep.events if ep is not None else None

    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    @property
    def size(self) -> int:
        """Router keys held, summed over endpoints (kvcache_index_entries)."""
        return self._keys

    def endpoint_size(self, address: str) -> int:
        ep = self._endpoints.get(address)
        return len(ep.keys) if ep is not None else 0

    def engine_blocks(self, address: str) -> int:
        ep = self._endpoints.get(address)
        return sum(1 for b in ep.blocks.values() if not b.orphan) if ep is not None else 0

    def holds(self, address: str, key: int) -> bool:
        ep = self._endpoints.get(address)
        return ep is not None and (key in ep.keys or key in ep.speculative)

    # -- speculative entries (the producer's PreRequest) --

    def speculate(self, address: str, keys: Iterable[int], now: float) -> None:
        """The picked endpoint will cache these blocks: claim them until events confirm (a
        `BlockStored` turns them into ordinary entries) or `speculative_ttl` passes."""
        ep = self._endpoint(address)
        expiry = now + self.speculative_ttl
        added = 0
        for key in keys:
            if key in ep.keys:
                continue
            if key in ep.speculative:
                del ep.speculative[key]  # re-insert: keeps the dict ordered by expiry
            else:
                self._hold(key, address)
                added += 1
            ep.speculative[key] = expiry
        self.stats.speculative_added += added
        self._expire(now)

    def _expire(self, now: float) -> None:
        for ep in self._endpoints.values():
            if ep.speculative:
                for key in _pop_expired(ep.speculative, now):
                    if key not in ep.keys:
                        self._release(key, ep.address)
                        self.stats.speculative_expired += 1
            if ep.expected:
                _pop_expired(ep.expected, now)

    # -- eviction foresight: what the engine will have evicted by the time it admits a request --

    def dispatched(self, address: str, keys: Sequence[int], now: float) -> None:
        """A request with these router keys was sent to `address`. The leading blocks it holds
        are in use until it ends (last in the eviction order); the rest are expected: the engine
        will allocate them before it admits anything sent after, evicting its least recently
        used blocks once its cache is full. Expected keys are confirmed by `BlockStored` or
        forgotten after `speculative_ttl` (at the next lookup, which expires them first)."""
        ep = self._endpoints.get(address)
        if ep is None or not keys:
            return
        n = self._use(ep, keys)
        expected = ep.expected
        expiry = now + self.speculative_ttl
        for key in keys[n:]:
            if key in expected:
                del expected[key]  # re-insert: keeps the dict ordered by expiry
            expected[key] = expiry

    def released(self, address: str, keys: Sequence[int]) -> None:
        """A request with these router keys ended on `address`: the engine frees its blocks to
        the newest end of its eviction order."""
        ep = self._endpoints.get(address)
        if ep is not None and keys:
            self._use(ep, keys)

    def foresee(self, address: str, keys: Sequence[int], n: int, capacity_tokens: int, in_use_blocks: int) -> int:
        """Of the `n` leading `keys` `address` holds now, how many it will still hold when it
        admits a request sent now: the blocks already expected there are allocated first, from
        free blocks while there are any (`capacity_tokens` of KV less the blocks cached and the
        `in_use_blocks` of running requests), then by evicting the least recently used — and an
        engine loses a prefix from its end. Its events say so only after the step that evicts."""
        ep = self._endpoints.get(address)
        if ep is None or not n or not ep.expected or ep.non_gpu or ep.engine_block_size <= 0 or capacity_tokens <= 0:
            return n
        size = ep.engine_block_size
        blocks = ep.blocks
        # Blocks never used come first (less vLLM's null block); once the engine has evicted, every
        # free block is a freed one in eviction order (vLLM's one free queue), so allocations evict
        # from the start.
        free = 0 if ep.evicting else capacity_tokens // size - 1 - len(blocks) - in_use_blocks
        evicted = -(-len(ep.expected) * self.block_size // size) - max(free, 0)
        if evicted <= 0:
            return n
        if evicted >= len(blocks):
            return 0
        kept_from = next(islice(blocks.values(), evicted, None)).seq  # the oldest block not evicted
        owners = ep.keys
        lost = 0
        for key in keys[:n]:
            owner = owners.get(key)
            if owner is not None and owner.seq < kept_from:
                lost += 1
        self.stats.foreseen_blocks += lost
        return n - lost

    # -- writing (the event subscriber, or the simulator in-process) --

    def apply(self, address: str, events: Iterable[Any], now: float) -> None:
        """Apply one batch's events (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`,
        or any objects with their fields and class names) for `address`, in order."""
        ep = self._endpoint(address)
        info = ep.events
        info.batches += 1
        info.last_event = now
        if not info.first_event:
            info.first_event = now
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(ep, event)
            elif kind == "BlockRemoved":
                self._removed(ep, event.block_hashes, getattr(event, "medium", None),
                              getattr(event, "group_idx", None))
            elif kind == "AllBlocksCleared":
                info.cleared += 1
                self.reset(address, "cleared")
        if self._keys > self.max_keys:
            self._shrink(ep)

    def reset(self, address: str, reason: str) -> None:
        """Forget every block of `address` (AllBlocksCleared, a restart, an unrecoverable gap),
        keeping its event bookkeeping."""
        ep = self._endpoints.get(address)
        if ep is None:
            return
        for block in ep.blocks.values():
            self._drop_keys(ep, block.keys)
        ep.blocks.clear()
        ep.expected.clear()
        ep.evicting = False
        ep.non_gpu = 0
        ep.group = None
        self.stats.resets[reason] = self.stats.resets.get(reason, 0) + 1

    def remove_endpoint(self, address: str) -> None:
        ep = self._endpoints.pop(address, None)
        if ep is None:
            return
        for key in ep.keys:
            self._release(key, address)
        self._keys -= len(ep.keys)
        self.stats.evictions += len(ep.keys)
        for key in ep.speculative:
            if key not in ep.keys:
                self._release(key, address)

    # -- internals --

    def _use(self, ep: _Endpoint, keys: Sequence[int]) -> int:
        """Make the leading blocks of `keys` held on `ep` its most recently used, the last one
        first (the engine frees a request's blocks in reverse, so a prefix is evicted from its
        end); how many leading keys it holds."""
        owners = ep.keys
        n = 0
        for key in keys:
            if key not in owners:
                break
            n += 1
        if n and ep.evicting:  # the order matters once the cache is full: until then, no cost
            blocks = ep.blocks
            clock = ep.clock
            walk = MAX_RECENCY_WALK
            block: _EngineBlock | None = owners[keys[n - 1]]
            while block is not None and walk:  # _touch, inlined: a 100k-token prompt has thousands of blocks
                walk -= 1
                h = block.hash
                if blocks.get(h) is not block:
                    break
                clock += 1
                block.seq = clock
                del blocks[h]
                blocks[h] = block
                block = block.parent
            ep.clock = clock
        return n

    @staticmethod
    def _touch(ep: _Endpoint, block: _EngineBlock) -> None:
        """Make `block` the most recently used of its endpoint."""
        ep.clock += 1
        block.seq = ep.clock
        blocks = ep.blocks
        del blocks[block.hash]
        blocks[block.hash] = block

    def _endpoint(self, address: str) -> _Endpoint:
        ep = self._endpoints.get(address)
        if ep is None:
            ep = self._endpoints[address] = _Endpoint(address)
        return ep

    def _skip(self, reason: str, blocks: int) -> None:
        skipped = self.stats.skipped_blocks
        skipped[reason] = skipped.get(reason, 0) + blocks

    def _stored(self, ep: _Endpoint, event: Any) -> None:
        hashes: list[EngineHash] = event.block_hashes
        n = len(hashes)
        if not n:
            return
        if getattr(event, "kv_cache_spec_kind", None) not in PREFIX_KINDS:
            kind = event.kv_cache_spec_kind
            self._skip(kind if kind in OTHER_KINDS else "other_kind", n)
            return
        group = getattr(event, "group_idx", None) or 0
        if ep.group is None:
            ep.group = group
        elif group != ep.group:
            self._skip("other_group", n)
            return
        tier = TIERS.get((getattr(event, "medium", None) or "GPU").upper(), TIER_GPU)
        tokens: list[int] = event.token_ids or []
        block_size = event.block_size
        ep.events.stored_blocks += n
        if not tokens:  # a tier copy of blocks already known (e.g. CPU offload): no tokens needed
            for h in hashes:
                block = ep.blocks.get(h)
                if block is None:
                    self._skip("no_tokens", 1)
                elif not block.tiers & tier:
                    self._set_tiers(ep, block, block.tiers | tier)
            return
        if block_size <= 0 or len(tokens) != n * block_size:
            self._skip("malformed", n)
            return
        if tier == TIER_GPU:
            ep.engine_block_size = block_size  # (validated just above: the events' own blocks)
        lora = getattr(event, "lora_name", None) or ""
        extras = getattr(event, "extra_keys", None) or ()
        parent_hash = event.parent_block_hash
        previous: _EngineBlock | None = None
        if parent_hash is None:
            salt, extra = _split_extra(extras[0] if extras else None, lora)
            state, pending, orphan = chain_seed(lora, salt), b"", False
            if extra:
                state = _hash(_EXTRA_TAG + extra, seed=state)
        else:
            parent = ep.blocks.get(parent_hash)
            if parent is None or parent.orphan:
                state, pending, orphan = 0, b"", True
            else:
                state, pending, orphan = parent.state, parent.pending, False
                previous = parent
        try:
            data = token_bytes(tokens)
        except (OverflowError, TypeError):
            self._skip("malformed", n)
            return
        step = block_size * 4
        for i, h in enumerate(hashes):
            existing = ep.blocks.get(h)
            if existing is not None and not existing.orphan:
                if not existing.tiers & tier:
                    self._set_tiers(ep, existing, existing.tiers | tier)
                # Already known: move it to the newest end and continue the chain from it.
                self._touch(ep, existing)
                state, pending, orphan = existing.state, existing.pending, False
                previous = existing
                continue
            if orphan:
                ep.clock += 1
                ep.blocks[h] = _EngineBlock(h, None, (), 0, b"", tier, orphan=True, seq=ep.clock)
                self._skip("orphan", 1)
                continue
            if (i or parent_hash is not None) and i < len(extras):
                _, extra = _split_extra(extras[i], lora, first=False)
                if extra:
                    state = _hash(_EXTRA_TAG + extra, seed=state)
            keys, state, pending = chain_keys(state, data[i * step:(i + 1) * step], self.block_size, pending)
            ep.clock += 1
            block = _EngineBlock(h, previous, tuple(keys), state, pending, tier, seq=ep.clock)
            ep.blocks[h] = block
            self._add_keys(ep, block)
            previous = block

    def _removed(self, ep: _Endpoint, hashes: Sequence[EngineHash], medium: str | None, group: int | None) -> None:
        if ep.group is not None and (group or 0) != ep.group:
            return
        tier = TIERS.get((medium or "GPU").upper(), TIER_GPU)
        ep.events.removed_blocks += len(hashes)
        if tier == TIER_GPU and hashes:
            ep.evicting = True
        for h in hashes:
            block = ep.blocks.get(h)
            if block is None:
                self.stats.unknown_removes += 1
                continue
            remaining = block.tiers & ~tier
            if block.orphan:
                if not remaining:
                    del ep.blocks[h]
                else:
                    block.tiers = remaining
                continue
            if remaining:
                self._set_tiers(ep, block, remaining)
            else:
                del ep.blocks[h]
                self._drop_keys(ep, block.keys)

    def _add_keys(self, ep: _Endpoint, block: _EngineBlock) -> None:
        keys, bits, address = ep.keys, block.tiers, ep.address
        spec, expected = ep.speculative, ep.expected
        added = 0
        for key in block.keys:
            if key in keys:
                continue
            keys[key] = block
            added += 1
            if expected:
                expected.pop(key, None)
            if key in spec:
                del spec[key]  # confirmed by the engine
                self.stats.speculative_confirmed += 1
            else:
                self._hold(key, address)
        if not bits & TIER_GPU:
            ep.non_gpu += added
        self._keys += added
        self.stats.admissions += added

    def _drop_keys(self, ep: _Endpoint, block_keys: tuple[int, ...]) -> None:
        keys, address, spec = ep.keys, ep.address, ep.speculative
        dropped = 0
        for key in block_keys:
            owner = keys.pop(key, None)
            if owner is None:
                continue
            dropped += 1
            if not owner.tiers & TIER_GPU:
                ep.non_gpu -= 1
            if key not in spec:
                self._release(key, address)
        self._keys -= dropped
        self.stats.evictions += dropped

    def _set_tiers(self, ep: _Endpoint, block: _EngineBlock, bits: int) -> None:
        was_gpu = bool(block.tiers & TIER_GPU)
        block.tiers = bits
        if block.orphan:
            return
        now_gpu = bool(bits & TIER_GPU)
        if was_gpu == now_gpu:
            return
        owned = sum(1 for key in block.keys if ep.keys.get(key) is block)
        ep.non_gpu += owned if was_gpu else -owned

    def _hold(self, key: int, address: str) -> None:
        servers = self._holders.get(key)
        if servers is None:
            self._holders[key] = {address}
        else:
            servers.add(address)

    def _release(self, key: int, address: str) -> None:
        servers = self._holders.get(key)
        if servers is None:
            return
        servers.discard(address)
        if not servers:
            del self._holders[key]

    def _shrink(self, ep: _Endpoint) -> None:
        """Past the memory bound: drop the writer's oldest engine blocks (then anyone's)."""
        victims = [ep] + sorted((e for e in self._endpoints.values() if e is not ep),
                                key=lambda e: -len(e.keys))
        for victim in victims:
            while self._keys > self.max_keys and victim.blocks:
                h = next(iter(victim.blocks))
                block = victim.blocks.pop(h)
                before = self._keys
                self._drop_keys(victim, block.keys)
                self.stats.capacity_evictions += before - self._keys
            if self._keys <= self.max_keys:
                return


def _pop_expired(entries: dict[int, float], now: float) -> list[int]:
    """Remove and return the keys of an expiry-ordered dict whose time has passed."""
    gone = []
    for key, expiry in entries.items():
        if expiry > now:
            break
        gone.append(key)
    for key in gone:
        del entries[key]
    return gone


def _split_extra(extra: Any, lora: str, first: bool = True) -> tuple[str, bytes]:
    """(cache_salt, other extra keys as bytes) of one block's `extra_keys` entry.

    vLLM publishes, in order: the LoRA name (when set), multimodal (identifier, offset) pairs, the
    cache_salt string (first block only) and prompt-embedding digests, untagged."""
    if not extra:
        return "", b""
    items = list(extra) if isinstance(extra, (list, tuple)) else [extra]
    if lora and items and items[0] == lora:
        items = items[1:]
    salt = ""
    if first:
        for i, item in enumerate(items):
            if isinstance(item, str):
                salt = item
                del items[i]
                break
    return salt, _extra_encoder.encode(items) if items else b""
