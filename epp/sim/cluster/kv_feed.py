"""KV-cache events in the virtual-time cluster: what a router subscribed to every pod's ZMQ
stream would receive, delivered in-process on the virtual clock.

A pod publishes one batch per engine step that produced events — at the step's end, as vLLM's
scheduler does in `update_from_output` — with its own sequence number from 0 and
`data_parallel_rank` 0, exactly the `(seq, EventBatch)` of the real publisher's frames (`ts` is
virtual time). Each subscriber gets `(pod index, seq, batch)` `delay` seconds later (transport,
decoding and the subscriber's queue), in per-pod order. The batch object is shared by all
subscribers: treat it as read-only. Batches still in flight when the run ends are not delivered.

Nobody subscribed, no cost: pods record events only once a subscriber exists (see
`Cluster.kv_events`); subscribe in `Router.attach`, before the first request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from epp.sim.kv_events import EventBatch, KVEvent

log = logging.getLogger("epp.sim.cluster")

DEFAULT_DELAY = 0.005  # seconds from a step's end to the subscriber: ZMQ on a cluster network + decode
KVEventSubscriber = Callable[[int, int, EventBatch], None]


class KVEventFeed:
    """Per-pod sequence numbers and delayed fan-out of event batches to subscribers."""

    __slots__ = ("loop", "delay", "_subscribers", "_seq", "delivered")

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float = DEFAULT_DELAY) -> None:
        if delay < 0:
            raise ValueError("KV-event delay must be >= 0")
        self.loop = loop
        self.delay = delay
        self._subscribers: list[KVEventSubscriber] = []
        self._seq: dict[int, int] = {}
        self.delivered = 0  # batches delivered (each counted once, whatever the subscriber count)

    @property
    def active(self) -> bool:
        return bool(self._subscribers)

    def subscribe(self, callback: KVEventSubscriber) -> None:
        """`callback(pod, seq, batch)` for every batch of every pod from now on."""
        self._subscribers.append(callback)

    def next_seq(self, pod: int) -> int:
        return self._seq.get(pod, 0)

    def publish(self, pod: int, events: list[KVEvent]) -> None:
        """One step's events of `pod` (non-empty), delivered at now + delay."""
        seq = self._seq.get(pod, 0)
        self._seq[pod] = seq + 1
        now = self.loop.time()
        batch = EventBatch(ts=now, events=events, data_parallel_rank=0)
        if self.delay:
            self.loop.call_at(now + self.delay, self._deliver, pod, seq, batch)
        else:  # before anything the step's end sets off (a request's end, the run's end)
            self.loop.call_soon(self._deliver, pod, seq, batch)

    def _deliver(self, pod: int, seq: int, batch: EventBatch) -> None:
        self.delivered += 1
        for callback in self._subscribers:
            try:
                callback(pod, seq, batch)
            except Exception:  # a subscriber's bug must not stop the others or the run
                log.exception("KV-event subscriber failed on pod %d seq %d", pod, seq)
