"""The synchronous flow controller on a fake clock: priority, fairness, ordering, limits, TTL,
cancellation, dispatch gates, work conservation and the vLLM priority it computes."""

from __future__ import annotations

import random

import pytest

from epp.api.response import Usage
from epp.errors import Code
from epp.flowcontrol.concurrency_detector import ConcurrencyDetector
from epp.flowcontrol.item import ItemState, Outcome
from epp.flowcontrol.policy import UsageLimitPolicy

from .helpers import (
    Pool,
    RecordingSink,
    Scheduler,
    assert_empty,
    controller,
    dispatched,
    finish,
    flow_config,
    flows_of,
    item,
    request,
    scheduler_failure,
)

ONE_AT_A_TIME = """\
flowControl:
  defaultPriorityBand:
    fairnessPolicyRef: {fairness}
    orderingPolicyRef: {ordering}
    dispatchGate: {{inflightRequestsThreshold: 1}}
"""


def serial(fairness: str = "global-strict-fairness-policy", ordering: str = "fcfs-ordering-policy") -> str:
    """One endpoint, one request at a time: the dispatch order is the order policies choose."""
    return ONE_AT_A_TIME.format(fairness=fairness, ordering=ordering)


def drain_in_order(fc, usage_of=None) -> list:  # type: ignore[no-untyped-def]
    """Dispatch and finish requests one by one; the order they went in."""
    order = []
    while len(fc):
        went = dispatched(fc.dispatch())
        assert len(went) == 1, went
        order.extend(went)
        finish(fc, went[0], usage_of(went[0]) if usage_of else None)
    return order


# -- strict priority --


def test_higher_band_goes_first_whatever_the_arrival_order() -> None:
    pool = Pool(1)
    fc = controller(pool, serial())
    s = Scheduler()
    low = [item(request("batch", priority=-1), s) for _ in range(3)]
    mid = [item(request("chat", priority=0), s) for _ in range(2)]
    high = [item(request("vip", priority=10), s)]
    for it in (*low, *mid, *high):
        assert fc.enqueue(it) == []
    assert [i.priority for i in drain_in_order(fc)] == [10, 0, 0, -1, -1, -1]
    assert_empty(fc)


class _PerBandCeiling(UsageLimitPolicy):
    type = "test-per-band-ceiling"

    def __init__(self, ceilings: dict[int, float]) -> None:
        super().__init__()
        self.ceilings = ceilings

    def ceiling(self, priority: int) -> float:
        return self.ceilings[priority]


def test_a_lower_band_never_leapfrogs_a_higher_band_held_by_saturation() -> None:
    pool = Pool(1)
    config = flow_config()
    config.usage_limit = _PerBandCeiling({10: 0.5, 0: 1.0})  # the high band stops earlier
    fc = controller(pool, config)
    pool.scrape(pool.endpoints[0], waiting_queue_size=3)  # saturation 3/5 = 0.6
    s = Scheduler()
    high, low = item(request(priority=10), s), item(request(priority=0), s)
    fc.enqueue(high)
    fc.enqueue(low)
    assert fc.dispatch() == []  # the low band is open (0.6 < 1.0) but waits behind the high band
    pool.scrape(pool.endpoints[0], waiting_queue_size=1)  # 0.2: both open
    assert dispatched(fc.dispatch()) == [high, low]


def test_a_lower_band_never_takes_an_endpoint_a_waiting_higher_band_refuses() -> None:
    """Per-endpoint head of line: a pod the higher band's gate refuses stays closed to lower
    bands while the higher band waits (else they would keep it full and the higher band
    starves); a pod it accepts is its own."""
    pool = Pool(2)
    busy, idle = pool.endpoints
    fc = controller(pool, """\
flowControl:
  priorityBands:
  - {priority: 10, dispatchGate: {queueDepthThreshold: 1}}   # only into an empty queue
  - {priority: 0, dispatchGate: {queueDepthThreshold: 3}}
""")
    pool.scrape(busy, waiting_queue_size=1)
    pool.scrape(idle, waiting_queue_size=1)
    s = Scheduler()
    strict, loose = item(request(priority=10), s), item(request(priority=0), s)
    fc.enqueue(strict)
    fc.enqueue(loose)
    assert fc.dispatch() == []  # both pods refuse the strict band: the loose one waits too
    pool.scrape(idle, waiting_queue_size=0)
    # The strict one takes the empty queue; then nothing higher waits and the loose gate decides.
    assert dispatched(fc.dispatch()) == [strict, loose]
    assert strict.endpoint is idle


