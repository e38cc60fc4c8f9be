"""A pod's batch limit learned from its scrapes (vLLM does not export `max_num_seqs`)."""

from __future__ import annotations

from epp.datastore.batch_limit import CONFIRM, BatchLimit

BUDGET = 8192


def test_requests_waiting_for_a_slot_reveal_the_limit() -> None:
    limit = BatchLimit()
    for running in (3, 6, 8):
        limit.observe(running, 0, 0.2, 0, BUDGET)
    assert limit.limit(256) == 256  # nothing waits: the configured value (never below 8)
    for _ in range(CONFIRM):
        limit.observe(8, 4, 0.2, 1200, BUDGET)  # 8 run, 4 wait, KV has room, no big prefill
    assert limit.limit(256) == 8


def test_waiting_for_kv_blocks_or_a_full_token_budget_is_not_a_slot_limit() -> None:
    limit = BatchLimit()
    for _ in range(10):
        limit.observe(5, 3, 0.95, 0, BUDGET)  # the KV cache is full
        limit.observe(5, 3, 0.3, 16000, BUDGET)  # a 16k-token prompt fills every step's budget
    assert limit.limit(256) == 256


def test_a_pod_seen_running_more_starts_again() -> None:
    limit = BatchLimit()
    for _ in range(CONFIRM):
        limit.observe(8, 2, 0.2, 0, BUDGET)
    assert limit.limit(256) == 8
    limit.observe(12, 0, 0.2, 0, BUDGET)  # restarted with more slots
    assert limit.limit(256) == 256
    assert limit.limit(4) == 12  # never below what it was seen running
