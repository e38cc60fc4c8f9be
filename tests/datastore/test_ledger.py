"""The per-endpoint ledger of outstanding work (`EndpointLoad`): a FIFO prefill timeline that the
first streamed byte resynchronises, sums that always return to zero, and reads that never write."""

from __future__ import annotations

import random

import pytest

from epp.datastore import EndpointLoad, Outstanding
from epp.datastore.load import MIN_HISTORY, coverage, ending_weight


def item(prompt: int = 1000, cached: int = 0, output: int = 100, at: float = 0.0, ttft: float = 0.1,
         streamed: bool = True, recompute: int = 0) -> Outstanding:
    return Outstanding(prompt, cached, output, at, predicted_ttft=ttft, streamed=streamed, recompute_tokens=recompute)


def assert_empty(load: EndpointLoad) -> None:
    assert not load.pending
    assert (load.requests, load.decoding, load.prefill_backlog, load.context_tokens, load.footprint_tokens,
            load.recompute_backlog, load.decode_output, load.decode_ending) == (0, 0, 0, 0, 0, 0, 0, 0)
    assert load.prefill_pairs == pytest.approx(0.0, abs=1e-6)


def test_prefill_queue_is_a_timeline_in_pick_order() -> None:
    load = EndpointLoad()
    a, b = item(1000, ttft=0.2), item(500, cached=300, at=0.0, ttft=0.3)
    load.add(a, 0.0)
    load.add(b, 0.0)
    assert load.prefill_backlog == 1000 + 200 and a.expected_done == pytest.approx(0.2)
    assert b.started == pytest.approx(0.2) and b.expected_done == pytest.approx(0.3)
    assert load.backlog_at(0.1) == pytest.approx(500 + 200)  # the head is half done
    assert load.backlog_at(0.25) == pytest.approx(100)  # a done, b half done
    assert load.backlog_at(1.0) == 0.0
    # how many still wait for a first token (a new prompt's chunk would join their step): a
    # streamed one until its first byte, one that is not until the timeline says it is done
    assert [load.prefilling_at(t) for t in (0.1, 0.25, 1.0)] == [2, 2, 2]
    buffered = EndpointLoad()
    buffered.add(item(1000, ttft=0.2, streamed=False), 0.0)
    buffered.add(item(500, cached=300, ttft=0.3), 0.0)
    assert [buffered.prefilling_at(t) for t in (0.1, 0.25, 1.0)] == [2, 1, 1]
    assert load.prefill_backlog == 1200 and len(load.pending) == 2  # reading changed nothing


def test_a_streamed_first_byte_ends_the_prefill_of_everything_before_it() -> None:
    load = EndpointLoad()
    a, b, c = item(at=0.0, ttft=0.1), item(at=0.0, ttft=0.2), item(at=0.0, ttft=0.3)
    for x in (a, b, c):
        load.add(x, 0.0)
    load.first_byte(b, 0.25)  # b was 50 ms late: a is done too, c moves by as much
    assert a.prefilled and b.prefilled and not c.prefilled
    assert load.decoding == 2 and list(load.pending) == [c]
    assert c.expected_done == pytest.approx(0.35) and c.started >= 0.25
    load.first_byte(a, 0.3)  # a late first byte of one already counted: nothing moves
    assert load.decoding == 2 and a.first_token == 0.3


def test_buffered_requests_leave_the_queue_by_prediction_and_streamed_ones_only_when_overdue() -> None:
    load = EndpointLoad()
    buffered, streamed = item(ttft=0.1, streamed=False), item(ttft=0.2)
    load.add(buffered, 0.0)
    load.add(streamed, 0.0)
    load.settle(0.15)
    assert buffered.prefilled and not streamed.prefilled
    load.settle(1.0)  # overdue, but its first byte may still come
    assert not streamed.prefilled
    load.settle(10.0)  # long overdue: the event was lost, the queue must not wedge
    assert streamed.prefilled and not load.pending


def test_every_counter_returns_to_zero_whatever_the_order_of_events() -> None:
    rng = random.Random(7)
    load = EndpointLoad()
    items: list[Outstanding] = []
    now = 0.0
    for _ in range(2000):
        now += rng.random() * 0.01
        action = rng.random()
        if action < 0.4 or not items:
            cached = rng.randint(0, 4000)
            x = item(rng.randint(1, 5000), cached, rng.randint(1, 500), now, rng.random() * 0.5,
                     streamed=rng.random() < 0.8, recompute=rng.randint(0, cached))
            load.add(x, now)
            items.append(x)
        elif action < 0.6:
            load.first_byte(rng.choice(items), now)
        elif action < 0.7:
            load.settle(now)
        else:
            x = items.pop(rng.randrange(len(items)))
            load.release(x, now)
            load.release(x, now)  # twice: counted once
        assert load.requests == len(items) >= 0
        assert load.decoding + len(load.pending) == load.requests
        assert load.prefill_backlog >= 0 and load.context_tokens >= 0 and load.footprint_tokens >= 0
        assert load.recompute_backlog == sum(x.recompute_tokens for x in load.pending)
        decoding = [x for x in items if x.prefilled]
        assert load.decode_ending == sum(ending_weight(x.output_tokens) for x in decoding)
    for x in items:
        load.release(x, now + 1.0)
    assert_empty(load)