def test_batch_waiting_for_an_idle_pod_does_not_block_interactive() -> None:
    pool = Pool(1)
    fc = controller(pool, """\
flowControl:
  priorityBands:
  - {priority: 10, dispatchGate: {queueDepthThreshold: 3}}
  - {priority: -1, dispatchGate: {queueDepthThreshold: 1}}
""")
    pool.scrape(pool.endpoints[0], waiting_queue_size=1)
    s = Scheduler()
    batch = [item(request("batch", priority=-1), s) for _ in range(5)]
    for it in batch:
        fc.enqueue(it)
    assert fc.dispatch() == []
    chat = item(request("chat", priority=10), s)
    fc.enqueue(chat)
    assert dispatched(fc.dispatch()) == [chat]
    pool.scrape(pool.endpoints[0], waiting_queue_size=0)
    assert dispatched(fc.dispatch()) == batch[:1]  # the in-flight guard: one into the empty queue


# -- fairness between flows --


def test_global_strict_is_arrival_order_across_flows() -> None:
    pool = Pool(1)
    fc = controller(pool, serial())
    s = Scheduler()
    for flow in ("a", "a", "a", "b", "c"):
        fc.enqueue(item(request(flow), s))
    assert flows_of(drain_in_order(fc)) == ["a", "a", "a", "b", "c"]


def test_round_robin_serves_a_newcomer_after_at_most_one_turn_of_the_flood() -> None:
    pool = Pool(1)
    fc = controller(pool, serial("round-robin-fairness-policy"))
    s = Scheduler()
    flood = [item(request("a"), s) for _ in range(6)]
    for it in flood:
        fc.enqueue(it)
    first = dispatched(fc.dispatch())
    assert flows_of(first) == ["a"]
    fc.enqueue(item(request("b"), s))
    fc.enqueue(item(request("c"), s))
    finish(fc, first[0])
    assert flows_of(drain_in_order(fc)) == ["a", "b", "c", "a", "a", "a", "a"]
    assert_empty(fc)


LONG, SHORT = 1000, 10


def _usage(it):  # type: ignore[no-untyped-def]
    return Usage(prompt_tokens=10, completion_tokens=LONG if it.flow_id == "long" else SHORT)


def _share(fairness: str, dispatches: int = 40) -> dict[str, int]:
    """Two users flood one slot: `long` generates 1000 tokens per request, `short` 10."""
    pool = Pool(1)
    fc = controller(pool, serial(fairness))
    s = Scheduler()
    for i in range(dispatches):
        fc.enqueue(item(request("long"), s))
        fc.enqueue(item(request("short"), s))
    served = {"long": 0, "short": 0}
    for _ in range(dispatches):
        went = dispatched(fc.dispatch())
        served[went[0].flow_id] += 1
        finish(fc, went[0], _usage(went[0]))
    return served


def test_round_robin_counts_requests_so_long_generations_get_100x_the_tokens() -> None:
    assert _share("round-robin-fairness-policy") == {"long": 20, "short": 20}


def test_token_fairness_gives_users_of_short_generations_their_share_of_tokens() -> None:
    served = _share("token-fairness-policy")
    assert served["short"] >= 5 * served["long"], served
    tokens_long, tokens_short = served["long"] * (LONG * 2 + 10), served["short"] * (SHORT * 2 + 10)
    assert tokens_long < 4 * tokens_short, served  # within a few requests of equal token service


def test_token_fairness_estimates_before_any_response_and_corrects_at_completion() -> None:
    pool = Pool(4)
    fc = controller(pool, """\
plugins:
- {type: token-fairness-policy, parameters: {defaultOutputTokens: 100}}
flowControl:
  defaultPriorityBand:
    fairnessPolicyRef: token-fairness-policy
    dispatchGate: {inflightRequestsThreshold: 1}
""")
    s = Scheduler()
    # `big` asks for long outputs (max_tokens 5000 caps nothing); `small` caps at 10 tokens.
    for _ in range(4):
        fc.enqueue(item(request("big", max_tokens=5000), s))
        fc.enqueue(item(request("small", max_tokens=10), s))
    burst = dispatched(fc.dispatch())  # four slots, no completion yet: estimates alone decide
    assert sorted(flows_of(burst)) == ["big", "small", "small", "small"]
    assert {i.flow_id: i.charged for i in burst} == {"big": 10 + 2 * 100, "small": 10 + 2 * 10}
    big = next(i for i in burst if i.flow_id == "big")
    finish(fc, big, Usage(prompt_tokens=10, completion_tokens=2000))
    assert big.charged == 10 + 2 * 2000  # corrected to what the server reported


