"""The flow controller: a synchronous core with an injected clock (reference §5.3, plus gates).

Everything here is plain computation — no asyncio, no wall-clock reads — so the very same code
runs behind the ext_proc server (`flow_admission.FlowControlAdmission` wraps it with futures and
a dispatch loop) and inside the virtual-time simulator, which calls it directly:

    item = QueueItem(request, schedule)          # schedule(request, candidates) -> SchedulingResult
    endings = controller.enqueue(item)           # rejections (maybe this item), displaced items
    endings = controller.dispatch()              # dispatched items (with results), expiries
    controller.remove(item)                      # the client went away while queued
    controller.complete(item, usage)             # a dispatched request ended

**Dispatch.** A cycle dispatches one request at a time, each time starting again from the
highest band, until nothing more can go:
1. Strict priority: bands from the highest priority down.
2. Saturation: an endpoint whose saturation (the configured detector, per endpoint) is at or above
   the band's usage-limit ceiling is closed to that band. If *no* endpoint is open the cycle
   stops — lower bands never leapfrog a higher band held back by saturation (the reference's
   head-of-line rule; with the default ceiling of 1.0 for every band they would be held too).
3. The band's own dispatch gate (queue depth with the in-flight guard, KV use, inter-token
   latency, queued prompt tokens, our in-flight count) filters the open endpoints. A band blocked
   *only by its own thresholds* is skipped and lower bands may dispatch: a band that asks for
   stricter conditions (batch only into empty queues) must not hold up others. But a lower band
   never takes an endpoint the gate of a higher band with requests waiting refuses: batch sent
   into a pod interactive traffic is waiting to enter would fill it again (a priority
   inversion; with a queued-tokens gate on interactive and a queue-depth gate on batch, batch
   would keep every pod prefilling).
4. The band's fairness policy names the request; its subset hint, if any, narrows the endpoints.
   If none is left, the request waits and lower bands may go; the rest of its own band waits
   behind it for this cycle (fairness order is kept; subset hints are rare and per request).
   A band with batch-slot fairness or a newcomer reserve (`slots.py`) also drops the endpoints
   where the flow holds its share of the slots while other flows wait, or where it would take a
   reserved slot; a flow with nothing on an endpoint may go there through the reserve even when
   step 3 closed it. In every band, a request whose endpoints left are all full (our requests
   hold every slot) waits while another open endpoint has a free slot: sent, it would wait in
   that engine's queue for a generation to end, where here it takes the first slot to free
   anywhere. With every endpoint full it goes, so a `maxNumSeqs` set too low still shows the
   pods' real limit. A flow left with no endpoint is passed over: the next flows in the band's
   order (up to `MAX_PASSED_OVER`) are tried before lower bands.
5. `schedule(request, eligible)` picks among the eligible endpoints only ("late binding"). It is
   expected to count the pick against the endpoint at once (the director does), so the next
   dispatch of the same cycle sees it. The slot ledger counts it against the flow on that
   endpoint until `complete`; that count is also the flow's depth in vLLM's `priority`.

Work conservation: a request stays queued only when no endpoint may take it; callers run a cycle
whenever that can change (an enqueue, a completion, new metrics, an endpoint added).

**Cost.** Enqueue, removal, completion and expiry are O(log n) in the queued requests. A
dispatch is O(bands × endpoints) for the gates plus the scheduler's own cost; no queued request
is scanned.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Callable, Sequence

from epp.api.response import Usage
from epp.datastore import Endpoint
from epp.errors import Code, EppError
from epp.flowcontrol.band import Band, Flow
from epp.flowcontrol.config import FlowControlConfig
from epp.flowcontrol.gate import RecentDispatches
from epp.flowcontrol.item import Ending, ItemState, Outcome, QueueItem
from epp.flowcontrol.item_queue import HeapQueue
from epp.flowcontrol.saturation import SaturationDetector
from epp.flowcontrol.sink import FlowMetricsSink
from epp.flowcontrol.slots import SlotLedger
from epp.scheduling.framework import SchedulingResult
from epp.scheduling.prefix_match import held_tokens

log = logging.getLogger("epp.flowcontrol")

DEFAULT_FLOW = "default-flow"
MAX_PASSED_OVER = 32  # flows of one band a dispatch may pass over (slot fairness) before it gives up


def _deadline(item: QueueItem) -> float:
    return item.deadline


def _uncached_tokens(item: QueueItem, result: SchedulingResult) -> int:
    """The prompt tokens the chosen endpoint must prefill: the estimate less what the cycle's
    prefix producers believe it holds (what the queued-tokens gate counts)."""
    return max(0, item.request.prompt_tokens_estimate - held_tokens(result.cycle.data, result.primary.address))


class FlowController:
    def __init__(
        self,
        config: FlowControlConfig,
        detector: SaturationDetector,
        endpoints: Callable[[], Sequence[Endpoint]],
        clock: Callable[[], float],
        metrics: FlowMetricsSink | None = None,
    ) -> None:
        self.config = config
        self.detector = detector
        self.endpoints = endpoints
        self.clock = clock
        self.metrics = metrics
        self._bands: dict[int, Band] = {}
        self._order: list[Band] = []  # highest priority first
        self._keys: list[int] = []  # -priority of `_order`, for bisect
        self._ttl = HeapQueue(_deadline)  # queued items with a finite deadline
        self._recent = RecentDispatches()
        self.slots = SlotLedger(config.max_num_seqs)
        self.passed_over = 0  # dispatches that went to a later flow: the ones before held their share
        self.reserve_dispatches = 0  # requests sent into a newcomer reserve past a closed gate
        self._seq = itertools.count(1)
        self.queued_requests = 0
        self.queued_bytes = 0
        self.inflight = 0  # dispatched, not yet off its pod (`left_pod`, else `complete`)

    # -- introspection --

    def __len__(self) -> int:
        return self.queued_requests

    def band(self, priority: int) -> Band | None:
        return self._bands.get(priority)

    def bands(self) -> list[Band]:
        return list(self._order)

    def next_deadline(self) -> float | None:
        """The earliest TTL expiry among queued requests (when to run a cycle at the latest)."""
        item = self._ttl.peek()
        return item.deadline if item is not None else None

    def next_reopening(self, now: float | None = None) -> float:
        """The earliest time a band with queued requests sees an endpoint's queued-tokens gate
        reopen by the ledger's timeline alone (`inf`: none); callers run a cycle then."""
        now = self.clock() if now is None else now
        earliest = math.inf
        endpoints: Sequence[Endpoint] | None = None
        for band in self._order:
            gate = band.config.gate
            if band.count and gate.queued_tokens_threshold is not None:
                if endpoints is None:
                    endpoints = self.endpoints()
                earliest = min(earliest, gate.reopens_at(endpoints, self._recent, now))
        return earliest

    # -- enqueue --

    def enqueue(self, item: QueueItem, now: float | None = None) -> list[Ending]:
        """Queue a request, or reject it at once. Returns what ended: a rejection of `item`
        itself, and requests of lower sheddable bands evicted to make room for it."""
        if item.state is not ItemState.NEW:
            raise ValueError("a QueueItem can be enqueued once")
        now = self.clock() if now is None else now
        request = item.request
        band = self._band(request.priority)
        item.seq = next(self._seq)
        item.priority = band.priority
        item.flow_id = request.fairness_id or DEFAULT_FLOW
        item.size = max(0, request.body_size)
        item.enqueue_time = now
        ttl = self.config.ttl(band.config)
        item.deadline = now + ttl if ttl > 0 else math.inf
        slo = request.slo_ttft
        item.slo_deadline = now + slo if slo is not None else math.inf

        cfg = band.config
        if cfg.shed_when_saturated and self._pool_saturated(item, band):
            return [self._end(item, Outcome.REJECTED_OTHER, now, EppError(
                Code.RESOURCE_EXHAUSTED, "system saturated, sheddable request dropped", reason="saturated"))]
        if cfg.max_requests and band.count >= cfg.max_requests:
            return [self._reject_capacity(item, now, f"priority band {band.priority} is full "
                                                     f"(maxRequests {cfg.max_requests})", "band_capacity")]
        if band.bytes + item.size > cfg.max_bytes:
            return [self._reject_capacity(item, now, f"priority band {band.priority} is full "
                                                     f"(maxBytes {cfg.max_bytes})", "band_capacity")]
        endings: list[Ending] = []
        if self._over_global(item.size):
            evicted = self._make_room(item, band, now)
            if evicted is None:
                limit = (f"maxRequests {self.config.max_requests}" if self._over_global(item.size, bytes_=False)
                         else f"maxBytes {self.config.max_bytes}")
                return [self._reject_capacity(item, now, f"the queue is full (global {limit})", "capacity")]
            endings.extend(evicted)

        band.add(item)
        item.state = ItemState.QUEUED
        self.queued_requests += 1
        self.queued_bytes += item.size
        if item.deadline != math.inf:
            self._ttl.push(item)
        if self.metrics is not None:
            self.metrics.flow_queue_changed(item.flow_id, band.priority, request.model, request.target_model,
                                            1, item.size)
        return endings

    def _band(self, priority: int) -> Band:
        band = self._bands.get(priority)
        if band is None:
            cfg = self.config.band(priority)
            band = Band(cfg, cfg.fairness.new_band(cfg.ordering))
            self._bands[priority] = band
            at = bisect.bisect(self._keys, -priority)
            self._keys.insert(at, -priority)
            self._order.insert(at, band)
        return band

    def _pool_saturated(self, item: QueueItem, band: Band) -> bool:
        return self.detector.saturation(self._allowed(item, self.endpoints())) >= \
            self.config.usage_limit.ceiling(band.priority)

    def _over_global(self, size: int, *, requests: bool = True, bytes_: bool = True) -> bool:
        cfg = self.config
        return bool((requests and cfg.max_requests and self.queued_requests + 1 > cfg.max_requests)
                    or (bytes_ and cfg.max_bytes and self.queued_bytes + size > cfg.max_bytes))

    def _make_room(self, item: QueueItem, band: Band, now: float) -> list[Ending] | None:
        """Evict the newest requests of lower sheddable bands until `item` fits the global
        limits, lowest band first; None (and nothing evicted) if even all of them would not do."""
        if not self.config.evict_sheddable:
            return None
        victims = [b for b in reversed(self._order) if b.priority < 0 and b.priority < band.priority and b.count]
        cfg = self.config
        need_requests = self.queued_requests + 1 - cfg.max_requests if cfg.max_requests else 0
        need_bytes = self.queued_bytes + item.size - cfg.max_bytes if cfg.max_bytes else 0
        if sum(b.count for b in victims) < need_requests or sum(b.bytes for b in victims) < need_bytes:
            return None
        endings: list[Ending] = []
        for victim_band in victims:
            while victim_band.count and (need_requests > 0 or need_bytes > 0):
                victim = victim_band.arrivals.newest()
                assert victim is not None
                need_requests -= 1
                need_bytes -= victim.size
                self._unqueue(victim, victim_band, popped=False)
                endings.append(self._end(victim, Outcome.EVICTED_OTHER, now, EppError(
                    Code.RESOURCE_EXHAUSTED, "request evicted by flow control: the queue is full and a "
                    "higher-priority request took its place", reason="evicted")))
            if need_requests <= 0 and need_bytes <= 0:
                break
        return endings

    def _reject_capacity(self, item: QueueItem, now: float, why: str, reason: str) -> Ending:
        return self._end(item, Outcome.REJECTED_CAPACITY, now,
                         EppError(Code.RESOURCE_EXHAUSTED, f"request rejected by flow control: {why}", reason=reason))

    # -- leaving the queue without a dispatch --

    def remove(self, item: QueueItem, now: float | None = None) -> Ending | None:
        """The client went away while queued: drop the request and every count it held, now.
        Returns None if it was not queued (already dispatched or ended)."""
        if item.state is not ItemState.QUEUED:
            return None
        now = self.clock() if now is None else now
        self._unqueue(item, self._bands[item.priority], popped=False)
        return self._end(item, Outcome.EVICTED_CONTEXT_CANCELLED, now, EppError(
            Code.SERVICE_UNAVAILABLE, "client disconnected while queued", reason="cancelled"))

    def drain(self, now: float | None = None) -> list[Ending]:
        """End every queued request (shutdown)."""
        now = self.clock() if now is None else now
        endings = []
        for band in self._order:
            for item in band.arrivals:
                self._unqueue(item, band, popped=False)
                endings.append(self._end(item, Outcome.EVICTED_OTHER, now, EppError(
                    Code.SERVICE_UNAVAILABLE, "flow control is shutting down", reason="shutdown")))
        return endings

    def _unqueue(self, item: QueueItem, band: Band, *, popped: bool) -> Flow:
        flow = band.unlink(item, popped=popped)
        self.queued_requests -= 1
        self.queued_bytes -= item.size
        if item.deadline != math.inf:
            self._ttl.remove(item)
        if self.metrics is not None:
            request = item.request
            self.metrics.flow_queue_changed(item.flow_id, band.priority, request.model, request.target_model,
                                            -1, -item.size)
        if not popped:
            band.release_flow_if_idle(flow)
        return flow

    def _end(self, item: QueueItem, outcome: Outcome, now: float, error: EppError | None = None,
             result: SchedulingResult | None = None) -> Ending:
        if outcome is not Outcome.DISPATCHED:
            item.state = ItemState.DONE
        if self.metrics is not None:
            request = item.request
            self.metrics.flow_request_done(item.flow_id, item.priority, request.model, request.target_model,
                                           outcome.value, max(0.0, now - item.enqueue_time))
            if error is not None and outcome is not Outcome.DISPATCHED:
                self.metrics.flow_rejected(error.reason, item.priority)
        return Ending(item, outcome, result, error)

    # -- dispatch --

    def dispatch(self, now: float | None = None) -> list[Ending]:
        """Expire overdue requests, then dispatch everything that can go now."""
        now = self.clock() if now is None else now
        endings = self._expire(now)
        if not self.queued_requests:
            return endings
        endpoints = list(self.endpoints())
        self._recent.prune(endpoints)
        self.slots.prune(endpoints)
        while self.queued_requests:
            ending = self._dispatch_one(endpoints, now)
            if ending is None:
                break
            endings.append(ending)
        return endings

    def _expire(self, now: float) -> list[Ending]:
        endings: list[Ending] = []
        while True:
            item = self._ttl.peek()
            if item is None or item.deadline > now:
                return endings
            self._unqueue(item, self._bands[item.priority], popped=False)
            waited = now - item.enqueue_time
            endings.append(self._end(item, Outcome.EVICTED_TTL, now, EppError(
                Code.SERVICE_UNAVAILABLE, f"request timed out in queue after {waited:.3g}s", reason="ttl")))

    def _dispatch_one(self, endpoints: list[Endpoint], now: float) -> Ending | None:
        saturation: dict[Endpoint, float] = {}
        refused: set[Endpoint] = set()  # closed by the gate of a band with requests waiting
        for band in self._order:
            if not band.count:
                continue
            ceiling = self.config.usage_limit.ceiling(band.priority)
            open_ = []
            for ep in endpoints:
                value = saturation.get(ep)
                if value is None:
                    value = saturation[ep] = self.detector.saturation((ep,))
                if value < ceiling:
                    open_.append(ep)
            if not open_:
                return None  # saturated: lower bands wait too (head of line)
            if refused:
                open_ = [ep for ep in open_ if ep not in refused]
                if not open_:
                    continue
            eligible = band.config.gate.filter(open_, self._recent, now)
            if len(eligible) < len(open_):
                kept = set(eligible)
                refused.update(ep for ep in open_ if ep not in kept)
            if band.config.slotted:
                ending = self._dispatch_slotted(band, open_, eligible, now)
                if ending is not None:
                    return ending
                continue
            if not eligible:
                continue  # this band's own thresholds; lower bands may go where it is open
            head = band.queue.peek()
            assert head is not None
            candidates = self._not_full(head, self._allowed(head, eligible), open_)
            if not candidates:
                continue  # its subset hint excludes every open endpoint
            item = band.queue.pop()
            assert item is head, "a fairness policy popped another request than it peeked"
            return self._dispatch(item, band, candidates, now)
        return None

    def _dispatch_slotted(self, band: Band, open_: list[Endpoint], eligible: list[Endpoint],
                          now: float) -> Ending | None:
        """Step 4 with the slot ledger: the first flow in the band's order with an endpoint left.

        Fair share is a preference, never a reason to leave a slot empty: when every flow tried
        holds its share wherever it could go, the first of them goes anyway (work conservation).
        The reserve is a hard limit while another flow is about. The flows after the head are
        looked up only when the head cannot go."""
        cfg = band.config
        if not eligible and not cfg.newcomer_reserve:
            return None
        head = band.queue.peek()
        assert head is not None
        later: list[QueueItem] | None = None
        held_back = False
        for fair in (True, False) if cfg.slot_fairness else (False,):
            item: QueueItem | None = head
            passed = 0
            while item is not None:
                candidates, reserved, by_share = self._slot_candidates(item, band, open_, eligible, fair)
                held_back = held_back or by_share
                if candidates:
                    popped = band.queue.pop() if item is head else band.queue.pop_flow(item.flow_id)
                    assert popped is item, "a fairness policy popped another request than it showed"
                    if passed:
                        self.passed_over += 1
                        if log.isEnabledFor(logging.DEBUG):
                            log.debug("slot fairness: %s passed over %d flow(s) of band %d holding their share "
                                      "(first: %r)", item.request.request_id, passed, band.priority, head.flow_id)
                    return self._dispatch(item, band, candidates, now, reserved)
                if later is None:
                    later = band.queue.heads(MAX_PASSED_OVER)[1:] if len(band.flows) > 1 else []
                item = later[passed] if passed < len(later) else None
                passed += 1
            if not held_back:
                break  # nothing was held back by its share: the lenient pass would find nothing either
        return None

    def _slot_candidates(self, item: QueueItem, band: Band, open_: list[Endpoint], eligible: list[Endpoint],
                         fair: bool) -> tuple[list[Endpoint], bool, bool]:
        """The endpoints the item's flow may take under the band's slot rules; whether they are
        reserve endpoints (open, but closed by the band's gate); whether fair share removed any."""
        cfg = band.config
        ledger = self.slots
        key = (band.priority, item.flow_id)
        waiting_others = band.count > band.flows[item.flow_id].queued  # another flow of the band waits
        contended = fair and waiting_others
        active = len(band.flows)
        reserve = cfg.newcomer_reserve
        out: list[Endpoint] = []
        by_share = False
        for ep in self._not_full(item, self._allowed(item, eligible), open_):
            slots = ledger.slots(ep)
            entry = ledger.of(ep)
            held = ledger.held(ep, key)
            if not held:
                out.append(ep)  # a flow with nothing here may take any slot the gate allows
                continue
            # The last reserved slots are for flows with nothing here, while another flow is about
            # (waiting in the band, or running here); a flow alone uses every slot.
            if (reserve and entry.inflight >= slots - ledger.reserve(ep, reserve)
                    and (waiting_others or len(entry.by_flow) > 1)):
                continue
            if contended and held >= max(1, slots // active):
                by_share = True
                continue
            out.append(ep)
        if out or not reserve:
            return out, False, by_share
        gated = set(eligible)
        newcomer = []
        for ep in self._allowed(item, open_):
            if ep in gated or ledger.held(ep, key):
                continue
            entry = ledger.of(ep)
            if entry.reserved < ledger.reserve(ep, reserve) and entry.inflight < ledger.slots(ep):
                newcomer.append(ep)
        return newcomer, bool(newcomer), by_share

    def _not_full(self, item: QueueItem, candidates: list[Endpoint], open_: list[Endpoint]) -> list[Endpoint]:
        """The candidates, or none when all of them are full by our count while another open
        endpoint has a free slot (step 4). With a free one among them the scheduler chooses: it
        prices a slot wait, and a full pod whose requests end soon may still be the best."""
        has_free = self.slots.has_free_slot
        if any(has_free(ep) for ep in candidates):
            return candidates
        if any(has_free(ep) for ep in self._allowed(item, open_)):
            return []  # a slot frees elsewhere before one there: wait here for it
        return candidates

    @staticmethod
    def _allowed(item: QueueItem, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
        if item.allowed is None:
            return list(endpoints)
        return [ep for ep in endpoints if ep.address in item.allowed]

    def _dispatch(self, item: QueueItem, band: Band, candidates: list[Endpoint], now: float,
                  reserved: bool = False) -> Ending:
        flow = self._unqueue(item, band, popped=True)
        try:
            result = item.schedule(item.request, candidates)
        except Exception as exc:  # the request ends; the queue and its counters must not
            error = exc if isinstance(exc, EppError) else EppError(
                Code.INTERNAL, "internal flow control error: scheduling failed", reason="internal")
            if not isinstance(exc, EppError):
                log.exception("scheduling a dispatched request failed")
            band.queue.refund(item)  # it never ran: take back what fairness charged
            band.release_flow_if_idle(flow)
            item.state = ItemState.DONE
            # It left the queue but was never sent anywhere: a rejection, counted as one (its
            # reason in the rejections counter, RejectedOther in the queue-duration outcome).
            return self._end(item, Outcome.REJECTED_OTHER, now, error)
        depth = self.slots.add(result.primary, (band.priority, item.flow_id), reserved=reserved)
        item.reserved = reserved
        if reserved:
            self.reserve_dispatches += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("newcomer reserve: %s (flow %r) to %s past band %d's closed gate", item.request.request_id,
                          item.flow_id, result.primary.address, band.priority)
        if self.config.vllm_priority:
            stride = self.config.vllm_priority_stride
            item.engine_priority = -band.priority * stride + min(depth, stride - 1)
        flow.inflight += 1
        self.inflight += 1
        item.state = ItemState.DISPATCHED
        item.endpoint = result.primary
        item.dispatch_time = now
        self._recent.add(result.primary, _uncached_tokens(item, result))
        return self._end(item, Outcome.DISPATCHED, now, result=result)

    # -- completion --

    def left_pod(self, item: QueueItem) -> None:
        """A dispatched request's response is over but its usage comes later (Envoy's access
        log): its pod's slot frees now, so the next request goes there without waiting for the
        usage; `complete` brings the usage and ends the rest."""
        if item.state is not ItemState.DISPATCHED or item.left_pod:
            return
        item.left_pod = True
        self.inflight -= 1
        if item.endpoint is not None:
            self.slots.remove(item.endpoint, (item.priority, item.flow_id), reserved=item.reserved)

    def complete(self, item: QueueItem, usage: Usage | None = None) -> None:
        """A dispatched request ended (any way). `usage` corrects its fairness charge."""
        if item.state is not ItemState.DISPATCHED:
            return
        self.left_pod(item)
        item.state = ItemState.DONE
        band = self._bands[item.priority]
        band.queue.completed(item, usage)
        flow = band.flows.get(item.flow_id)
        if flow is not None:
            flow.inflight -= 1
            band.release_flow_if_idle(flow)
