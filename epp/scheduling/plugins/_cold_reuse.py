"""How often a cold prompt is asked for again: the share of recent prompts no pod held that a later
request shared.

`latency-scorer`'s TTFT bound keeps a long cold prompt off a slow idle pod when a fast busy one
would answer it much sooner. That is right for a prompt nobody asks for again (API calls,
batch jobs: the loss would land whole on one request). It is wrong for the first request of a
document or a conversation that will be reused: where it lands, by cache affinity, its later
requests follow, and bounded onto the few fast pods, a pool's documents pile up there
(BENCHMARKS.md: 8 H100 + 8 A100, B2B shared context p99 587 -> 744 ms). Which of the two a pool
serves shows in its recent cold prompts, so the bound asks this. The predicted-latency producer's
eviction charge asks the other thing it knows: whether this request brings a prompt back.

A cold prompt (no pod holds a quarter of its blocks; at least `_MIN_BLOCKS` long: a short one's
place hardly matters, and its first blocks are often a chat template's header every request
shares) is remembered by one block key inside it:
the block at the largest power of two not past its middle, so a later request sharing at least
half of it is found with a handful of lookups (block keys are chained: equal keys at one
position mean an equal prefix up to there). It counts as reused when a later request carries that
key within `window` seconds, as not reused when the window passes first. The share is an
exponential average over the last ~1/`alpha` resolved prompts; it starts at 1 (reused), so the
bound stays out until the pool has shown that its cold prompts are not asked for again. Bounded:
the oldest remembered prompts go first (counted as not reused).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


_MIN_BLOCKS = 4


class ColdReuse:
    __slots__ = ("_pending", "_window", "_capacity", "_alpha", "share", "resolved")

    def __init__(self, window: float = 10.0, capacity: int = 4096, alpha: float = 0.02) -> None:
        self._pending: OrderedDict[int, float] = OrderedDict()  # key -> when its cold prompt came
        self._window = window
        self._capacity = capacity
        self._alpha = alpha
        self.share = 1.0  # of resolved cold prompts, those asked for again
        self.resolved = 0

    def __len__(self) -> int:
        return len(self._pending)

    def observe(self, hashes: Sequence[int], most_matched: int, now: float) -> bool:
        """One request: its block keys and the most of them any pod holds. True when it carries a
        remembered cold prompt's key (a prompt asked for again)."""
        pending = self._pending
        while pending:  # the window passed: not asked for again
            key, at = next(iter(pending.items()))
            if now - at <= self._window:
                break
            del pending[key]
            self._resolve(False)
        total = len(hashes)
        returned = False
        position = 2
        while position < total:  # a later request sharing a remembered prompt's key
            if pending.pop(hashes[position], None) is not None:
                self._resolve(True)
                returned = True
            position *= 2
        if total >= _MIN_BLOCKS and most_matched * 4 < total:
            key = hashes[_key_position(total)]
            pending[key] = now
            pending.move_to_end(key)
            if len(pending) > self._capacity:
                pending.popitem(last=False)
                self._resolve(False)
        return returned

    def _resolve(self, reused: bool) -> None:
        self.resolved += 1
        self.share += self._alpha * ((1.0 if reused else 0.0) - self.share)


def _key_position(total: int) -> int:
    """The largest power of two not past the middle of `total` (at least 4) blocks."""
    return 1 << ((total // 2).bit_length() - 1)