def test_token_fairness_gives_no_credit_for_time_away() -> None:
    pool = Pool(1)
    fc = controller(pool, serial("token-fairness-policy"))
    s = Scheduler()
    for _ in range(2):
        fc.enqueue(item(request("returning"), s))
    for _ in range(10):
        fc.enqueue(item(request("busy"), s))
    first = flows_of(drain_in_order(fc, lambda it: Usage(10, 100)))
    assert first[:4] == ["returning", "busy", "returning", "busy"] and first[4:] == ["busy"] * 8
    for _ in range(3):
        fc.enqueue(item(request("busy"), s))
        fc.enqueue(item(request("returning"), s))
    # While away, `busy` used 8 × 210 tokens alone. `returning` comes back level with it, not
    # 1680 tokens ahead (which would give it all three of its requests first): they alternate.
    again = flows_of(drain_in_order(fc, lambda it: Usage(10, 100)))
    assert sorted(again) == ["busy"] * 3 + ["returning"] * 3
    assert all(x != y for x, y in zip(again, again[1:])), again


# -- ordering within a flow --


def test_fcfs_within_a_flow() -> None:
    pool = Pool(1)
    fc = controller(pool, serial("round-robin-fairness-policy", "fcfs-ordering-policy"))
    s = Scheduler()
    items = [item(request("a"), s) for _ in range(4)]
    for it in items:
        fc.enqueue(it)
    assert drain_in_order(fc) == items


def test_slo_deadline_orders_by_ttft_objective_then_fcfs() -> None:
    pool = Pool(1)
    fc = controller(pool, serial("round-robin-fairness-policy", "slo-deadline-ordering-policy"))
    s = Scheduler()
    relaxed = item(request("a", headers={"x-slo-ttft-ms": "5000"}), s)
    none1 = item(request("a"), s)
    urgent = item(request("a", headers={"x-slo-ttft-ms": "200"}), s)
    invalid = item(request("a", headers={"x-slo-ttft-ms": "soon"}), s)
    fc.enqueue(relaxed)
    fc.enqueue(none1)
    pool.clock.advance(1.0)
    fc.enqueue(urgent)  # arrives a second later but is due at +1.2 s, before +5 s
    fc.enqueue(invalid)
    assert drain_in_order(fc) == [urgent, relaxed, none1, invalid]


def test_edf_orders_by_ttl_deadline_and_survives_removals() -> None:
    pool = Pool(1)
    fc = controller(pool, """\
flowControl:
  defaultRequestTTL: 60s
  defaultPriorityBand:
    orderingPolicyRef: edf-ordering-policy
    dispatchGate: {inflightRequestsThreshold: 1}
  priorityBands:
  - {priority: 0, defaultRequestTTL: 10s}
""")
    s = Scheduler()
    items = [item(request("a"), s) for _ in range(5)]
    for it in items:
        fc.enqueue(it)
        pool.clock.advance(0.1)
    fc.remove(items[0])
    fc.remove(items[3])
    assert [i.deadline - i.enqueue_time for i in items] == [10.0] * 5
    assert drain_in_order(fc) == [items[1], items[2], items[4]]
    assert_empty(fc)


def test_edf_queue_puts_requests_without_deadline_last() -> None:
    from epp.flowcontrol.plugins.edf_ordering_policy import EdfOrderingPolicy

    queue = EdfOrderingPolicy().new_queue()
    s = Scheduler()
    items = [item(request(), s) for _ in range(4)]
    for seq, (it, deadline) in enumerate(zip(items, (float("inf"), 5.0, 3.0, float("inf")))):
        it.seq, it.deadline = seq, deadline
        queue.push(it)
    assert [queue.pop() for _ in range(4)] == [items[2], items[1], items[0], items[3]]


# -- capacity --


