"""The ledger of outstanding work per endpoint: what the EPP itself sent a pod and is not done.

Scraped metrics say what a pod was doing up to one scrape interval ago, and count *requests*.
The ledger is exact for the EPP's own traffic and counts *work*: per in-flight request its
uncached prompt tokens (what the pod must still prefill), whether its prefill is over, the
context its decode steps read and the KV it will hold. Request control writes it at every event
of a request's life (pick, first byte, end); the predicted-latency scorer reads it.

Prefill is a FIFO timeline: a pod works through the prefill of the requests sent to it in the
order they arrived (vLLM's FCFS admission with chunked prefill), and each request's prefill is
expected to end when its predicted time to first token says. A streamed first byte is the truth
and resynchronises the timeline: that request and every one sent before it are past prefill, and
the ones after it move by as much as it was late (or early). A request whose response is not
streamed leaves the prefill queue when its expected time passes; a streamed one whose first byte
is long overdue leaves too, so a lost event cannot wedge the queue. Between events the request
at the head counts as partly done, in proportion to the time it has had.

Each request is expected to end its expected output's count of decode steps after its first
token; the ledger counts the pod's steps (time over the step time its batch was last predicted
to take), so it knows when the pod's batch slots free if outputs run to their length — for a
batch that started together, many steps later than a steady pace of endings would say.

Everything kept per endpoint is a sum over its outstanding requests (plus time integrals), so
several writers' ledgers of one endpoint add up (the expected ends stay each writer's own). The
recent rates (picks, pod-seconds of work and of prefill sent per second) are exponential averages
that start at zero; they are read divided by the share of their window that has history
(`coverage`), or a pool warming up looks idle while its prefill queues fill (on long documents
that made every pod look free for another cold copy).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

_OVERDUE_FACTOR = 3.0  # a streamed first byte this many predicted TTFTs late is taken as lost
_OVERDUE_MIN = 2.0  # seconds
_LATE_FACTOR = 0.5  # a first byte this share of its prefill's time late makes its request "late"
_LATE_MIN = 0.02  # seconds
_PACE_ALPHA = 0.1  # weight of one response in the step count's pace (a geometric average)
_PACE_MAX = 5.0  # the pace stays within [1/5, 5]
_STALLED_MAX = 256  # stalled requests remembered per endpoint (the oldest matter)
_RECENT_MAX = 256  # exits remembered per endpoint for the next scrape (`mark_scrape`)
RATE_WINDOW = 10.0  # seconds: the memory of the pick-rate average
MIN_HISTORY = 3.0  # seconds: a rate is never read as if from less history than this
_BUSY_ALPHA = 0.1  # weight of the newest interval in `EndpointLoad.busy_interval`
_TAIL_ALPHA = 0.02  # weight of the newest first token in `EndpointLoad.tail_share`


def _current(entry: tuple[float, int, Outstanding]) -> bool:
    """An `EndpointLoad.ends` entry of a request not ended, at its latest expected end."""
    item = entry[2]
    return not item.released and entry[0] == item.end_step


def coverage(since: float, now: float, window: float = RATE_WINDOW) -> float:
    """The share of an exponential average's `window` that has history: an average that started
    at zero at `since` (-1: not started) reads low by this factor until a window has passed.
    At least `MIN_HISTORY` seconds are assumed, so the first few events do not read as a burst."""
    if since < 0.0:
        return 1.0
    return -math.expm1(-max(MIN_HISTORY, now - since) / window)


ENDING_UNIT = 1 << 24  # fixed point of `EndpointLoad.decode_ending` (integers sum exactly, back to zero)


def ending_weight(output_tokens: int) -> int:
    """One decoding request's part of `EndpointLoad.decode_ending`: 1 / its expected output."""
    return ENDING_UNIT // max(2, output_tokens)


