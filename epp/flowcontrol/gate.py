"""The dispatch gate: whether an endpoint can take a request of a given band *now*.

Flow control's point is to keep the engines' own queues short and do the ordering here, where it
can still change (DESIGN "Ideas"): an engine queue is FIFO, so a request sent too early waits
behind everything sent before it. Each band sets how full an endpoint may be before it stops
taking that band's requests — e.g. interactive while the waiting queue is below 3, batch only
while it is empty — and may stop sending to a pod whose inter-token latency is too high.

Counting requests is blind to their size: three waiting 2,000-token prompts hold a newcomer for
a long prefill step, thirty waiting 50-token prompts for almost nothing, and a request-count
threshold low enough for the first throttles a flood of the second far below what the engine
would admit. `queuedTokensThreshold` bounds the prompt tokens waiting to be prefilled instead:
the scraped waiting requests, each counted at the mean size of what we sent the endpoint, plus
what we sent since that scrape. A request counts its prompt (4 characters a token) less the
prefix the scheduling cycle's prefix producer believes the chosen endpoint holds, so a chat turn
over a cached history counts its new tokens only.

Scraped metrics are up to one scrape interval old, so a burst could overfill a pod before the
next scrape shows it. The *in-flight guard* counts the requests we dispatched to an endpoint
since the scrape its metrics come from on top of its scraped waiting queue (a request just sent
is assumed to wait until a scrape says otherwise). The count resets when a newer scrape arrives,
because that scrape already includes them. A dispatch that races a scrape in flight can be
dropped from the count once; `inflightRequestsThreshold` (exact, from our own accounting) is the
hard bound when that matters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.datastore import Endpoint


@dataclass(slots=True, frozen=True)
class DispatchGate:
    """Per-band thresholds; an endpoint takes the band's requests only while under all set ones.

    Every threshold means "below": `queue_depth_threshold=3` admits while waiting < 3, so `1`
    admits only into an empty queue. None turns a threshold off.
    """

    queue_depth_threshold: int | None = None  # scraped waiting (+ guard) < this
    kv_cache_util_threshold: float | None = None  # scraped KV-cache use < this
    inter_token_latency_threshold: float | None = None  # seconds; recent mean ITL < this (0 = unknown passes)
    inflight_requests_threshold: int | None = None  # our exact in-flight count < this
    inflight_guard: bool = True  # count dispatches since the last scrape as waiting
    queued_tokens_threshold: int | None = None  # estimated prompt tokens waiting (+ guard) < this

    @property
    def active(self) -> bool:
        return (self.queue_depth_threshold is not None or self.kv_cache_util_threshold is not None
                or self.inter_token_latency_threshold is not None or self.inflight_requests_threshold is not None
                or self.queued_tokens_threshold is not None)

    def admits(self, endpoint: Endpoint, recent: RecentDispatches) -> bool:
        m = endpoint.metrics
        if self.queue_depth_threshold is not None:
            waiting = m.waiting_queue_size + (recent.count(endpoint) if self.inflight_guard else 0)
            if waiting >= self.queue_depth_threshold:
                return False
        if self.kv_cache_util_threshold is not None and m.kv_cache_usage >= self.kv_cache_util_threshold:
            return False
        if self.inter_token_latency_threshold is not None \
                and m.inter_token_latency >= self.inter_token_latency_threshold:
            return False
        if self.inflight_requests_threshold is not None \
                and endpoint.inflight_requests >= self.inflight_requests_threshold:
            return False
        if self.queued_tokens_threshold is not None \
                and recent.queued_tokens(endpoint, self.inflight_guard) >= self.queued_tokens_threshold:
            return False
        return True

    def filter(self, endpoints: Sequence[Endpoint], recent: RecentDispatches) -> list[Endpoint]:
        if not self.active:
            return list(endpoints)
        return [ep for ep in endpoints if self.admits(ep, recent)]


DEFAULT_PROMPT_TOKENS = 1000.0  # an endpoint's mean prompt size before we have sent it anything
_MEAN_WEIGHT = 0.1  # weight of the newest prompt in an endpoint's mean


class RecentDispatches:
    """Per endpoint, the requests (and prompt tokens) we dispatched since the scrape its metrics
    come from, and the mean prompt size of what we send it.

    O(1) per dispatch and per lookup: each entry remembers the `update_time` it counts from and
    restarts at zero when the endpoint's metrics are newer.
    """

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        # endpoint -> [update_time, requests, prompt tokens since then, mean prompt tokens]
        self._counts: dict[Endpoint, list[float]] = {}

    def count(self, endpoint: Endpoint) -> int:
        entry = self._counts.get(endpoint)
        if entry is None or entry[0] != endpoint.metrics.update_time:
            return 0
        return int(entry[1])

    def queued_tokens(self, endpoint: Endpoint, guard: bool = True) -> float:
        """Estimated prompt tokens waiting in the endpoint's engine queue."""
        entry = self._counts.get(endpoint)
        mean = entry[3] if entry is not None else DEFAULT_PROMPT_TOKENS
        queued = endpoint.metrics.waiting_queue_size * mean
        if guard and entry is not None and entry[0] == endpoint.metrics.update_time:
            queued += entry[2]
        return queued

    def add(self, endpoint: Endpoint, prompt_tokens: int = 0) -> None:
        updated = endpoint.metrics.update_time
        entry = self._counts.get(endpoint)
        if entry is None:
            self._counts[endpoint] = [updated, 1, prompt_tokens, float(prompt_tokens or DEFAULT_PROMPT_TOKENS)]
            return
        entry[3] += _MEAN_WEIGHT * (prompt_tokens - entry[3])
        if entry[0] != updated:
            entry[0], entry[1], entry[2] = updated, 1, prompt_tokens
        else:
            entry[1] += 1
            entry[2] += prompt_tokens

    def prune(self, live: Sequence[Endpoint]) -> None:
        """Forget endpoints that left the pool (called when the table outgrows the pool)."""
        if len(self._counts) > 2 * len(live) + 8:
            keep = set(live)
            self._counts = {ep: c for ep, c in self._counts.items() if ep in keep}