def test_band_request_and_byte_limits_reject_with_429_and_hold_nothing() -> None:
    pool = Pool(1)
    sink = RecordingSink()
    fc = controller(pool, """\
flowControl:
  priorityBands:
  - {priority: 0, maxRequests: 2, maxBytes: 1k, dispatchGate: {inflightRequestsThreshold: 1}}
""", sink=sink)
    pool.endpoints[0].inflight_requests = 1  # busy: everything queues
    s = Scheduler()
    assert fc.enqueue(item(request(size=600), s)) == []
    [too_big] = fc.enqueue(item(request(size=500), s))
    assert too_big.outcome is Outcome.REJECTED_CAPACITY and too_big.error.code is Code.RESOURCE_EXHAUSTED
    assert too_big.error.http_status == 429 and "maxBytes" in too_big.error.message
    assert fc.enqueue(item(request(size=300), s)) == []
    [too_many] = fc.enqueue(item(request(size=1), s))
    assert too_many.outcome is Outcome.REJECTED_CAPACITY and "maxRequests" in too_many.error.message
    assert (len(fc), fc.queued_bytes) == (2, 900)
    assert sink.queued == {("default-flow", 0): [2, 900]}
    assert sink.rejected == [("band_capacity", 0), ("band_capacity", 0)]


def test_global_limits_reject_when_nothing_lower_can_make_room() -> None:
    pool = Pool(1)
    fc = controller(pool, """\
flowControl:
  maxRequests: 3
  maxBytes: 10Ki
  defaultPriorityBand: {dispatchGate: {inflightRequestsThreshold: 1}}
""")
    pool.endpoints[0].inflight_requests = 1
    s = Scheduler()
    assert fc.enqueue(item(request(priority=5), s)) == []
    assert fc.enqueue(item(request(priority=0), s)) == []
    [huge] = fc.enqueue(item(request(priority=9, size=10 * 1024), s))
    assert huge.outcome is Outcome.REJECTED_CAPACITY and "global maxBytes" in huge.error.message
    assert fc.enqueue(item(request(priority=0), s)) == []
    [full] = fc.enqueue(item(request(priority=9), s))  # priority >= 0 is never evicted
    assert full.outcome is Outcome.REJECTED_CAPACITY and "global maxRequests" in full.error.message


def test_a_full_queue_sheds_batch_before_interactive() -> None:
    pool = Pool(1)
    sink = RecordingSink()
    fc = controller(pool, """\
flowControl:
  maxRequests: 3
  defaultPriorityBand: {dispatchGate: {inflightRequestsThreshold: 1}}
""", sink=sink)
    pool.endpoints[0].inflight_requests = 1
    s = Scheduler()
    batch = [item(request("batch", priority=-1), s) for _ in range(2)]
    chat = [item(request("chat", priority=0), s) for _ in range(3)]
    for it in batch:
        assert fc.enqueue(it) == []
    assert fc.enqueue(chat[0]) == []
    [evicted] = fc.enqueue(chat[1])  # the newest batch request makes room
    assert evicted.item is batch[1] and evicted.outcome is Outcome.EVICTED_OTHER
    assert evicted.error.http_status == 429 and "evicted" in evicted.error.message
    [evicted] = fc.enqueue(chat[2])
    assert evicted.item is batch[0]
    assert fc.band(-1).count == 0 and fc.band(-1).flows == {} and len(fc) == 3
    [rejected] = fc.enqueue(item(request("batch", priority=-1), s))  # no lower band to take from
    assert rejected.outcome is Outcome.REJECTED_CAPACITY
    assert sink.queued[("batch", -1)] == [0, 0]


def test_eviction_can_be_turned_off() -> None:
    pool = Pool(1)
    fc = controller(pool, """\
flowControl:
  maxRequests: 1
  evictSheddable: false
  defaultPriorityBand: {dispatchGate: {inflightRequestsThreshold: 1}}
""")
    pool.endpoints[0].inflight_requests = 1
    s = Scheduler()
    fc.enqueue(item(request(priority=-1), s))
    [rejected] = fc.enqueue(item(request(priority=0), s))
    assert rejected.outcome is Outcome.REJECTED_CAPACITY


