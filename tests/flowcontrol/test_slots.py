"""Batch-slot fairness, the newcomer reserve and vLLM priority depth (flow control's slot ledger).

The pods' running slots are modelled by an exact in-flight gate (`inflightRequestsThreshold` =
the slots): a request flow control sends beyond it would wait in the engine's FIFO queue.
"""

from __future__ import annotations

import pytest

from epp.flowcontrol.slots import MAX_SLOTS, SlotLedger
from epp.params import ConfigError

from .helpers import Pool, Scheduler, assert_empty, controller, dispatched, finish, flow_config, flows_of, item, request

SLOTS = 8


def config(*, fairness: bool = True, reserve: int = 0, policy: str = "round-robin-fairness-policy",
           gate: str = f"inflightRequestsThreshold: {SLOTS}", extra: str = "", slots: int = SLOTS) -> str:
    return f"""\
flowControl:
  maxNumSeqs: {slots}
  defaultPriorityBand:
    fairnessPolicyRef: {policy}
    dispatchGate: {{{gate}}}
    slotFairness: {str(fairness).lower()}
    newcomerReserve: {reserve}
{extra}"""


def enqueue(fc, flow: str, n: int, s: Scheduler, **kw) -> list:  # type: ignore[no-untyped-def]
    items = [item(request(flow, **kw), s) for _ in range(n)]
    for it in items:
        assert fc.enqueue(it) == []
    return items


def held(fc, flow: str, ep, priority: int = 0) -> int:  # type: ignore[no-untyped-def]
    return fc.slots.held(ep, (priority, flow))


# -- fair share --


@pytest.mark.parametrize("policy", ["round-robin-fairness-policy", "token-fairness-policy"])
def test_a_single_flow_still_uses_every_slot(policy: str) -> None:
    pool = Pool(1)
    fc = controller(pool, config(policy=policy))
    s = Scheduler()
    flood = enqueue(fc, "a", 20, s)
    assert dispatched(fc.dispatch()) == flood[:SLOTS]  # nobody else waits: nothing is held back
    ep = pool.endpoints[0]
    assert held(fc, "a", ep) == SLOTS
    finish(fc, flood[0])
    assert dispatched(fc.dispatch()) == [flood[SLOTS]]  # a freed slot goes straight back to the flood


