"""`queuedTokensThreshold`: the dispatch gate bounds the prompt tokens an engine has still to
prefill, from the EPP's own ledger, not the number of requests, so short prompts are not
throttled like long ones, and it reopens when the ledger's timeline says so, not a scrape later."""

from __future__ import annotations

import math

from epp.flowcontrol.gate import DEFAULT_PROMPT_TOKENS, RecentDispatches

from .helpers import Pool, Scheduler, controller, dispatched, item, request

GATE = """\
flowControl:
  defaultPriorityBand:
    dispatchGate: {queuedTokensThreshold: 2000}
"""


def tokens(n: int) -> str:
    return "x" * (4 * n)  # 4 characters a token


def test_the_gate_counts_the_prefill_in_the_ledger() -> None:
    pool = Pool(1)
    fc = controller(pool, GATE)
    s = Scheduler(clock=pool.clock)
    for _ in range(5):
        fc.enqueue(item(request("a", prompt=tokens(1500)), s))
    assert len(dispatched(fc.dispatch())) == 2  # 0 < 2000, 1500 < 2000, then 3000: closed
    # A request-count threshold low enough for those would throttle short prompts as hard.
    other_pool = Pool(1)
    other = controller(other_pool, GATE)
    short = Scheduler(clock=other_pool.clock)
    for _ in range(40):
        other.enqueue(item(request("b", prompt=tokens(100)), short))
    assert len(dispatched(other.dispatch())) == 20  # twenty 100-token prompts fit below 2,000


def test_the_gate_reopens_on_the_ledgers_timeline_without_a_scrape() -> None:
    pool = Pool(1)
    fc = controller(pool, GATE)
    s = Scheduler(clock=pool.clock, prefill_seconds=1.0)
    for _ in range(4):
        fc.enqueue(item(request("a", prompt=tokens(1500)), s))
    assert len(dispatched(fc.dispatch())) == 2  # 3,000 tokens to do: the first ends in 1 s, the second in 2 s
    reopens = fc.next_reopening()
    # Below 2,000 once 1,000 of the first one's 1,500 are done: two thirds into its second.
    assert math.isclose(reopens - s.booked[0].dispatched, 2 / 3, rel_tol=1e-3)
    pool.clock.now = reopens - 0.01
    assert dispatched(fc.dispatch()) == []
    pool.clock.now = reopens + 1e-6
    assert len(dispatched(fc.dispatch())) == 1
    assert fc.next_reopening() > pool.clock.now


def test_a_first_byte_ends_a_prefill_early() -> None:
    pool = Pool(1)
    ep = pool.endpoints[0]
    fc = controller(pool, GATE)
    s = Scheduler(clock=pool.clock, prefill_seconds=10.0)
    for _ in range(3):
        fc.enqueue(item(request("a", prompt=tokens(1500)), s))
    assert len(dispatched(fc.dispatch())) == 2
    pool.clock.advance(0.2)
    assert dispatched(fc.dispatch()) == []
    ep.load.first_byte(s.booked[0], pool.clock())  # the pod was faster than predicted
    assert len(dispatched(fc.dispatch())) == 1


def test_waiting_requests_the_ledger_did_not_send_count_at_the_endpoints_mean_prompt() -> None:
    recent = RecentDispatches()
    pool = Pool(1)
    ep = pool.endpoints[0]
    assert recent.queued_tokens(ep, pool.clock()) == 0.0
    pool.scrape(ep, waiting_queue_size=2)  # another replica's or client's requests
    assert recent.queued_tokens(ep, pool.clock()) == 2 * DEFAULT_PROMPT_TOKENS  # before we sent it anything
    recent.add(ep, 3000)
    assert recent.queued_tokens(ep, pool.clock()) == 2 * 3000  # at the mean of what we send it


def test_scraped_waiting_the_ledger_explains_is_not_counted_twice() -> None:
    pool = Pool(1)
    ep = pool.endpoints[0]
    fc = controller(pool, GATE)
    s = Scheduler(clock=pool.clock)
    for _ in range(6):
        fc.enqueue(item(request("a", prompt=tokens(900)), s))
    assert len(dispatched(fc.dispatch())) == 3  # 0, 900, 1,800 < 2,000
    pool.scrape(ep, waiting_queue_size=2)  # two of ours wait: the ledger holds them already
    assert fc._recent.unexplained_tokens(ep) == 0.0
    assert dispatched(fc.dispatch()) == []
    pool.scrape(ep, waiting_queue_size=4)  # and two more we did not send
    assert fc._recent.unexplained_tokens(ep) > 0.0


def test_a_prefix_the_chosen_pod_holds_does_not_count() -> None:
    """A chat turn over a cached history queues its new tokens only (the cycle's PrefixMatch)."""
    pool = Pool(1)
    ep = pool.endpoints[0]
    fc = controller(pool, GATE)
    s = Scheduler(clock=pool.clock, prefix={ep.address: 1800})  # 1,800 of 1,900 tokens held
    for _ in range(30):
        fc.enqueue(item(request("a", prompt=tokens(1900)), s))
    assert len(dispatched(fc.dispatch())) == 20  # 100 new tokens each: twenty fit below 2,000