@dataclass(slots=True, eq=False)
class Outstanding:
    """One request in an endpoint's ledger, from its pick to its end."""

    prompt_tokens: int  # estimated prompt length in tokens
    cached_tokens: int  # of those, predicted to be in this pod's prefix cache at the pick
    output_tokens: int  # expected generated tokens (max_tokens, or the learned mean)
    dispatched: float  # clock time of the pick
    predicted_ttft: float = 0.0  # seconds, from the pick, with the whole cache credit (the timeline's)
    reported_ttft: float = 0.0  # the prediction reported and compared with the observed TTFT (0: predicted_ttft)
    raw_ttft: float = 0.0  # `reported_ttft` before the pod's calibration (0: none to learn)
    streamed: bool = True  # its first byte will be its first token
    model: str = ""  # the target model (a LoRA adapter's name keeps that adapter busy on the pod)
    recompute_tokens: int = 0  # of `cached_tokens`, those the pod is expected to compute again
    # The service model's features at the pick, for learning from the observed TTFT.
    step_feature: float = 0.0
    prefill_feature: float = 0.0
    started: float = 0.0  # expected start of its prefill (the one ahead's end), on the timeline
    expected_done: float = 0.0  # expected end of its prefill
    end_step: float = 0.0  # `EndpointLoad.steps` when it is expected to end and free its batch slot
    first_step: float = -1.0  # `EndpointLoad.steps` at its first byte (-1: not seen)
    first_token: float = -1.0  # clock time of the first streamed byte (-1: not seen)
    prefilled: bool = False  # past prefill (observed, or expected)
    released: bool = False
    stalled: bool = False  # taken as past prefill for being overdue, its first byte still not seen
    # Endpoint integrals at the first byte, for the mean batch its decode saw.
    mark_time: float = 0.0
    mark_decode_integral: float = 0.0
    mark_context_integral: float = 0.0
    mark_prefill_total: int = 0

    @property
    def prefill_tokens(self) -> int:
        """Uncached prompt tokens: the prefill this request costs its pod."""
        return max(1, self.prompt_tokens - self.cached_tokens)

    @property
    def attention_pairs(self) -> float:
        """Query-key pairs of its prefill (chunks after a cached prefix attend to it)."""
        u = self.prefill_tokens
        return u * (self.cached_tokens + u * 0.5)

    @property
    def footprint_tokens(self) -> int:
        """KV it holds at its end: prompt plus output."""
        return self.prompt_tokens + self.output_tokens

    @property
    def mean_context(self) -> int:
        """KV a decode step of it reads, averaged over its decode (prompt + half the output)."""
        return self.prompt_tokens + self.output_tokens // 2

    def remaining_prefill(self, now: float) -> float:
        """Prefill tokens still to do at `now`, by the timeline."""
        if now >= self.expected_done:
            return 0.0
        u = self.prefill_tokens
        if now <= self.started:
            return float(u)
        return u * (self.expected_done - now) / (self.expected_done - self.started)