def test_shed_when_saturated_rejects_at_once_instead_of_queueing() -> None:
    pool = Pool(2)
    fc = controller(pool, """\
flowControl:
  priorityBands:
  - {priority: -1, shedWhenSaturated: true}
""")
    for ep in pool.endpoints:
        pool.scrape(ep, waiting_queue_size=5)  # saturation 1.0
    s = Scheduler()
    [shed] = fc.enqueue(item(request(priority=-1), s))
    assert shed.outcome is Outcome.REJECTED_OTHER and shed.error.http_status == 429
    assert shed.error.message == "system saturated, sheddable request dropped"
    assert fc.enqueue(item(request(priority=0), s)) == []  # other bands queue as usual
    pool.scrape(pool.endpoints[0], waiting_queue_size=0)
    assert fc.enqueue(item(request(priority=-1), s)) == []


# -- TTL, cancellation, scheduling failure: nothing left behind --


def test_ttl_expiry_ends_with_503_and_frees_everything() -> None:
    pool = Pool(1)
    sink = RecordingSink()
    fc = controller(pool, "flowControl: {defaultRequestTTL: 2s, maxRequests: 10}\n", sink=sink)
    pool.scrape(pool.endpoints[0], waiting_queue_size=5)  # saturated: nothing goes
    s = Scheduler()
    first, second = item(request("a"), s), item(request("b"), s)
    fc.enqueue(first)
    pool.clock.advance(1.0)
    fc.enqueue(second)
    assert fc.next_deadline() == first.deadline
    pool.clock.advance(1.5)
    [expired] = fc.dispatch()
    assert expired.item is first and expired.outcome is Outcome.EVICTED_TTL
    assert expired.error.http_status == 503
    assert expired.error.message.startswith("request timed out in queue")
    assert fc.next_deadline() == second.deadline
    pool.clock.advance(1.0)
    assert [e.item for e in fc.dispatch()] == [second]
    assert_empty(fc)
    assert all(v == [0, 0] for v in sink.queued.values())
    assert sink.rejected == [("ttl", 0), ("ttl", 0)]


@pytest.mark.parametrize("fairness", ["global-strict-fairness-policy", "round-robin-fairness-policy",
                                      "token-fairness-policy"])
@pytest.mark.parametrize("ordering", ["fcfs-ordering-policy", "edf-ordering-policy",
                                      "slo-deadline-ordering-policy"])
def test_removal_on_cancel_leaves_every_counter_at_zero(fairness: str, ordering: str) -> None:
    pool = Pool(1)
    sink = RecordingSink()
    fc = controller(pool, f"""\
flowControl:
  defaultRequestTTL: 30s
  defaultPriorityBand:
    fairnessPolicyRef: {fairness}
    orderingPolicyRef: {ordering}
    dispatchGate: {{inflightRequestsThreshold: 1}}
""", sink=sink)
    s = Scheduler()
    rng = random.Random(7)
    items = [item(request(f"user{rng.randrange(4)}", priority=rng.choice([-1, 0, 3]), size=rng.randrange(1, 999),
                          headers={"x-slo-ttft-ms": str(rng.randrange(10, 900))}), s) for _ in range(40)]
    for it in items:
        fc.enqueue(it)
    running = dispatched(fc.dispatch())
    assert len(running) == 1
    for it in rng.sample(items, len(items)):
        ending = fc.remove(it)
        assert (ending is None) == (it is running[0])
        if ending is not None:
            assert ending.outcome is Outcome.EVICTED_CONTEXT_CANCELLED and it.state is ItemState.DONE
    assert fc.remove(items[0]) is None  # twice is harmless
    finish(fc, running[0], Usage(10, 10))
    assert_empty(fc)
    assert all(v == [0, 0] for v in sink.queued.values())
    assert pool.endpoints[0].inflight_requests == 0


def test_a_failed_scheduling_ends_the_request_and_holds_nothing() -> None:
    pool = Pool(1)
    fc = controller(pool, serial("token-fairness-policy"))
    s = Scheduler(fail=scheduler_failure())
    it = item(request("a"), s)
    fc.enqueue(it)
    [ending] = fc.dispatch()
    assert ending.outcome is Outcome.REJECTED_OTHER and ending.error is not None and ending.error.http_status == 429
    assert it.state is ItemState.DONE and it.charged == 0
    assert_empty(fc)


