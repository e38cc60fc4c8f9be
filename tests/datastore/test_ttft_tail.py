"""The pool's running TTFT tail: where it settles, how fast it follows, what it ignores."""

from __future__ import annotations

import math
import random

import pytest

from epp.datastore.ttft_tail import TtftTail


def beyond_share(tail: TtftTail, samples: list[float]) -> float:
    return sum(1 for x in samples if x > tail.seconds) / len(samples)


@pytest.mark.parametrize("quantile", [0.9, 0.99])
def test_it_settles_where_the_share_beyond_it_is_one_minus_its_quantile(quantile: float) -> None:
    rng = random.Random(7)
    tail = TtftTail(quantile=quantile)
    for _ in range(20_000):
        tail.observe(rng.lognormvariate(math.log(0.05), 0.8))
    fresh = [rng.lognormvariate(math.log(0.05), 0.8) for _ in range(20_000)]
    assert beyond_share(tail, fresh) == pytest.approx(1.0 - quantile, abs=0.35 * (1.0 - quantile))


def test_it_follows_a_pool_that_slows_down_in_a_few_hundred_first_tokens() -> None:
    rng = random.Random(3)
    tail = TtftTail()
    for _ in range(2_000):
        tail.observe(rng.expovariate(1 / 0.05))
    before = tail.seconds
    for _ in range(600):
        tail.observe(rng.expovariate(1 / 5.0))  # a hundred times slower: an overload
    assert tail.seconds > 50 * before
    assert beyond_share(tail, [rng.expovariate(1 / 5.0) for _ in range(5_000)]) < 0.3


def test_it_says_whether_a_first_token_was_beyond_it_and_ignores_what_is_not_a_time() -> None:
    tail = TtftTail()
    assert tail.observe(0.2) is False and tail.seconds == 0.2  # the first one seeds it
    assert tail.observe(0.5) is True and tail.seconds > 0.2
    assert tail.observe(0.01) is False
    settled = tail.seconds
    for bad in (0.0, -1.0, math.nan, math.inf):
        assert tail.observe(bad) is False
    assert tail.seconds == settled
