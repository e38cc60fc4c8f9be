"""`queuedTokensThreshold`: the dispatch gate bounds the prompt tokens waiting in an engine's queue,
not the number of requests, so short prompts are not throttled like long ones."""

from __future__ import annotations

from epp.flowcontrol.gate import DEFAULT_PROMPT_TOKENS, RecentDispatches
from epp.scheduling.prefix_match import PrefixMatch

from .helpers import Pool, Scheduler, controller, dispatched, item, request

GATE = """\
flowControl:
  defaultPriorityBand:
    dispatchGate: {queuedTokensThreshold: 2000}
"""


def tokens(n: int) -> str:
    return "x" * (4 * n)  # 4 characters a token


def test_the_gate_counts_prompt_tokens_sent_since_the_scrape() -> None:
    pool = Pool(1)
    fc = controller(pool, GATE)
    s = Scheduler()
    long = [item(request("a", prompt=tokens(1500)), s) for _ in range(5)]
    for it in long:
        fc.enqueue(it)
    assert len(dispatched(fc.dispatch())) == 2  # 0 < 2000, 1500 < 2000, then 3000: closed
    # A request-count threshold low enough for those would throttle short prompts as hard.
    other = controller(Pool(1), GATE)
    for _ in range(40):
        other.enqueue(item(request("b", prompt=tokens(100)), s))
    assert len(dispatched(other.dispatch())) == 20  # twenty 100-token prompts fit below 2,000


def test_scraped_waiting_requests_count_at_the_endpoints_mean_prompt() -> None:
    pool = Pool(1)
    ep = pool.endpoints[0]
    fc = controller(pool, GATE)
    s = Scheduler()
    for _ in range(6):
        fc.enqueue(item(request("a", prompt=tokens(1000)), s))
    assert len(dispatched(fc.dispatch())) == 2
    pool.scrape(ep, waiting_queue_size=1)  # one of them still waits: ~1,000 tokens
    assert len(dispatched(fc.dispatch())) == 1  # 1000 < 2000 -> one more, then 2000: closed
    pool.scrape(ep, waiting_queue_size=2)
    assert dispatched(fc.dispatch()) == []


def test_without_the_guard_only_the_scrape_counts() -> None:
    recent = RecentDispatches()
    pool = Pool(1)
    ep = pool.endpoints[0]
    assert recent.queued_tokens(ep) == 0.0
    pool.scrape(ep, waiting_queue_size=2)
    assert recent.queued_tokens(ep) == 2 * DEFAULT_PROMPT_TOKENS  # before we sent it anything
    recent.add(ep, 3000)
    assert recent.queued_tokens(ep, guard=False) == 2 * 3000
    assert recent.queued_tokens(ep) == 2 * 3000 + 3000
    pool.scrape(ep, waiting_queue_size=0)
    assert recent.queued_tokens(ep) == 0.0  # a newer scrape already includes what we sent


def test_a_prefix_the_chosen_pod_holds_does_not_count() -> None:
    """A chat turn over a cached history queues its new tokens only (the cycle's PrefixMatch)."""
    pool = Pool(1)
    ep = pool.endpoints[0]
    fc = controller(pool, GATE)

    def cached(req, candidates):  # type: ignore[no-untyped-def]
        result = Scheduler()(req, candidates)
        result.cycle.data["approx-prefix-cache-producer"] = PrefixMatch(
            total=19, block_size_tokens=100, matched={ep.address: 18})  # 1,800 of 1,900 tokens held
        return result

    for _ in range(30):
        fc.enqueue(item(request("a", prompt=tokens(1900)), cached))  # type: ignore[arg-type]
    assert len(dispatched(fc.dispatch())) == 20  # 100 new tokens each: twenty fit below 2,000
