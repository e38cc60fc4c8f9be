"""What the EPP learns per model: output lengths, with `max_tokens` read as a length or a limit as
the model's clients turn out to use it."""

from __future__ import annotations

import random

from epp.datastore.model_stats import DEFAULT_OUTPUT_TOKENS, ModelStats, ModelStatsTable


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


def test_the_engines_longest_sequence_bounds_the_expectation() -> None:
    """vLLM stops an output at max_model_len, whatever the request's max_tokens: `room` (what the
    longest sequence leaves after the prompt) bounds it, read as the limit that binds."""
    stats = ModelStats()
    assert stats.expected_output(1 << 20, room=700) == 700
    assert stats.expected_output(300, room=700) == 300
    assert stats.expected_output(None, room=100) == 100  # the learned mean (256), cut
    rng = random.Random(4)
    for _ in range(400):  # a third of the responses run to their limit
        n = rng.randint(100, 300)
        stats.observe(400, 100, 4096 if rng.random() < 1 / 3 else n, max_tokens=4096)
    assert stats.expected_output(1 << 20) > 300_000  # the share at the limit times 2^20
    assert stats.expected_output(1 << 20, room=4096) == stats.expected_output(4096)


def test_output_lengths_are_learned_per_flow() -> None:
    """One model, two flows whose answers differ by ten times: each flow expects its own length
    once it has enough responses; before that, and for a flow never seen, the model's mean."""
    table = ModelStatsTable()
    assert table.output_stats("m", "batch") is table.get("m")
    for i in range(7):
        table.observe("m", "chat", 400, 100, 100, max_tokens=1024)
        table.observe("m", "batch", 400, 100, 1000, max_tokens=2048)
    assert table.output_stats("m", "batch") is table.get("m")  # 7 responses: not yet trusted
    for _ in range(200):
        table.observe("m", "chat", 400, 100, 100, max_tokens=1024)
        table.observe("m", "batch", 400, 100, 1000, max_tokens=2048)
    assert table.output_stats("m", "chat").expected_output(1024) == 100
    assert table.output_stats("m", "batch").expected_output(2048) == 1000
    assert 300 < table.output_stats("m", "new-tenant").expected_output(2048) < 800  # the model's mixture
    assert table.output_stats("other-model", "batch") is table.get("other-model")


def test_the_flow_table_is_bounded() -> None:
    """Flow IDs come from clients: a client cycling through them cannot grow the table."""
    table = ModelStatsTable()
    for i in range(5000):
        table.observe("m", f"tenant-{i}", 400, 100, 50)
    assert table.flows() == 4096
    assert len(table) == 1
    long_id = "x" * 60_000  # as long as Envoy lets a header be: its responses teach the model only
    for _ in range(20):
        table.observe("m", long_id, 400, 100, 900)
    assert table.flows() == 4096
    assert table.output_stats("m", long_id) is table.get("m")