@dataclass(slots=True)
class EndpointLoad:
    """Outstanding work on one endpoint, as the EPP's own picks account it."""

    pending: deque[Outstanding] = field(default_factory=deque)  # prefill not over, in pick order
    # Streamed requests moved out of `pending` for being overdue whose first byte has not come
    # (oldest first; entries that since saw it or ended are dropped lazily): the evidence that
    # the pod is far behind what the timeline says, e.g. stuck waiting for KV blocks.
    stalled: deque[Outstanding] = field(default_factory=deque)
    settled_at: float = 0.0  # clock time the integrals refer to
    prefill_backlog: int = 0  # Σ prefill_tokens of `pending`
    prefill_pairs: float = 0.0  # Σ attention_pairs of `pending`
    recompute_backlog: int = 0  # Σ recompute_tokens of `pending` (credited, but expected to be computed)
    peer_pending: int = 0  # requests other writers (workers, replicas) sent here still in their queue
    decoding: int = 0  # requests past prefill, not ended
    context_tokens: int = 0  # Σ mean_context of the decoding ones (KV their steps read)
    decode_output: int = 0  # Σ output_tokens of the decoding ones (how soon they end)
    # Σ ENDING_UNIT // output_tokens of the decoding ones: how many end per step (× ENDING_UNIT / 2,
    # each about half way through), dominated by the short ones as the real pace is.
    decode_ending: int = 0
    footprint_tokens: int = 0  # Σ footprint of every outstanding request
    requests: int = 0
    # The pod's decode steps so far, as this writer estimates them: time over the step time the
    # writer last predicted for its batch (`step_seconds`, set at each write; 0: unknown). A
    # request ends its expected output's count of steps after its first token, whatever the steps
    # then take (a batch that grows slows down every request in it alike).
    steps: float = 0.0
    step_seconds: float = 0.0
    # Real steps per counted one, learned from the streamed responses that ended here (their
    # tokens against the steps counted since their first byte): the step time predicted for a
    # batch leaves out what the steps also carry (prefill chunks) and what the fit has not seen.
    step_pace: float = 1.0
    # This writer's requests by the step they are expected to end at (a heap of (end_step, id,
    # item); ended or re-keyed entries are dropped lazily): when the pod's batch slots free if
    # outputs run to their expected length.
    ends: list[tuple[float, int, Outstanding]] = field(default_factory=list)
    models: dict[str, int] = field(default_factory=dict)  # target model -> outstanding requests
    # The ledger as of the endpoint's last scrape, to tell the scraped queue what it cannot
    # explain (traffic the EPP did not send) from what it can.
    requests_at_scrape: int = 0
    pending_at_scrape: int = 0
    # When this writer's requests here ended, and left the prefill queue, since the last page was
    # asked for (clock times, oldest first): a page asked for before an exit and read after it
    # still shows that request (`mark_scrape`).
    ended_at: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT_MAX))
    unqueued_at: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT_MAX))
    footprint_at_scrape: int = 0
    prefill_total_at_scrape: int = 0  # (the prefill sent since is in the footprint the scrape missed)
    # Picks per second sent to this endpoint, and the pod-seconds of work they bring per second
    # (its utilisation), both exponential averages over RATE_WINDOW as of `rates_at`.
    pick_rate: float = 0.0
    work_rate: float = 0.0
    prefill_rate: float = 0.0  # the prefill part of that work (what holds up the prefills behind it)
    # KV token-seconds per second sent here: by Little's law the KV tokens its requests will hold
    # on average if it keeps being sent what it was lately (`kv_forecast_at`).
    kv_rate: float = 0.0
    rates_at: float = 0.0
    # When the averages began (the first pick here, or the first rates another writer reported):
    # before a window has passed they read low, and are divided by their `coverage` when read.
    rates_since: float = -1.0
    # The pod's measured pace of first tokens while it has a backlog: an exponential average of
    # the time between consecutive first bytes of this writer's requests, counting only the
    # intervals whose request was sent before the previous first byte (it was waiting, so the
    # interval is the pod's work, not a pause in traffic). A pod whose KV is full admits its
    # queue at the pace its running requests end, not at its prefill rate; this measures that
    # pace (`drain_seconds`).
    busy_interval: float = 0.0
    # The share of this writer's recent first tokens here beyond the pool's TTFT tail (`TtftTail`),
    # an exponential average: how likely a request sent here is to end up in that tail.
    tail_share: float = 0.0
    last_first_byte: float = -1.0  # clock time of this writer's latest first byte here (-1: none)
    # Monotone counters and integrals (for the mean batch over a request's decode).
    prefill_total: int = 0  # prefill tokens ever sent
    decode_integral: float = 0.0  # ∫ decoding dt
    context_integral: float = 0.0  # ∫ context_tokens dt

    # -- writes (request control) --

    def add(self, item: Outstanding, now: float, work_seconds: float = 0.0, prefill_seconds: float = 0.0,
            kv_token_seconds: float = 0.0) -> None:
        """A pick: `item` joins the end of the prefill queue (its `predicted_ttft` set);
        `work_seconds`: the pod time it will cost (its prefill and its share of decode steps),
        `prefill_seconds` of it its prefill; `kv_token_seconds`: the KV tokens it will hold there
        times the seconds it holds them."""
        self.settle(now)
        if self.rates_since < 0.0:
            self.rates_since = now
        decay = self._decay(now)
        self.pick_rate = self.pick_rate * decay + 1.0 / RATE_WINDOW
        self.work_rate = self.work_rate * decay + work_seconds / RATE_WINDOW
        self.prefill_rate = self.prefill_rate * decay + prefill_seconds / RATE_WINDOW
        self.kv_rate = self.kv_rate * decay + kv_token_seconds / RATE_WINDOW
        self.rates_at = now
        tail = self.pending[-1].expected_done if self.pending else now
        item.started = max(now, tail)
        item.expected_done = max(now + item.predicted_ttft, item.started)
        self.pending.append(item)
        lead = (item.expected_done - now) * self.step_pace / self.step_seconds if self.step_seconds > 0.0 else 0.0
        self._expect_end(item, self.steps + lead + item.output_tokens)
        if item.model:
            self.models[item.model] = self.models.get(item.model, 0) + 1
        self.prefill_backlog += item.prefill_tokens
        self.prefill_pairs += item.attention_pairs
        self.recompute_backlog += item.recompute_tokens
        self.footprint_tokens += item.footprint_tokens
        self.prefill_total += item.prefill_tokens
        self.requests += 1

    def observe_tail(self, beyond: bool) -> None:
        """One of this writer's first tokens here: beyond the pool's TTFT tail or not (`tail_share`)."""
        self.tail_share += _TAIL_ALPHA * ((1.0 if beyond else 0.0) - self.tail_share)

    def first_byte(self, item: Outstanding, now: float) -> None:
        """A streamed first byte: `item` and everything picked before it are past prefill; the
        ones after it shift by how late (or early) it was."""
        self.settle(now)
        item.first_token = now
        item.stalled = False
        last = self.last_first_byte
        if last >= 0.0 and item.dispatched < last <= now:  # backlogged: the pod's own pace
            interval = now - last  # (0 for first tokens of one step: the mean stays the pace)
            self.busy_interval = (interval if self.busy_interval <= 0.0
                                  else self.busy_interval + _BUSY_ALPHA * (interval - self.busy_interval))
        if now > last:
            self.last_first_byte = now
        # The pod serves in pick order: the stalled requests picked before this one are moving.
        stalled = self.stalled
        while stalled and stalled[0].dispatched <= item.dispatched:
            stalled.popleft().stalled = False
        if item.released:
            return
        item.first_step = self.steps
        self._expect_end(item, self.steps + item.output_tokens - 1)  # its first token is out
        if item.prefilled:
            return
        late = now - item.expected_done
        while self.pending:
            head = self.pending.popleft()
            self._to_decode(head)
            self.unqueued_at.append(now)
            if head is item:
                break
        previous = now
        for later in self.pending:
            later.started = max(previous, later.started + late)
            later.expected_done = max(later.started, later.expected_done + late)
            previous = later.expected_done

    def release(self, item: Outstanding, now: float) -> None:
        """`item` ended (any way). Idempotent."""
        if item.released:
            return
        self.settle(now)
        if not item.prefilled:
            self.pending.remove(item)
            self.unqueued_at.append(now)
            self.prefill_backlog -= item.prefill_tokens
            self.prefill_pairs -= item.attention_pairs
            self.recompute_backlog -= item.recompute_tokens
        else:
            self.decoding -= 1
            self.context_tokens -= item.mean_context
            self.decode_output -= item.output_tokens
            self.decode_ending -= ending_weight(item.output_tokens)
        item.released = True
        item.stalled = False
        self.footprint_tokens -= item.footprint_tokens
        self.requests -= 1
        self.ended_at.append(now)
        if len(self.ends) > 2 * self.requests + 16:  # mostly stale entries: compact (amortised O(1))
            self.ends = [e for e in self.ends if _current(e)]
            heapq.heapify(self.ends)
        if item.model:
            left = self.models.get(item.model, 0) - 1
            if left > 0:
                self.models[item.model] = left
            else:
                self.models.pop(item.model, None)

    def settle(self, now: float) -> None:
        """Advance the integrals to `now`; requests whose prefill must be over leave the queue."""
        dt = now - self.settled_at
        if dt > 0.0:
            self.settled_at = now
            self.decode_integral += self.decoding * dt
            self.context_integral += self.context_tokens * dt
            if self.step_seconds > 0.0 and self.requests:
                self.steps += dt * self.step_pace / self.step_seconds
        pending = self.pending
        while pending and self._over(pending[0], now):
            item = pending.popleft()
            self._to_decode(item)
            self.unqueued_at.append(now)
            if item.streamed and item.first_token < 0.0:
                item.stalled = True
                self.stalled.append(item)
                if len(self.stalled) > _STALLED_MAX:
                    self.stalled.popleft().stalled = False
        stalled = self.stalled
        while stalled and not stalled[0].stalled:
            stalled.popleft()

    def lateness(self, now: float) -> float:
        """Seconds the pod is behind the ledger's timeline: how late the oldest stalled request's
        first byte is. A request picked now queues behind it, so it is at least that late too."""
        for item in self.stalled:  # (a read: the writes drop the entries no longer stalled)
            if item.stalled:
                return max(0.0, now - item.expected_done)
        head = self.pending[0] if self.pending else None  # overdue, not yet settled
        if head is not None and head.streamed and self._over(head, now):
            return now - head.expected_done
        return 0.0

    @staticmethod
    def _over(item: Outstanding, now: float) -> bool:
        if now < item.expected_done:
            return False
        if not item.streamed:
            return True
        overdue = max(_OVERDUE_MIN, _OVERDUE_FACTOR * (item.expected_done - item.dispatched))
        return now >= item.expected_done + overdue

    def _to_decode(self, item: Outstanding) -> None:
        item.prefilled = True
        self.prefill_backlog -= item.prefill_tokens
        self.prefill_pairs -= item.attention_pairs
        self.recompute_backlog -= item.recompute_tokens
        self.decoding += 1
        self.context_tokens += item.mean_context
        self.decode_output += item.output_tokens
        self.decode_ending += ending_weight(item.output_tokens)

    def mark_scrape(self, asked: float = math.inf) -> None:
        """New scraped metrics arrived, their page asked for at `asked`: remember what the EPP had
        outstanding then. A request that ended (or left the prefill queue) after the page was
        asked for is still on it: read as traffic the ledger cannot explain, a pod that had just
        served one request looked busier than an idle one (a stale `waiting` of 1 outweighed a
        whole prompt's cache credit). What was sent since counts as the EPP's, as the page may
        already show it. (`asked` by default: after everything the ledger holds.)"""
        self.requests_at_scrape = self.requests + _after(self.ended_at, asked)
        self.pending_at_scrape = len(self.pending) + _after(self.unqueued_at, asked)
        self.footprint_at_scrape = self.footprint_tokens
        self.prefill_total_at_scrape = self.prefill_total

    def sent_since(self, since: float) -> int:
        """This writer's requests here picked at or after `since` that have no first byte yet."""
        count = 0
        for item in reversed(self.pending):
            if item.dispatched < since:
                break
            count += 1
        return count

    # -- reads (scheduling) --

    def _decay(self, now: float) -> float:
        return math.exp(-max(0.0, now - self.rates_at) / RATE_WINDOW)

    def _read_factor(self, now: float) -> float:
        return self._decay(now) / coverage(self.rates_since, now)

    def decayed_rates(self, now: float) -> tuple[float, float, float, float]:
        """The four averages as kept (pick rate, work rate, prefill rate, KV rate), decayed to
        `now` but not corrected for their coverage: what several writers' rows add up."""
        decay = self._decay(now)
        return self.pick_rate * decay, self.work_rate * decay, self.prefill_rate * decay, self.kv_rate * decay

    def rate_at(self, now: float) -> float:
        """Picks per second lately sent here."""
        if self.pick_rate <= 0.0:
            return 0.0
        return self.pick_rate * self._read_factor(now)

    def utilization_at(self, now: float) -> float:
        """Pod-seconds of work per second lately sent here (the share of the pod it keeps busy)."""
        if self.work_rate <= 0.0:
            return 0.0
        return self.work_rate * self._read_factor(now)

    def kv_forecast_at(self, now: float) -> float:
        """KV tokens the requests lately sent here will hold on average, if it keeps being sent
        as many (Little's law: the KV token-seconds sent per second). Unlike the cache's use,
        which a long generation fills over its minute of decode, this counts its whole stay the
        moment it is sent: a pod sent many of them reads full at once."""
        if self.kv_rate <= 0.0:
            return 0.0
        return self.kv_rate * self._read_factor(now)

    def prefill_utilization_at(self, now: float) -> float:
        """Pod-seconds of prefill per second lately sent here: how busy the FCFS prefill queue is
        (decode steps run beside a prefill chunk; they do not hold the next prefill up)."""
        if self.prefill_rate <= 0.0:
            return 0.0
        return self.prefill_rate * self._read_factor(now)

    def drain_seconds(self, waiting: int) -> float:
        """Seconds until a request sent now gets its first token if the pod keeps the pace it has
        measured while backlogged (`busy_interval`): one interval for each request still waiting
        to be admitted ahead of it, and one for its own (0: no pace measured).

        Of the requests without a first token, those the pod has admitted are prefilling and
        need no admission of their own: still waiting are the `waiting` its last scrape showed
        plus the ones sent since (taking the prefilling ones for waiting over-predicted a pod
        with a short queue by a third). Counted in this writer's requests, a share of the pod's,
        so it holds with several writers: each sees that share of the first bytes, and its
        intervals are as much longer."""
        if self.busy_interval <= 0.0:
            return 0.0
        mine = len(self.pending)
        everyone = mine + self.peer_pending
        ahead = 0.0
        if everyone:
            still_waiting = waiting + max(0, everyone - self.pending_at_scrape)
            ahead = mine * min(1.0, still_waiting / everyone)
        return (ahead + 1.0) * self.busy_interval

    def observe_steps(self, item: Outstanding, steps: int, now: float) -> None:
        """A streamed response ended after `steps` decode steps since its first byte (its tokens
        but the first): correct the pace of the step count by what it counted meanwhile."""
        if item.first_step < 0.0 or steps <= 0:
            return
        self.settle(now)
        self.observe_step_count(self.steps - item.first_step, steps)

    def observe_step_count(self, counted: float, steps: int) -> None:
        """`observe_steps` with the count taken earlier: it counted `counted` steps where the
        response had `steps` (its usage came after its end: Envoy's access log)."""
        if counted <= 0.0 or steps <= 0:
            return
        ratio = min(_PACE_MAX, max(1.0 / _PACE_MAX, steps / counted))
        pace = self.step_pace * ratio ** _PACE_ALPHA
        self.step_pace = min(_PACE_MAX, max(1.0 / _PACE_MAX, pace))

    def _expect_end(self, item: Outstanding, end_step: float) -> None:
        item.end_step = end_step
        heapq.heappush(self.ends, (end_step, id(item), item))

    def steps_until_end(self, k: int, now: float) -> float:
        """Decode steps until the k-th of this writer's requests here ends, if each generates its
        expected output (-1: fewer than k of them)."""
        ends = self.ends
        while ends and not _current(ends[0]):
            heapq.heappop(ends)
        if k <= 1:
            if not ends:
                return -1.0
            end = ends[0][0]
        else:
            live = heapq.nsmallest(k, (e for e in ends if _current(e)))
            if len(live) < k:
                return -1.0
            end = live[-1][0]
        steps = self.steps
        if self.step_seconds > 0.0 and now > self.settled_at and self.requests:
            steps += (now - self.settled_at) * self.step_pace / self.step_seconds
        return max(0.0, end - steps)

    def late_prefill(self, now: float) -> int:
        """Prefill tokens of requests well past their expected first token and still without it
        (the engine is slower than predicted, or holds them waiting for KV blocks): the timeline
        counts them done; a gate must not."""
        late = 0
        for item in self.pending:
            if now <= item.expected_done + max(_LATE_MIN, _LATE_FACTOR * (item.expected_done - item.started)):
                break
            late += item.prefill_tokens
        return late

    def prefilling_at(self, now: float) -> int:
        """Requests still waiting for their first token at `now`: a new prompt's prefill chunk
        joins their step and delays it. A streamed one waits until its first byte says otherwise
        (a pod behind its timeline has not prefilled it, whatever the timeline says); one that is
        not streamed, until the timeline says its prefill is over. Other writers' queues count
        as their owners last published them."""
        count = len(self.pending) + self.peer_pending
        for item in self.pending:  # the ones past their expected end are at the head (few)
            if item.expected_done > now:
                break
            if not item.streamed:
                count -= 1
        return count

    def backlog_below_at(self, tokens: float, now: float) -> float:
        """The earliest time (≥ `now`) the timeline says `backlog_at` drops below `tokens`
        (`inf`: not before it runs out of requests, e.g. `tokens` ≤ 0)."""
        backlog = self.backlog_at(now)
        if backlog < tokens:
            return now
        for item in self.pending:
            left = item.remaining_prefill(now)
            if left <= 0.0:
                continue
            if backlog - left < tokens:  # crossed while this one prefills, at a linear pace
                start = max(now, item.started)
                need = backlog - tokens + 1e-9  # tokens of this one to do first
                pace = left / (item.expected_done - start) if item.expected_done > start else math.inf
                return start + need / pace
            backlog -= left
        return math.inf

    def unallocated(self, queued: float) -> float:
        """Of `queued` prefill tokens, those the last scrape's KV use leaves out that the footprint
        since does not count either (the picks since the scrape are in the footprint, whole)."""
        return max(0.0, queued - (self.prefill_total - self.prefill_total_at_scrape))

    def backlog_at(self, now: float) -> float:
        """Prefill tokens still to do at `now`, without changing the ledger: the queue's total
        less what the timeline says the requests at its head have done."""
        backlog = float(self.prefill_backlog)
        for item in self.pending:
            if now <= item.started:
                break
            backlog -= item.prefill_tokens - item.remaining_prefill(now)
        return max(0.0, backlog)


def _after(times: deque[float], moment: float) -> int:
    """How many of `times` (ascending) are later than `moment`; the others are dropped."""
    while times and times[0] <= moment:
        times.popleft()
    return len(times)