def test_a_failed_scheduling_is_recorded_as_a_rejection_not_a_dispatch() -> None:
    pool = Pool(1)
    sink = RecordingSink()
    fc = controller(pool, sink=sink)
    fc.enqueue(item(request("a"), Scheduler(fail=scheduler_failure())))
    fc.dispatch()
    assert sink.done == [("a", "RejectedOther")]
    assert sink.rejected == [("scheduler", 0)]


def test_drain_ends_every_queued_request() -> None:
    pool = Pool(1)
    fc = controller(pool, "flowControl: {defaultRequestTTL: 5s}\n")
    pool.scrape(pool.endpoints[0], waiting_queue_size=9)
    s = Scheduler()
    items = [item(request(priority=p), s) for p in (0, 1, -1)]
    for it in items:
        fc.enqueue(it)
    endings = fc.drain()
    assert {e.item for e in endings} == set(items) and all(e.error.http_status == 503 for e in endings)
    assert_empty(fc)


# -- dispatch gates --


def test_queue_depth_gate_with_the_in_flight_guard_between_scrapes() -> None:
    pool = Pool(1)
    fc = controller(pool, "flowControl:\n  defaultPriorityBand: {dispatchGate: {queueDepthThreshold: 3}}\n")
    ep = pool.endpoints[0]
    s = Scheduler()
    for _ in range(10):
        fc.enqueue(item(request(), s))
    assert len(dispatched(fc.dispatch())) == 3  # an empty queue takes three before the next scrape
    assert fc.dispatch() == []
    pool.scrape(ep, waiting_queue_size=2, running_requests=1)  # the scrape shows them
    assert len(dispatched(fc.dispatch())) == 1
    pool.scrape(ep, waiting_queue_size=0, running_requests=4)  # the engine took them all into its batch
    assert len(dispatched(fc.dispatch())) == 3


def test_without_the_guard_a_stale_scrape_lets_a_burst_through() -> None:
    pool = Pool(1)
    fc = controller(pool, "flowControl:\n  defaultPriorityBand:\n"
                          "    dispatchGate: {queueDepthThreshold: 3, inflightGuard: false}\n")
    s = Scheduler()
    for _ in range(10):
        fc.enqueue(item(request(), s))
    assert len(dispatched(fc.dispatch())) == 10


def test_inter_token_latency_gate_per_band() -> None:
    pool = Pool(2)
    slow, fast = pool.endpoints
    pool.scrape(slow, inter_token_latency=0.200)
    pool.scrape(fast, inter_token_latency=0.120)
    fc = controller(pool, """\
flowControl:
  priorityBands:
  - {priority: 10, dispatchGate: {interTokenLatencyThreshold: 150ms, inflightRequestsThreshold: 1}}
  - {priority: 0, dispatchGate: {interTokenLatencyThreshold: 100ms}}
""")
    s = Scheduler()
    chat, chat2, batch = item(request(priority=10), s), item(request(priority=10), s), item(request(priority=0), s)
    for it in (chat, chat2, batch):
        fc.enqueue(it)
    assert dispatched(fc.dispatch()) == [chat]
    assert chat.endpoint is fast
    assert chat2.queued and batch.queued  # fast is full for chat; both too slow for batch
    pool.scrape(slow, inter_token_latency=0.0)  # idle now: latency unknown, not high
    assert dispatched(fc.dispatch()) == [chat2, batch]


def test_kv_cache_gate() -> None:
    pool = Pool(2)
    full, roomy = pool.endpoints
    pool.scrape(full, kv_cache_usage=0.7)
    pool.scrape(roomy, kv_cache_usage=0.2)
    fc = controller(pool, "flowControl:\n  defaultPriorityBand: {dispatchGate: {kvCacheUtilThreshold: 0.5}}\n")
    s = Scheduler()
    its = [item(request(), s) for _ in range(3)]
    for it in its:
        fc.enqueue(it)
    assert {i.endpoint for i in dispatched(fc.dispatch())} == {roomy}


def test_saturated_endpoints_are_closed_and_the_scheduler_sees_only_open_ones() -> None:
    pool = Pool(3)
    a, b, c = pool.endpoints
    pool.scrape(a, waiting_queue_size=5)
    pool.scrape(b, kv_cache_usage=0.85)
    fc = controller(pool)
    s = Scheduler()
    fc.enqueue(item(request(), s))
    assert [e.item.endpoint for e in fc.dispatch()] == [c]
    assert s.calls == [[c.address]]


