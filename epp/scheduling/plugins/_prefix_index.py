"""The approximate prefix index: which endpoint has probably cached which prompt blocks.

Per endpoint an LRU sized like the endpoint's KV cache, plus one global map from block key to
the endpoints holding it, so a lookup costs one dict probe per block whatever the pool size.

The LRU accounts for what really fills a pod's cache, not only the blocks we hash: every
request's whole footprint (its prompt beyond the hashed prefix, its output) enters as one
anonymous entry weighing that many blocks, so a pod that served many long requests forgets old
prefixes as the engine does. Within a request, blocks are recorded tail first, so the shared head
of a prompt is the most recent and the last to go — the order in which vLLM frees a finished
request's blocks to its eviction queue. Evicting a key removes that endpoint from the key's
holder set.

A request's blocks are pinned from its pick (`add`) to its end (`touch`): vLLM never evicts the
blocks of a running request, only those in its free queue, so on a pod whose running requests
hold most of the cache a prefix goes soon after its last request ends, however recently it was
picked — an LRU by pick time believed such pods held several prefixes more than they did (on a
mixed pool under KV pressure 8% of picks went to a pod that had evicted the prefix; BENCHMARKS.md).
Eviction never takes a pinned key (it is in use, so recent), even when the pinned keys alone
outgrow the capacity: in deep overload a pod's queued requests name more prefixes than its cache
holds, and vLLM admits a queued request beside a running one of the same prefix, sharing its
blocks. An LRU that dropped those prefixes sent their next requests to a third pod, which spread
every document thinner still (on a mixed pool in deep overload, 22% of picks found no holder at
all; BENCHMARKS.md). A pinned key that eviction reaches is set aside, still held and counted,
until its last request ends, so no later add walks past it again. Ends that never come (a lost
record of another writer) are bounded by the request control's ledger: `unpin_all` clears a
server's pins when nothing is in flight there, or when the requests pinning it outnumber those
the ledger has in flight (the producer checks both at every end).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    __slots__ = ("_lrus", "_weights", "_holders", "_entries", "_anonymous", "_pins", "_pinning", "_parked")

    def __init__(self) -> None:
        self._lrus: dict[str, OrderedDict[int, int]] = {}  # server -> key -> weight (blocks)
        self._weights: dict[str, int] = {}  # server -> Σ weights
        self._holders: dict[int, set[str]] = {}
        self._entries = 0  # hashed keys held, over all servers
        self._anonymous = itertools.count(-1, -1)  # keys of footprint entries (never matched)
        self._pins: dict[str, dict[int, int]] = {}  # server -> key -> requests in flight using it
        self._pinning: dict[str, int] = {}  # server -> requests in flight there (adds less touches)
        # server -> key -> weight: pinned keys eviction reached, set aside (still held, still
        # counted) until their last request ends, so eviction never walks past them again.
        self._parked: dict[str, dict[int, int]] = {}

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks matched per endpoint: an endpoint's match ends at the first block it
        lacks, and the walk ends at the first block nobody holds.

        Consecutive blocks usually have the same holders (a prefix is cached as a whole), so the
        set of endpoints still matching is narrowed only when a block's holders differ, with one
        subset test in C: a popular prefix held by many endpoints costs no Python step per
        endpoint per block."""
        counts: dict[str, int] = {}
        holders = self._holders
        alive: set[str] | None = None
        last: set[str] | None = None
        depth = 0
        for key in hashes:
            servers = holders.get(key)
            if not servers:
                break
            if alive is None:
                alive = set(servers)
            elif servers is not last and not alive <= servers:
                for server in alive - servers:
                    counts[server] = depth
                alive &= servers
                if not alive:
                    break
            last = servers
            depth += 1
        if alive:
            for server in alive:
                counts[server] = depth
        return counts

    def add(self, hashes: Sequence[int], server: str, capacity: int, extra_blocks: int = 0) -> None:
        """Record that `server` now caches these blocks, after `extra_blocks` more of this
        request's own (its unhashed prompt tail and output), pinned until the request's `touch`;
        evict the oldest unpinned beyond `capacity` (pinned ones stay, beyond it if need be)."""
        lru = self._lrus.get(server)
        if lru is None:
            lru = self._lrus[server] = OrderedDict()
            self._weights[server] = 0
            self._pins[server] = {}
            self._parked[server] = {}
        self._pinning[server] = self._pinning.get(server, 0) + 1
        holders = self._holders
        pins = self._pins[server]
        parked = self._parked[server]
        weight = self._weights[server]
        if extra_blocks > 0:
            lru[next(self._anonymous)] = extra_blocks
            weight += extra_blocks
        added = 0
        for key in reversed(hashes):
            pins[key] = pins.get(key, 0) + 1
            if key in lru:
                lru.move_to_end(key)
            elif key not in parked:
                lru[key] = 1
                weight += 1
                added += 1
                servers = holders.get(key)
                if servers is None:
                    holders[key] = {server}
                else:
                    servers.add(server)
        self._entries += added
        capacity = max(capacity, 0)
        # A pinned key is in use, as recent as anything: set aside, not evicted.
        while weight > capacity and lru:
            old, w = lru.popitem(last=False)
            if old in pins:
                parked[old] = w
                continue
            weight -= w
            if old >= 0:
                self._forget(old, server)
                self._entries -= 1
        self._weights[server] = weight

    def touch(self, hashes: Sequence[int], server: str) -> None:
        """A request that held the blocks ended: they are unpinned, and recent."""
        lru = self._lrus.get(server)
        if lru is None:
            return
        pins = self._pins[server]
        parked = self._parked[server]
        self._pinning[server] = max(0, self._pinning.get(server, 0) - 1)
        for key in reversed(hashes):
            n = pins.get(key)
            if n is not None:
                if n > 1:
                    pins[key] = n - 1
                else:
                    del pins[key]
                    w = parked.pop(key, None)
                    if w is not None:  # back in the eviction order, as the most recent
                        lru[key] = w
                        continue
            if key in lru:
                lru.move_to_end(key)

    def unpin_all(self, server: str) -> None:
        """Nothing is in flight on `server`: whatever is still pinned there is stale."""
        pins = self._pins.get(server)
        if pins:
            pins.clear()
        parked = self._parked.get(server)
        if parked:
            self._lrus[server].update(parked)
            parked.clear()
        if server in self._pinning:
            self._pinning[server] = 0

    def pinned(self, server: str) -> int:
        """Keys pinned on `server` by requests in flight."""
        return len(self._pins.get(server, ()))

    def requests_holding(self, key: int, server: str) -> int:
        """Requests in flight on `server` whose prompts include block `key`."""
        pins = self._pins.get(server)
        return pins.get(key, 0) if pins is not None else 0

    def pinning(self, server: str) -> int:
        """Requests whose blocks are pinned on `server` (added and not yet touched)."""
        return self._pinning.get(server, 0)

    def forget(self, hashes: Sequence[int], server: str) -> None:
        """`server` no longer holds these blocks (its engine said it had evicted them)."""
        lru = self._lrus.get(server)
        if lru is None:
            return
        pins, parked = self._pins[server], self._parked[server]
        for key in hashes:
            pins.pop(key, None)  # (only a queued request's use: vLLM never evicts a running one's)
            if lru.pop(key, None) is not None or parked.pop(key, None) is not None:
                self._weights[server] -= 1
                self._entries -= 1
                self._forget(key, server)

    def remove_server(self, server: str) -> None:
        self._pins.pop(server, None)
        self._pinning.pop(server, None)
        parked = self._parked.pop(server, {})
        lru = self._lrus.pop(server, None)
        self._weights.pop(server, None)
        if lru is None:
            return
        for key in itertools.chain(lru, parked):
            if key >= 0:
                self._forget(key, server)
                self._entries -= 1

    def _forget(self, key: int, server: str) -> None:
        servers = self._holders.get(key)
        if servers is None:
            return
        servers.discard(server)
        if not servers:
            del self._holders[key]

    # -- observability --

    @property
    def entries(self) -> int:
        """Block keys held, summed over endpoints (the reference's index size)."""
        return self._entries

    @property
    def distinct_keys(self) -> int:
        return len(self._holders)

    def servers(self) -> list[str]:
        return list(self._lrus)

    def server_entries(self, server: str) -> int:
        lru = self._lrus.get(server)
        if lru is None:
            return 0
        return sum(1 for key in lru if key >= 0) + len(self._parked[server])

    @property
    def weights(self) -> dict[str, int]:
        """Blocks the LRU accounts for, per server (read-only: for loops over many servers)."""
        return self._weights

    def server_weight(self, server: str) -> int:
        """Blocks the LRU accounts for on `server` (hashed and anonymous)."""
        return self._weights.get(server, 0)
