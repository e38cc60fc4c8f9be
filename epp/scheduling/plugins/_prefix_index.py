"""The approximate prefix index: which endpoint has probably cached which prompt blocks.

Per endpoint an LRU of block keys (sized like the endpoint's KV cache), plus one global map from
key to the endpoints holding it, so a lookup costs one dict probe per block whatever the pool
size. Evicting a key from an endpoint's LRU removes that endpoint from the key's holder set, the
way the model server's own cache forgets the oldest blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixIndex:
    __slots__ = ("_lrus", "_holders", "_entries")

    def __init__(self) -> None:
        self._lrus: dict[str, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[str]] = {}
        self._entries = 0

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Blocks matched per endpoint, walking the keys in order until one nobody holds.

        Consecutive blocks usually have the same holders (a prefix is cached as a whole), so
        runs of equal holder sets are counted once per run: a popular prefix held by many
        endpoints costs one set comparison (in C) per block, not a Python step per endpoint."""
        counts: dict[str, int] = {}
        holders = self._holders
        run_set: set[str] | None = None
        run = 0
        for key in hashes:
            servers = holders.get(key)
            if not servers:
                break
            if servers is run_set or servers == run_set:
                run += 1
                continue
            if run_set is not None:
                for server in run_set:
                    counts[server] = counts.get(server, 0) + run
            run_set, run = servers, 1
        if run_set is not None:
            for server in run_set:
                counts[server] = counts.get(server, 0) + run
        return counts

    def add(self, hashes: Sequence[int], server: str, capacity: int) -> None:
        """Record that `server` now caches these blocks; evict its oldest beyond `capacity`."""
        lru = self._lrus.get(server)
        if lru is None:
            lru = self._lrus[server] = OrderedDict()
        holders = self._holders
        before = len(lru)
        for key in hashes:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                servers = holders.get(key)
                if servers is None:
                    holders[key] = {server}
                else:
                    servers.add(server)
        while len(lru) > max(capacity, 0):
            old, _ = lru.popitem(last=False)
            self._forget(old, server)
        self._entries += len(lru) - before

    def remove_server(self, server: str) -> None:
        lru = self._lrus.pop(server, None)
        if lru is None:
            return
        for key in lru:
            self._forget(key, server)
        self._entries -= len(lru)

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
        return len(lru) if lru is not None else 0