@pytest.mark.parametrize("policy", ["round-robin-fairness-policy", "token-fairness-policy"])
def test_a_flood_cannot_take_the_last_slots_while_another_flow_waits(policy: str) -> None:
    pool = Pool(1)
    fc = controller(pool, config(policy=policy))
    s = Scheduler()
    flood = enqueue(fc, "a", 40, s)
    running = dispatched(fc.dispatch())
    assert len(running) == SLOTS
    other = enqueue(fc, "b", 10, s)
    # As the flood's requests finish, every freed slot goes to B until B holds its share (half):
    # round robin alone would alternate and hand A every other slot.
    for k in range(SLOTS // 2):
        finish(fc, running.pop(0))
        went = dispatched(fc.dispatch())
        assert flows_of(went) == ["b"], (k, flows_of(went))
        running += went
    ep = pool.endpoints[0]
    assert held(fc, "a", ep) == held(fc, "b", ep) == SLOTS // 2
    assert fc.passed_over >= 1
    # At equal shares nothing is held back for nothing: the band's own order takes turns again.
    order = []
    for _ in range(6):
        finish(fc, running.pop(0))
        went = dispatched(fc.dispatch())
        assert len(went) == 1
        order += flows_of(went)
        running += went
    assert set(order) == {"a", "b"}
    for it in running:
        finish(fc, it)
    while len(fc):
        for it in dispatched(fc.dispatch()):
            finish(fc, it)
    assert all(i.state.name == "DONE" for i in flood + other)
    assert_empty(fc)


def test_without_slot_fairness_round_robin_alternates_the_freed_slots() -> None:
    pool = Pool(1)
    fc = controller(pool, config(fairness=False))
    s = Scheduler()
    enqueue(fc, "a", 40, s)
    running = dispatched(fc.dispatch())
    enqueue(fc, "b", 10, s)
    got = []
    for _ in range(4):
        finish(fc, running.pop(0))
        went = dispatched(fc.dispatch())
        got += flows_of(went)
        running += went
    assert got == ["a", "b", "a", "b"]  # B reaches its share at half the speed


def test_a_flow_over_its_share_on_one_pod_goes_to_another() -> None:
    pool = Pool(2)
    fc = controller(pool, config())
    s = Scheduler()
    p0, p1 = pool.endpoints
    flood = enqueue(fc, "a", 30, s)
    first = dispatched(fc.dispatch())  # 8 on each pod
    assert held(fc, "a", p0) == held(fc, "a", p1) == SLOTS
    enqueue(fc, "b", 1, s)
    # Free a slot on each pod; B takes one, A may take the other pod's (B no longer waits).
    finish(fc, first[0])
    finish(fc, first[1])
    went = dispatched(fc.dispatch())
    assert sorted(flows_of(went)) == ["a", "b"]
    del flood


def test_slot_fairness_needs_a_policy_that_takes_turns_between_flows() -> None:
    with pytest.raises(ConfigError, match=r"defaultPriorityBand.slotFairness: needs a fairness policy"):
        flow_config(config(policy="global-strict-fairness-policy"))
    with pytest.raises(ConfigError, match=r"priorityBands\[0\].newcomerReserve: needs a fairness policy"):
        flow_config("flowControl:\n  priorityBands:\n  - {priority: 1, newcomerReserve: 2}\n")


@pytest.mark.parametrize(("text", "message"), [
    ("flowControl: {maxNumSeqs: 0}", "flowControl.maxNumSeqs: must be >= 1"),
    ("flowControl: {maxNumSeqs: many}", "flowControl.maxNumSeqs: must be an integer"),
    ("flowControl: {maxNumSeqs: 8, defaultPriorityBand: {fairnessPolicyRef: round-robin-fairness-policy, "
     "newcomerReserve: 8}}", "flowControl.defaultPriorityBand.newcomerReserve: must be below maxNumSeqs"),
    ("flowControl: {defaultPriorityBand: {newcomerReserve: -1}}", "newcomerReserve: must be >= 0"),
    ("flowControl: {defaultPriorityBand: {slotFairness: 1}}", "slotFairness: must be"),
    ("flowControl: {defaultPriorityBand: {slotFairnes: true}}", "slotFairnes"),
])
def test_slot_config_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        flow_config(text + "\n")


def test_slot_config_defaults() -> None:
    fc = flow_config()
    assert fc.max_num_seqs == 256 and not fc.default_band.slot_fairness and fc.default_band.newcomer_reserve == 0
    tuned = flow_config(config(reserve=2) + "  priorityBands:\n  - {priority: -1, newcomerReserve: 0}\n")
    assert tuned.max_num_seqs == SLOTS and tuned.band(0).newcomer_reserve == 2 and tuned.band(0).slot_fairness
    assert tuned.band(-1).newcomer_reserve == 0 and tuned.band(-1).slot_fairness  # inherits the template


# -- the newcomer reserve --


def test_the_reserve_keeps_slots_for_flows_with_nothing_running() -> None:
    pool = Pool(1)
    fc = controller(pool, config(reserve=2, slots=64, gate="inflightRequestsThreshold: 64"))
    s = Scheduler()
    e = enqueue(fc, "e", 1, s)
    assert dispatched(fc.dispatch()) == e  # another user is about: the reserve holds
    flood = enqueue(fc, "a", 80, s)
    assert len(dispatched(fc.dispatch())) == 64 - 1 - 2  # the reserve's cost, paid by the flood
    b, c, d = (enqueue(fc, f, 2, s) for f in ("b", "c", "d"))
    went = dispatched(fc.dispatch())
    assert went == [b[0], c[0]]  # one slot each to two newcomers; B's and C's second wait
    assert dispatched(fc.dispatch()) == []  # D: the pod is full
    finish(fc, flood[0])
    assert dispatched(fc.dispatch()) == [d[0]]  # D has nothing there: it may take the freed slot
    del b, c


def test_a_flow_alone_uses_every_slot_reserve_or_not() -> None:
    pool = Pool(1)
    fc = controller(pool, config(reserve=2, slots=64, gate="inflightRequestsThreshold: 64"))
    s = Scheduler()
    flood = enqueue(fc, "a", 80, s)
    assert len(dispatched(fc.dispatch())) == 64  # nobody else waits or runs: work conservation
    newcomer = enqueue(fc, "b", 1, s)
    assert dispatched(fc.dispatch()) == []  # a newcomer now waits for a slot to free
    finish(fc, flood[0])
    assert dispatched(fc.dispatch()) == newcomer  # and takes the first one (its flow's turn)


def test_a_full_pod_takes_no_more_while_another_has_a_free_slot() -> None:
    # The flood case behind `flood-short-prompts`: the one pod the gate admits is full of the
    # flood's requests, another has free slots but its gate is closed for a moment. Sent to the
    # full pod the request would wait a whole generation in its engine queue; here it waits for
    # the other pod's gate.
    pool = Pool(2)
    fc = controller(pool, config(fairness=False, gate="queueDepthThreshold: 3, inflightGuard: false"))
    s = Scheduler()
    p0, p1 = pool.endpoints
    pool.scrape(p1, waiting_queue_size=3)  # p1's gate is closed: the flood goes to p0 only
    flood = enqueue(fc, "a", SLOTS + 1, s)
    assert dispatched(fc.dispatch()) == flood[:SLOTS]
    assert held(fc, "a", p0) == SLOTS and held(fc, "a", p1) == 0
    assert dispatched(fc.dispatch()) == []  # p0 is full and p1 has room: the last one waits here
    pool.scrape(p1, waiting_queue_size=0)
    went = dispatched(fc.dispatch())
    assert went == [flood[SLOTS]] and went[0].endpoint is p1
    for it in flood:
        finish(fc, it)
    assert_empty(fc)


def test_with_every_pod_full_a_request_still_goes() -> None:
    # The configured slots may be too low (vLLM does not export `max_num_seqs`): when no pod has a
    # free slot by our count, the request goes, and the pod shows what it really runs.
    pool = Pool(2)
    fc = controller(pool, config(fairness=False, gate="inflightRequestsThreshold: 100"))
    s = Scheduler()
    flood = enqueue(fc, "a", 2 * SLOTS + 2, s)
    assert len(dispatched(fc.dispatch())) == 2 * SLOTS + 2
    for it in flood:
        finish(fc, it)
    assert_empty(fc)


def test_a_newcomer_passes_a_closed_queue_gate_into_the_reserve() -> None:
    pool = Pool(2)
    fc = controller(pool, config(reserve=1, gate="queueDepthThreshold: 3", slots=64))
    s = Scheduler()
    p0, p1 = pool.endpoints
    flood = enqueue(fc, "a", 10, s)
    dispatched(fc.dispatch())
    for ep in pool.endpoints:
        pool.scrape(ep, waiting_queue_size=3)  # both engine queues at the band's threshold
    assert dispatched(fc.dispatch()) == []
    b = enqueue(fc, "b", 2, s)
    c, d = enqueue(fc, "c", 1, s), enqueue(fc, "d", 1, s)
    went = dispatched(fc.dispatch())
    assert went == [b[0], c[0]]  # one reserve slot per pod; B's second request is no newcomer any more
    assert {i.endpoint for i in went} == {p0, p1} and all(i.reserved for i in went)
    assert fc.reserve_dispatches == 2 and fc.slots.of(p0).reserved == 1
    finish(fc, b[0])
    went = dispatched(fc.dispatch())
    assert went == [d[0]] and d[0].reserved  # B's reserve slot came free; D had nothing there
    assert fc.slots.of(b[0].endpoint).reserved == 1
    del flood


def test_a_pod_of_few_slots_keeps_no_reserve_a_lone_flood_could_not_use() -> None:
    pool = Pool(1)
    fc = controller(pool, config(reserve=2))  # 8 slots: a reserve of 2 would idle a quarter of them
    s = Scheduler()
    enqueue(fc, "a", 20, s)
    assert len(dispatched(fc.dispatch())) == SLOTS
    assert fc.slots.reserve(pool.endpoints[0], 2) == 0 and fc.slots.reserve(pool.endpoints[0], 0) == 0


def test_the_reserve_never_passes_saturation() -> None:
    pool = Pool(1)
    fc = controller(pool, config(reserve=2, gate="queueDepthThreshold: 3"))
    pool.scrape(pool.endpoints[0], waiting_queue_size=5)  # the detector's default threshold: saturated
    s = Scheduler()
    enqueue(fc, "b", 1, s)
    assert dispatched(fc.dispatch()) == []


# -- vLLM priority: the flow's depth on the chosen endpoint --


def test_vllm_priority_counts_the_flows_requests_on_that_endpoint() -> None:
    pool = Pool(2)
    fc = controller(pool, "flowControl:\n  vllmPriority: {enabled: true, bandStride: 100}\n")
    s = Scheduler()
    a = enqueue(fc, "a", 5, s)
    fc.dispatch()
    p0, p1 = pool.endpoints
    numbers = {(it.endpoint.name, it.engine_priority) for it in a}
    # The scheduler alternates pods: A's first on each pod is 0, its second 1, its third 2.
    assert numbers == {("pod-0", 0), ("pod-1", 0), ("pod-0", 1), ("pod-1", 1), ("pod-0", 2)}
    newcomer = enqueue(fc, "b", 1, s)[0]
    fc.dispatch()
    assert newcomer.engine_priority == 0  # ahead of every A request waiting on its pod but A's first
    vip, batch = enqueue(fc, "a", 1, s, priority=3)[0], enqueue(fc, "a", 1, s, priority=-1)[0]
    fc.dispatch()
    assert vip.engine_priority == -300 and batch.engine_priority == 100  # a new band: a new flow
    for it in a[:3]:
        finish(fc, it)
    again = enqueue(fc, "a", 1, s)[0]
    fc.dispatch()
    assert again.engine_priority == held(fc, "a", again.endpoint) - 1  # its depth where it went


def test_vllm_priority_depth_is_capped_below_the_next_band() -> None:
    pool = Pool(1)
    fc = controller(pool, "flowControl:\n  vllmPriority: {enabled: true, bandStride: 4}\n")
    s = Scheduler()
    a = enqueue(fc, "a", 6, s)
    b = enqueue(fc, "b", 1, s, priority=-1)[0]
    fc.dispatch()
    assert [it.engine_priority for it in a] == [0, 1, 2, 3, 3, 3]  # never as late as the band below
    assert b.engine_priority == 4


# -- the slot count --


def test_slots_are_configured_and_raised_by_what_a_pod_shows_running() -> None:
    pool = Pool(2)
    fc = controller(pool, config())
    p0, p1 = pool.endpoints
    pool.scrape(p0, running_requests=12)
    # A scrape with a value out of bounds is not taken (the data layer keeps the last valid one).
    p1.metrics_valid = False
    enqueue(fc, "a", 1, Scheduler())
    fc.dispatch()
    assert fc.slots.slots(p0) == 12 and fc.slots.slots(p1) == SLOTS
    pool.scrape(p0, running_requests=3)
    fc.dispatch()
    assert fc.slots.slots(p0) == 12  # a lower bound: fewer running later proves nothing


def test_a_pod_full_with_requests_waiting_for_a_slot_shows_fewer_slots_than_configured() -> None:
    pool = Pool(1)
    ledger = SlotLedger(256)
    ep = pool.endpoints[0]
    for step in range(3):  # the engine moving on between scrapes (its KV use grows)
        pool.scrape(ep, running_requests=8, waiting_queue_size=5, kv_cache_usage=0.3 + step * 0.01)
    assert ledger.slots(ep) == 8


def test_a_learned_slot_count_is_bounded() -> None:
    pool = Pool(1)
    ledger = SlotLedger(8)
    ep = pool.endpoints[0]
    pool.scrape(ep, running_requests=999_999)
    assert ledger.slots(ep) == MAX_SLOTS


def test_the_ledger_forgets_what_ended() -> None:
    pool = Pool(1)
    ledger = SlotLedger(8)
    ep = pool.endpoints[0]
    assert ledger.add(ep, (0, "a")) == 0 and ledger.add(ep, (0, "a"), reserved=True) == 1
    ledger.remove(ep, (0, "a"))
    ledger.remove(ep, (0, "a"), reserved=True)
    ledger.remove(ep, (0, "a"))  # once too often: no negative counts
    assert len(ledger) == 0 and ledger.of(ep).by_flow == {} and ledger.of(ep).reserved == 0
