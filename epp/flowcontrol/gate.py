"""The dispatch gate: whether an endpoint can take a request of a given band *now*.

Flow control's point is to keep the engines' own queues short and do the ordering here, where it
can still change (DESIGN "Ideas"): an engine queue is FIFO, so a request sent too early waits
behind everything sent before it. Each band sets how full an endpoint may be before it stops
taking that band's requests — e.g. interactive while the waiting queue is below 3, batch only
while it is empty — and may stop sending to a pod whose inter-token latency is too high.

Counting requests is blind to their size: three waiting 2,000-token prompts hold a newcomer for
a long prefill step, thirty waiting 50-token prompts for almost nothing, and a request-count
threshold low enough for the first throttles a flood of the second far below what the engine
would admit. `queuedTokensThreshold` bounds the prompt tokens still to be prefilled instead. They
come from the EPP's own ledger (`EndpointLoad`): every request sent there at its uncached size
(the prompt less the prefix the pick believed the pod holds), each prefill's progress on the
ledger's timeline, and a prefill over at the request's first streamed byte. Queued requests the
ledger cannot explain (scraped waiting beyond what it had pending at that scrape: another
replica's or client's) count at the mean size of what we send the endpoint, and a request well
past its predicted first token without it counts whole: the engine is slower than the timeline,
or holds it waiting for KV blocks (under overload), and the timeline alone would let more in. Being exact, the
gate reopens the moment the timeline says the backlog fell below the threshold
(`reopens_at`; the dispatch loop sleeps until then), not at the next scrape: the engines do not
run dry between scrapes however low the threshold.

Scraped metrics are up to one scrape interval old, so a burst could overfill a pod before the
next scrape shows it. The *in-flight guard* of the queue-depth gate counts the requests we
dispatched to an endpoint since the scrape its metrics come from on top of its scraped waiting
queue (a request just sent is assumed to wait until a scrape says otherwise). The count resets
when a newer scrape arrives, because that scrape already includes them. A dispatch that races a
scrape in flight can be dropped from the count once; `inflightRequestsThreshold` (exact, from our
own accounting) is the hard bound when that matters.
"""

from __future__ import annotations

import math
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
    inflight_guard: bool = True  # queue depth: count dispatches since the last scrape as waiting
    queued_tokens_threshold: int | None = None  # prompt tokens still to prefill (ledger) < this

    @property
    def active(self) -> bool:
        return (self.queue_depth_threshold is not None or self.kv_cache_util_threshold is not None
                or self.inter_token_latency_threshold is not None or self.inflight_requests_threshold is not None
                or self.queued_tokens_threshold is not None)

    def admits(self, endpoint: Endpoint, recent: RecentDispatches, now: float) -> bool:
        if not self._admits_but_tokens(endpoint, recent):
            return False
        return self.queued_tokens_threshold is None \
            or recent.queued_tokens(endpoint, now) < self.queued_tokens_threshold

    def _admits_but_tokens(self, endpoint: Endpoint, recent: RecentDispatches) -> bool:
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
        return self.inflight_requests_threshold is None \
            or endpoint.inflight_requests < self.inflight_requests_threshold

    def filter(self, endpoints: Sequence[Endpoint], recent: RecentDispatches, now: float) -> list[Endpoint]:
        if not self.active:
            return list(endpoints)
        return [ep for ep in endpoints if self.admits(ep, recent, now)]

    def reopens_at(self, endpoints: Sequence[Endpoint], recent: RecentDispatches, now: float) -> float:
        """The earliest time an endpoint closed by nothing but the queued-tokens threshold will
        take this band again, by the ledger's timeline (`inf`: none will by the clock alone;
        a scrape, a first byte or a completion runs a cycle anyway)."""
        threshold = self.queued_tokens_threshold
        if threshold is None:
            return math.inf
        earliest = math.inf
        for ep in endpoints:
            held = recent.unexplained_tokens(ep) + ep.load.late_prefill(now)
            if held >= threshold:
                continue  # until a first byte or a scrape
            at = ep.load.backlog_below_at(threshold - held, now)
            if now < at < earliest and self._admits_but_tokens(ep, recent):
                earliest = at
        return earliest


DEFAULT_PROMPT_TOKENS = 1000.0  # an endpoint's mean prompt size before we have sent it anything
_MEAN_WEIGHT = 0.1  # weight of the newest prompt in an endpoint's mean


class RecentDispatches:
    """Per endpoint, the requests we dispatched since the scrape its metrics come from, and the
    mean uncached prompt size of what we send it.

    O(1) per dispatch and per lookup: each entry remembers the `update_time` it counts from and
    restarts at zero when the endpoint's metrics are newer.
    """

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        # endpoint -> [update_time, requests since then, mean prompt tokens]
        self._counts: dict[Endpoint, list[float]] = {}

    def count(self, endpoint: Endpoint) -> int:
        entry = self._counts.get(endpoint)
        if entry is None or entry[0] != endpoint.metrics.update_time:
            return 0
        return int(entry[1])

    def unexplained_tokens(self, endpoint: Endpoint) -> float:
        """Prompt tokens of the scraped waiting requests the ledger had not sent (as of the scrape)."""
        extra = endpoint.metrics.waiting_queue_size - endpoint.load.pending_at_scrape
        if extra <= 0:
            return 0.0
        entry = self._counts.get(endpoint)
        return extra * (entry[2] if entry is not None else DEFAULT_PROMPT_TOKENS)

    def queued_tokens(self, endpoint: Endpoint, now: float) -> float:
        """Prompt tokens still to be prefilled on the endpoint: the ledger's (late ones whole), plus
        the unexplained."""
        load = endpoint.load
        return load.backlog_at(now) + load.late_prefill(now) + self.unexplained_tokens(endpoint)

    def add(self, endpoint: Endpoint, prompt_tokens: int = 0) -> None:
        updated = endpoint.metrics.update_time
        entry = self._counts.get(endpoint)
        if entry is None:
            self._counts[endpoint] = [updated, 1, float(prompt_tokens or DEFAULT_PROMPT_TOKENS)]
            return
        entry[2] += _MEAN_WEIGHT * (prompt_tokens - entry[2])
        if entry[0] != updated:
            entry[0], entry[1] = updated, 1
        else:
            entry[1] += 1

    def prune(self, live: Sequence[Endpoint]) -> None:
        """Forget endpoints that left the pool (called when the table outgrows the pool)."""
        if len(self._counts) > 2 * len(live) + 8:
            keep = set(live)
            self._counts = {ep: c for ep, c in self._counts.items() if ep in keep}