def test_integrals_and_pick_rate() -> None:
    load = EndpointLoad()
    a = item(ttft=0.1)
    load.add(a, 0.0)
    load.first_byte(a, 0.1)
    load.settle(1.1)
    assert load.decode_integral == pytest.approx(1.0)  # one decoding request for one second
    assert load.context_integral == pytest.approx(a.mean_context)
    # One pick in a 10-second window, read as if from at least `MIN_HISTORY` seconds of history.
    assert load.decayed_rates(0.0)[0] == pytest.approx(0.1)
    assert load.rate_at(0.0) == pytest.approx(0.1 / coverage(0.0, MIN_HISTORY))
    assert load.rate_at(10.0) < load.rate_at(1.0)


def test_rates_are_corrected_for_the_history_they_have() -> None:
    """Averages that start at zero read low for their first window: a pod sent 2 picks a second
    from the start reads about 2/s after 5 s, not the 0.77/s of the bare average (the warm-up's
    cold-copy storm fed on that: every pod looked idle while its prefill queue filled)."""
    load = EndpointLoad()
    now = 0.0
    while now < 5.0:
        load.add(item(ttft=0.01), now, work_seconds=0.2, prefill_seconds=0.1, kv_token_seconds=30_000.0)
        now += 0.5
    pick, work, prefill, kv = load.decayed_rates(now)
    assert pick == pytest.approx(0.77, abs=0.01)  # the bare average
    assert load.rate_at(now) == pytest.approx(2.0, rel=0.05)
    assert load.utilization_at(now) == pytest.approx(0.4, rel=0.05)
    assert load.prefill_utilization_at(now) == pytest.approx(0.2, rel=0.05)
    # 2 requests a second, each holding 3,000 KV tokens for 10 s: 60,000 tokens held on average.
    assert load.kv_forecast_at(now) == pytest.approx(60_000.0, rel=0.05)
    assert kv == pytest.approx(pick * 30_000.0)
    # Long after, the correction is gone: the average has a whole window of history.
    assert coverage(0.0, 100.0) == pytest.approx(1.0, rel=1e-4)
    assert load.rate_at(100.0) == pytest.approx(load.decayed_rates(100.0)[0], rel=1e-4)
    assert coverage(-1.0, 5.0) == 1.0  # never picked: nothing to correct
    assert EndpointLoad().rate_at(5.0) == 0.0


def test_scrape_snapshot_tells_own_requests_from_unexplained_ones() -> None:
    load = EndpointLoad()
    load.add(item(), 0.0)
    load.add(item(), 0.0)
    load.mark_scrape()
    assert (load.requests_at_scrape, load.pending_at_scrape) == (2, 2)
    assert load.footprint_at_scrape == load.footprint_tokens


def test_a_page_taken_before_a_request_ended_still_counts_it_as_the_ledgers() -> None:
    load = EndpointLoad()
    first, second, third = item(at=0.0), item(at=0.0), item(at=0.0)
    for it in (first, second, third):
        load.add(it, 0.0)
    load.first_byte(first, 0.5)  # out of the prefill queue at 0.5
    load.release(first, 0.6)
    load.release(second, 0.7)  # ended while still queued
    # A page asked for at 0.55 and read after 0.7 shows `first` running and `second` waiting.
    load.mark_scrape(0.55)
    assert (load.requests_at_scrape, load.pending_at_scrape) == (3, 2)
    # The next page, asked for after both: only what is left (the exits before it are dropped).
    load.mark_scrape(0.8)
    assert (load.requests_at_scrape, load.pending_at_scrape) == (1, 1)
    assert not load.ended_at and not load.unqueued_at
    load.release(third, 0.9)
    load.mark_scrape()  # asked for after everything
    assert (load.requests_at_scrape, load.pending_at_scrape) == (0, 0)
    assert_empty(load)


def test_when_the_backlog_falls_below_a_threshold_by_the_timeline() -> None:
    load = EndpointLoad()
    a, b = item(1000, ttft=0.2), item(500, ttft=0.3)  # a: 0 → 0.2 s; b: 0.2 → 0.3 s
    load.add(a, 0.0)
    load.add(b, 0.0)
    assert load.backlog_below_at(2000, 0.0) == 0.0  # already below
    assert load.backlog_below_at(1000, 0.0) == pytest.approx(0.1, rel=1e-6)  # half of a done
    assert load.backlog_below_at(250, 0.0) == pytest.approx(0.25, rel=1e-6)  # a done, half of b
    assert load.backlog_below_at(0, 0.0) == float("inf")  # never below nothing


