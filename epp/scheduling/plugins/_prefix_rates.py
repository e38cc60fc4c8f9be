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

Beside the rate, the excess of a prefix's sole holder over the best other pod, averaged over the
key's requests with the rate's weights: a holder busier on average, not for a moment, is what
earns a prefix a second copy (`_credit_copies`).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from epp.datastore.load import MIN_HISTORY, coverage


class PrefixRates:
    __slots__ = ("_entries", "_capacity", "_window")

    def __init__(self, window: float, capacity: int = 8192) -> None:
        # key -> [average, at, born, excess, weight]: the rate's average, when it was last decayed,
        # the first request; the excess samples' decayed sum and their weights'.
        self._entries: OrderedDict[int, list[float]] = OrderedDict()
        self._capacity = capacity
        self._window = window

    def __len__(self) -> int:
        return len(self._entries)

    def hit(self, key: int, now: float) -> float:
        """Count a request sharing `key` at `now`; its rate of reuse so far (0 for a new key)."""
        entry = self._entries.get(key)
        if entry is None:
            self._entries[key] = [0.0, now, now, 0.0, 0.0]
            if len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
            return 0.0
        self._entries.move_to_end(key)
        average, at, born, excess, weight = entry
        window = self._window
        decay = math.exp(-max(0.0, now - at) / window)
        average = average * decay + 1.0 / window
        entry[0], entry[1], entry[3], entry[4] = average, now, excess * decay, weight * decay
        return average / coverage(born, now, window) if now > born else 0.0  # a burst: no rate yet

    def young(self, key: int, now: float) -> bool:
        """The key's first `MIN_HISTORY` seconds of reuse (from its first `hit`): its holder is
        likely still computing it for the first time, and the queue there is its burst."""
        entry = self._entries.get(key)
        return entry is not None and now - entry[2] < MIN_HISTORY

    def excess(self, key: int) -> float:
        """The sole holder's excess over the best other pod, averaged over the key's recent requests
        (`record_excess`, weighted as the rate is); 0 before any."""
        entry = self._entries.get(key)
        return entry[3] / entry[4] if entry is not None and entry[4] > 0.0 else 0.0

    def record_excess(self, key: int, seconds: float, now: float) -> None:
        """One request's sample of how much more its prefix's holders cost than the best other pod
        would with the prefix (0 when a holder is the cheapest), at the time of its `hit`. Not in
        the key's first `MIN_HISTORY` seconds: its holder is then still computing the prefix for
        the first time, an excess that passes (with it, a warming pool made cold copies of long
        documents: TTFT p90 142 -> 318 ms on 8 H100 + 4 A100; BENCHMARKS.md)."""
        entry = self._entries.get(key)
        if entry is not None and not self.young(key, now):
            entry[3] += seconds
            entry[4] += 1.0