def test_concurrency_detector_as_the_saturation_source() -> None:
    pool = Pool(2)
    fc = controller(pool, saturation=ConcurrencyDetector(max_concurrency=2))
    s = Scheduler()
    for _ in range(6):
        fc.enqueue(item(request(), s))
    assert len(dispatched(fc.dispatch())) == 4
    assert [ep.inflight_requests for ep in pool.endpoints] == [2, 2]


def test_a_subset_hint_waits_for_its_endpoint_without_holding_other_bands() -> None:
    pool = Pool(2)
    a, b = pool.endpoints
    fc = controller(pool, "flowControl:\n  defaultPriorityBand: {dispatchGate: {inflightRequestsThreshold: 1}}\n")
    a.inflight_requests = 1
    s = Scheduler()
    pinned = item(request(priority=5), s, allowed=[a.address])
    other = item(request(priority=0), s)
    fc.enqueue(pinned)
    fc.enqueue(other)
    assert dispatched(fc.dispatch()) == [other] and other.endpoint is b
    a.inflight_requests = 0
    assert dispatched(fc.dispatch()) == [pinned] and pinned.endpoint is a


def test_work_conservation_nothing_waits_while_an_endpoint_could_take_it() -> None:
    """Random arrivals, completions and scrapes: after every cycle, either the queue is empty or
    no band's next request has an endpoint its gate admits."""
    rng = random.Random(3)
    pool = Pool(4)
    fc = controller(pool, """\
plugins:
- type: round-robin-fairness-policy
flowControl:
  defaultPriorityBand:
    fairnessPolicyRef: round-robin-fairness-policy
    dispatchGate: {queueDepthThreshold: 2, inflightRequestsThreshold: 3}
  priorityBands:
  - {priority: -1, dispatchGate: {queueDepthThreshold: 1, inflightRequestsThreshold: 2}}
""")
    s = Scheduler()
    running = []
    for _ in range(400):
        action = rng.random()
        if action < 0.5:
            fc.enqueue(item(request(f"u{rng.randrange(5)}", priority=rng.choice([0, 0, -1])), s))
        elif action < 0.8 and running:
            finish(fc, running.pop(rng.randrange(len(running))))
        else:
            ep = rng.choice(pool.endpoints)
            pool.scrape(ep, waiting_queue_size=rng.choice([0, 0, 1, 2]))
        running.extend(dispatched(fc.dispatch()))
        for band in fc.bands():
            head = band.queue.peek()
            if head is not None:
                assert band.config.gate.filter(pool.endpoints, fc._recent, pool.clock()) == [], (band.priority, head)
    for it in running:
        finish(fc, it)
    while len(fc):
        for ep in pool.endpoints:
            pool.scrape(ep, waiting_queue_size=0)
        went = dispatched(fc.dispatch())
        assert went
        for it in went:
            finish(fc, it)
    assert_empty(fc)


# -- vLLM priority --


def test_vllm_priority_from_band_and_the_flows_place() -> None:
    pool = Pool(1)  # one endpoint: a flow's depth there is its depth in the pool (test_slots.py: per endpoint)
    fc = controller(pool, "flowControl:\n  vllmPriority: {enabled: true, bandStride: 100}\n")
    s = Scheduler()
    a = [item(request("a"), s) for _ in range(3)]
    b = item(request("b"), s)
    vip = item(request("c", priority=10), s)
    batch = item(request("d", priority=-2), s)
    for it in (*a, b, vip, batch):
        fc.enqueue(it)
    fc.dispatch()
    assert [i.engine_priority for i in a] == [0, 1, 2]  # A's n-th concurrent request: n-1
    assert b.engine_priority == 0  # B's only request ties A's first, ahead of A's others
    assert vip.engine_priority == -1000 and batch.engine_priority == 200
    finish(fc, a[0])
    finish(fc, a[1])
    again = item(request("a"), s)
    fc.enqueue(again)
    fc.dispatch()
    assert again.engine_priority == 1  # one of A's requests still runs


def test_vllm_priority_is_off_by_default() -> None:
    pool = Pool(1)
    fc = controller(pool)
    it = item(request(), Scheduler())
    fc.enqueue(it)
    fc.dispatch()
    assert it.engine_priority is None