def test_a_request_well_past_its_predicted_first_token_counts_whole_as_late() -> None:
    load = EndpointLoad()
    a = item(1000, ttft=0.2)
    load.add(a, 0.0)
    assert load.late_prefill(0.15) == 0 and load.late_prefill(0.21) == 0  # on time, or barely late
    assert load.backlog_at(0.5) == 0.0  # the timeline says done...
    assert load.late_prefill(0.5) == 1000  # ...but no first byte came: a gate counts it whole
    load.first_byte(a, 0.5)
    assert load.late_prefill(0.6) == 0


def test_a_stalled_request_says_how_far_behind_the_pod_is_until_the_pod_moves() -> None:
    """A streamed request long past its first token (a pod stuck waiting for KV blocks, say)
    leaves the prefill queue so nothing wedges, but is remembered as stalled: the pod is that far
    behind the timeline, and a later request's first byte or its own end says it moves again."""
    load = EndpointLoad()
    a, b = item(ttft=0.1, at=0.0), item(ttft=0.1, at=0.5)
    load.add(a, 0.0)
    assert load.lateness(1.0) == 0.0  # late, not yet overdue
    assert load.lateness(3.0) == pytest.approx(2.9)  # overdue, read before any write
    load.add(b, 3.0)  # a write settles: a leaves the queue as stalled
    assert a.prefilled and a.stalled and list(load.stalled) == [a]
    assert load.lateness(10.0) == pytest.approx(9.9)  # growing while nothing comes
    load.first_byte(b, 10.0)  # picked after it, served: the pod moves
    assert not a.stalled and load.lateness(10.0) == 0.0
    c = item(ttft=0.1, at=20.0)
    load.add(c, 20.0)
    load.settle(25.0)
    assert c.stalled and load.lateness(25.0) > 4.0
    load.release(c, 26.0)  # ended without a first byte: nothing stalls any more
    assert load.lateness(30.0) == 0.0
    load.release(a, 30.0)
    load.release(b, 30.0)
    assert_empty(load)


def test_stalled_requests_remembered_are_bounded() -> None:
    load = EndpointLoad()
    for i in range(1000):
        load.add(item(ttft=0.01, at=float(i) * 1e-3), float(i) * 1e-3)
    load.settle(100.0)
    assert len(load.stalled) <= 256 and load.lateness(100.0) > 0.0


def test_the_pace_of_first_tokens_counts_only_intervals_the_pod_was_backlogged() -> None:
    """`busy_interval` is the pod's own pace: the time between first bytes whose request was sent
    before the previous first byte. A request sent after a pause measures the pause, not the pod."""
    load = EndpointLoad()
    first, second, third = item(at=0.0), item(at=0.0), item(at=0.0)
    for it in (first, second, third):
        load.add(it, 0.0)
    load.first_byte(first, 1.0)
    assert load.busy_interval == 0.0  # nothing before it to measure from
    load.first_byte(second, 1.5)
    assert load.busy_interval == pytest.approx(0.5)
    load.first_byte(third, 1.5)  # two first tokens of one step: an interval of 0
    assert load.busy_interval == pytest.approx(0.5 + 0.1 * (0.0 - 0.5))
    paced = load.busy_interval
    late = item(at=5.0)  # sent after a pause: its interval is no measure of the pod
    load.add(late, 5.0)
    load.first_byte(late, 5.2)
    assert load.busy_interval == paced and load.last_first_byte == 5.2
    # The drain: one interval per request still waiting to be admitted, and one for a new one.
    queued = [item(at=6.0) for _ in range(3)]
    for it in queued:
        load.add(it, 6.0)
    assert load.drain_seconds(0) == pytest.approx(4 * paced)  # sent since the last scrape: all waiting
    load.mark_scrape()
    assert load.drain_seconds(1) == pytest.approx(2 * paced)  # the scrape saw 1 of the 3 waiting
    load.add(extra := item(at=6.5), 6.5)
    assert load.drain_seconds(1) == pytest.approx((4 * 2 / 4 + 1) * paced)  # and 1 sent since
    # Another writer has 4 queued there too, all sent before the scrape (the shared table adds
    # them to the snapshot): the pod's 2 waiting are shared by 8, a quarter of mine are ahead.
    load.peer_pending = 4
    load.pending_at_scrape += 4
    assert load.drain_seconds(1) == pytest.approx((4 * 2 / 8 + 1) * paced)
    load.peer_pending = load.pending_at_scrape = 0
    for it in [first, second, third, late, extra] + queued:
        load.release(it, 7.0)
    assert_empty(load)
    assert EndpointLoad().drain_seconds(5) == 0.0  # no pace measured: no drain
