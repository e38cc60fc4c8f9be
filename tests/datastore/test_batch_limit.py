"""A pod's batch limit learned from its scrapes (vLLM does not export `max_num_seqs`)."""

from __future__ import annotations

from epp.datastore import Endpoint, EndpointMetrics, EndpointSpec, Outstanding
from epp.datastore.batch_limit import CONFIRM, BatchLimit

BUDGET = 8192


class Scraped:
    """A pod's limit fed scrapes; each shows a new engine state (its KV use moved) unless `same`."""

    def __init__(self) -> None:
        self.limit = BatchLimit()
        self._kv = 0.2

    def __call__(self, running: int, waiting: int, kv: float | None = None, backlog: int = 0,
                 same: bool = False, recent: int = 0) -> None:
        if not same:
            self._kv += 1e-4
        self.limit.observe(running, waiting, self._kv if kv is None else kv, backlog, BUDGET, recent)


def test_requests_waiting_for_a_slot_reveal_the_limit() -> None:
    scrape = Scraped()
    for running in (3, 6, 8):
        scrape(running, 0)
    assert scrape.limit.limit(256) == 256  # nothing waits: the configured value (never below 8)
    for _ in range(CONFIRM):
        scrape(8, 4, backlog=1200)  # 8 run, 4 wait, KV has room, no big prefill
    assert scrape.limit.limit(256) == 8


def test_scrapes_of_one_engine_state_count_once() -> None:
    scrape = Scraped()
    scrape(8, 4)
    for _ in range(10):  # a slow step outlasts the scrapes: nothing moved
        scrape(8, 4, same=True)
    assert scrape.limit.limit(256) == 256
    for _ in range(CONFIRM - 1):
        scrape(8, 4)
    assert scrape.limit.limit(256) == 8


def test_waiting_for_kv_blocks_or_a_full_token_budget_is_not_a_slot_limit() -> None:
    scrape = Scraped()
    for i in range(10):
        scrape(5, 3, kv=0.95 + i * 1e-3)  # the KV cache is full
        scrape(5, 3, backlog=16000)  # a 16k-token prompt fills every step's budget
    assert scrape.limit.limit(256) == 256


def test_a_pod_seen_running_more_starts_again() -> None:
    scrape = Scraped()
    for _ in range(CONFIRM):
        scrape(8, 2)
    assert scrape.limit.limit(256) == 8
    scrape(12, 0)  # restarted with more slots
    assert scrape.limit.limit(256) == 256
    assert scrape.limit.limit(4) == 12  # never below what it was seen running


def test_a_busy_pods_passing_queue_is_no_limit() -> None:
    scrape = Scraped()
    scrape(164, 0)
    for _ in range(20):  # requests that arrived since the last step, admitted at the next
        scrape(164, 2)
        scrape(164, 2)
        scrape(160, 0)
    assert scrape.limit.limit(256) == 256


def test_a_limit_once_seen_is_kept_until_the_pod_runs_more() -> None:
    scrape = Scraped()
    for _ in range(CONFIRM):
        scrape(8, 3)
    scrape(5, 0)
    scrape(6, 2)
    assert scrape.limit.limit(256) == 8


def test_requests_sent_within_the_last_steps_are_not_waiting_for_a_slot() -> None:
    """A pod under heavy traffic shows, at almost every scrape, the requests the EPP sent it during
    its last step, admitted at the next: three scrapes in a row at its most running once made a
    256-slot pod's limit 62. Waiting beyond those is waiting for a slot."""
    scrape = Scraped()
    for _ in range(10):
        scrape(62, 2, recent=2)
        scrape(62, 1, recent=3)
    assert scrape.limit.limit(256) == 256
    for _ in range(CONFIRM):
        scrape(62, 5, recent=2)  # three more than just arrived, scrape after scrape
    assert scrape.limit.limit(256) == 62


def test_the_endpoint_counts_what_it_sent_in_the_last_two_steps_as_just_arrived() -> None:
    """`Endpoint.update_metrics` passes the ledger's requests picked within two of the pod's steps
    of the scrape, without a first byte yet (the gauges are the last step's end), as `recent`."""
    ep = Endpoint(EndpointSpec(name="pod", ip="10.0.0.1", port=8000))
    ep.load.step_seconds = 0.02
    ep.load.add(Outstanding(100, 0, 50, 99.0, predicted_ttft=0.01), 99.0)  # long before: blocked if waiting
    for t in range(CONFIRM):
        now = 100.0 + t
        ep.load.add(Outstanding(100, 0, 50, now - 0.01, predicted_ttft=0.01), now - 0.01)  # in the race
        ep.update_metrics(EndpointMetrics(running_requests=8, waiting_queue_size=t + 1, kv_cache_usage=0.1 + t * 0.01,
                                          update_time=now))
    # waiting 1, 2, 3 against 1, 1, 1 just sent: only the last two are beyond the race
    assert not ep.batch_limit.taken and ep.load.sent_since(102.0 - 0.04) == 1
    ep.load.add(Outstanding(100, 0, 50, 102.5, predicted_ttft=0.01), 102.5)
    ep.update_metrics(EndpointMetrics(running_requests=8, waiting_queue_size=4, kv_cache_usage=0.2, update_time=103.0))
    assert ep.batch_limit.taken and ep.batch_limit.limit(256) == 8
