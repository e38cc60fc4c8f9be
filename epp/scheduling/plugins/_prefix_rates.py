"""How often each prompt prefix is reused: requests per second that share it.

The predicted-latency producer uses it to value a new copy of a prefix (see
`PredictedLatencyProducer._credit_copies`). A prefix is keyed by the deepest block some pod holds
of it (the block where this request's match ends), so the requests of one shared document or
system prompt count together while each turn of a private conversation is a key of its own.

An exponential average over `window` seconds, bias-corrected while the key is younger than the
window (so a prefix asked for ten times in its first five seconds reads about 2/s, not 0.8/s), as
if from at least 3 s of history (`epp.datastore.load.coverage`, as the pods' load rates): a
document's second request a moment after its first is no evidence that it is asked for several
times a second, and in a warming pool that reading made copies of long documents nobody needed
(BENCHMARKS.md). The first request of a key is no evidence of reuse and is not counted. Bounded:
the least recently seen keys go first.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from epp.datastore.load import coverage


class PrefixRates:
    __slots__ = ("_entries", "_capacity", "_window")

    def __init__(self, window: float, capacity: int = 8192) -> None:
        self._entries: OrderedDict[int, list[float]] = OrderedDict()  # key -> [average, at, born]
        self._capacity = capacity
        self._window = window

    def __len__(self) -> int:
        return len(self._entries)

    def hit(self, key: int, now: float) -> float:
        """Count a request sharing `key` at `now`; its rate of reuse so far (0 for a new key)."""
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = [0.0, now, now]
            if len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
            return 0.0
        self._entries.move_to_end(key)
        average, at, born = entry
        window = self._window
        average = average * math.exp(-max(0.0, now - at) / window) + 1.0 / window
        entry[0], entry[1] = average, now
        return average / coverage(born, now, window) if now > born else 0.0  # a burst: no rate yet
