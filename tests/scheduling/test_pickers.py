"""Pickers: max-score with random tie-break, random, weighted random (A-Res)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from epp.params import ConfigError, Params
from epp.datastore import Datastore
from epp.scheduling.plugins.max_score_picker import MaxScorePicker
from epp.scheduling.plugins.random_picker import RandomPicker
from epp.scheduling.plugins.weighted_random_picker import WeightedRandomPicker
from epp.plugin import PluginContext

from .helpers import cycle, endpoint, request

EPS = [endpoint(f"10.0.0.{i}") for i in range(1, 5)]


def test_max_score_picks_highest() -> None:
    picker = MaxScorePicker(rng=random.Random(1))
    scored = [(EPS[0], 0.2), (EPS[1], 0.9), (EPS[2], 0.5)]
    assert picker.pick(cycle(), request(), scored) == [EPS[1]]


def test_max_score_returns_fallbacks_in_score_order() -> None:
    picker = MaxScorePicker(max_endpoints=3, rng=random.Random(1))
    scored = [(EPS[0], 0.2), (EPS[1], 0.9), (EPS[2], 0.5), (EPS[3], 0.1)]
    assert picker.pick(cycle(), request(), scored) == [EPS[1], EPS[2], EPS[0]]


def test_max_score_breaks_ties_uniformly_at_random() -> None:
    picker = MaxScorePicker(rng=random.Random(42))
    scored = [(EPS[0], 1.0), (EPS[1], 1.0), (EPS[2], 1.0), (EPS[3], 0.5)]
    counts = Counter(picker.pick(cycle(), request(), scored)[0].address for _ in range(3000))
    assert set(counts) == {EPS[0].address, EPS[1].address, EPS[2].address}
    assert all(800 < n < 1200 for n in counts.values()), counts


def test_seeded_pickers_are_reproducible() -> None:
    scored = [(ep, 1.0) for ep in EPS]
    a = [MaxScorePicker(rng=random.Random(7)).pick(cycle(), request(), scored)[0] for _ in range(5)]
    b = [MaxScorePicker(rng=random.Random(7)).pick(cycle(), request(), scored)[0] for _ in range(5)]
    assert a == b


def test_random_picker_takes_distinct_endpoints() -> None:
    picker = RandomPicker(max_endpoints=3, rng=random.Random(3))
    picked = picker.pick(cycle(), request(), [(ep, 0.0) for ep in EPS])
    assert len(picked) == 3 and len(set(map(id, picked))) == 3
    assert len(RandomPicker(max_endpoints=10).pick(cycle(), request(), [(EPS[0], 1.0)])) == 1


def test_weighted_random_never_picks_zero_when_positive_exists() -> None:
    picker = WeightedRandomPicker(rng=random.Random(5))
    scored = [(EPS[0], 0.0), (EPS[1], 0.01), (EPS[2], 0.0)]
    assert all(picker.pick(cycle(), request(), scored) == [EPS[1]] for _ in range(200))


def test_weighted_random_is_proportional_to_score() -> None:
    picker = WeightedRandomPicker(rng=random.Random(11))
    scored = [(EPS[0], 3.0), (EPS[1], 1.0)]
    counts = Counter(picker.pick(cycle(), request(), scored)[0].address for _ in range(4000))
    share = counts[EPS[0].address] / 4000
    assert 0.71 < share < 0.79, share


def test_weighted_random_all_zero_is_uniform() -> None:
    picker = WeightedRandomPicker(rng=random.Random(13))
    scored = [(ep, 0.0) for ep in EPS]
    counts = Counter(picker.pick(cycle(), request(), scored)[0].address for _ in range(4000))
    assert len(counts) == 4 and all(800 < n < 1200 for n in counts.values()), counts


def test_weighted_random_zero_scores_fill_after_positive() -> None:
    picker = WeightedRandomPicker(max_endpoints=3, rng=random.Random(2))
    picked = picker.pick(cycle(), request(), [(EPS[0], 0.0), (EPS[1], 0.5), (EPS[2], 0.0)])
    assert picked[0] is EPS[1] and len(picked) == 3


@pytest.mark.parametrize("cls", [MaxScorePicker, RandomPicker, WeightedRandomPicker])
def test_picker_config(cls: type[MaxScorePicker]) -> None:
    ctx = PluginContext(datastore=Datastore())
    assert cls.from_config("p", Params(None, "x"), ctx).max_endpoints == 1
    assert cls.from_config("p", Params({"maxNumOfEndpoints": 2}, "x"), ctx).max_endpoints == 2
    with pytest.raises(ConfigError, match=r"^x\.maxNumOfEndpoints: must be >= 1"):
        cls.from_config("p", Params({"maxNumOfEndpoints": 0}, "x"), ctx)
    with pytest.raises(ConfigError, match=r"^x\.maxNumOfEndpoints: must be an integer"):
        cls.from_config("p", Params({"maxNumOfEndpoints": "2"}, "x"), ctx)
    with pytest.raises(ConfigError, match=r"^x\.seed: unknown field"):
        cls.from_config("p", Params({"seed": 1}, "x"), ctx)
