"""What the EPP learns per model: output lengths, with `max_tokens` read as a length or a limit as
the model's clients turn out to use it."""

from __future__ import annotations

import random

from epp.datastore.model_stats import DEFAULT_OUTPUT_TOKENS, ModelStats


def test_without_samples_max_tokens_is_the_expectation() -> None:
    stats = ModelStats()
    assert stats.expected_output(300) == 300
    assert stats.expected_output(None) == int(DEFAULT_OUTPUT_TOKENS)


def test_clients_that_send_the_length_get_it_back() -> None:
    """Benchmarks and `ignore_eos` clients: every response runs to its max_tokens, and lengths
    differ a lot (16-token answers beside 800-token essays): the mean would serve neither."""
    stats = ModelStats()
    rng = random.Random(1)
    for _ in range(200):
        n = rng.choice([rng.randint(16, 48), rng.randint(400, 800)])
        stats.observe(400, 100, n, max_tokens=n)
    assert stats.at_limit > 0.99
    assert stats.expected_output(20) == 20
    assert stats.expected_output(700) == 700


def test_generous_limits_give_the_natural_length() -> None:
    stats = ModelStats()
    rng = random.Random(2)
    for _ in range(400):
        stats.observe(400, 100, rng.randint(100, 300), max_tokens=4096)
    assert stats.at_limit < 0.05
    assert 180 <= stats.expected_output(4096) <= 230
    assert stats.expected_output(50) == 50  # a limit below the natural length still caps it


def test_a_share_that_runs_to_the_limit_is_counted() -> None:
    """5% of the responses hit a 2,000-token cap, the rest stop near 200: the expectation is the
    mixture, not the mean of the ones that stopped."""
    stats = ModelStats()
    rng = random.Random(3)
    for _ in range(2000):
        if rng.random() < 0.05:
            stats.observe(400, 100, 2000, max_tokens=2000)
        else:
            stats.observe(400, 100, rng.randint(150, 250), max_tokens=2000)
    expected = stats.expected_output(2000)
    assert 0.03 < stats.at_limit < 0.08
    assert 240 < expected < 420  # 0.05 × 2000 + 0.95 × 200 = 290


def test_requests_without_max_tokens_teach_the_natural_length() -> None:
    stats = ModelStats()
    for _ in range(50):
        stats.observe(400, 100, 120)
    assert stats.expected_output(None) == 120
    assert stats.expected_output(1000) == 1000  # nothing yet says how this model's clients use it


def test_each_objective_learns_its_own_lengths_once_it_has_responses() -> None:
    """Interactive chat beside batch jobs ten times as long, one model: a batch request expects
    the batch's length, a chat request the chat's, and an objective with too few responses yet
    (or none named) the model's."""
    stats = ModelStats()
    rng = random.Random(4)
    for _ in range(300):
        stats.observe(400, 100, rng.randint(100, 200), max_tokens=2048, objective="chat")
        stats.observe(400, 100, rng.randint(900, 1100), max_tokens=2048, objective="batch")
    assert 130 <= stats.expected_output(2048, "chat") <= 170
    assert 950 <= stats.expected_output(2048, "batch") <= 1050
    mixed = stats.expected_output(2048)
    assert 400 <= mixed <= 700  # the model's: both classes
    assert stats.expected_output(2048, "new") == mixed
    for _ in range(7):
        stats.observe(400, 100, 50, max_tokens=2048, objective="new")
    assert stats.expected_output(2048, "new") == stats.expected_output(2048)  # 7 < 8 responses
    stats.observe(400, 100, 50, max_tokens=2048, objective="new")
    assert stats.expected_output(2048, "new") == 50
    assert stats.length_certainty(2048, "batch") < 0.05


def test_objectives_tracked_per_model_are_bounded() -> None:
    from epp.datastore.model_stats import _MAX_OBJECTIVES

    stats = ModelStats()
    for i in range(_MAX_OBJECTIVES + 10):
        for _ in range(10):
            stats.observe(400, 100, 10 + i, objective=f"o{i}")
    assert len(stats.by_objective) == _MAX_OBJECTIVES
    assert stats.expected_output(None, f"o{_MAX_OBJECTIVES + 5}") == stats.expected_output(None)


def test_only_objectives_the_pool_has_are_keys() -> None:
    from epp.datastore import Datastore

    store = Datastore()
    store.set_objective("batch", -1)
    store.set_objective("standard", None)
    assert store.known_objective("batch") == "batch"
    assert store.known_objective("standard") == "standard"
    assert store.known_objective("made-up-by-a-client") == ""
    assert store.known_objective("") == ""
