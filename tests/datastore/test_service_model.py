"""The online service model of a pod: it starts from a sane prior, converges to what the pod
really charges, survives outliers and says nothing silly about an idle pod."""

from __future__ import annotations

import math
import random

import pytest

from epp.datastore import ServiceModel, StepCosts


def synthetic_pod(step_scale: float, prefill_scale: float, rng: random.Random, model: ServiceModel,
                  n: int, noise: float = 0.05) -> None:
    """Feed `n` TTFT and ITL observations of a pod whose true costs are the prior's times the scales."""
    for _ in range(n):
        queued = rng.choice([0, 0, 200, 1500, 6000, 20000])
        own = rng.randint(16, 4000)
        decoding = rng.randint(0, 200)
        context = decoding * rng.randint(200, 4000)
        estimate = model.ttft(queued + own, own * own * 0.5, decoding, context)
        true = step_scale * estimate.step_feature + prefill_scale * estimate.prefill_feature
        model.observe(estimate.step_feature, estimate.prefill_feature, true * (1 + rng.gauss(0, noise)))
        step, prefill = model.itl_features(decoding + 1, context, rng.choice([0, 0, 500]))
        true_itl = step_scale * step + prefill_scale * prefill
        model.observe(step, prefill, true_itl * (1 + rng.gauss(0, noise)))


def test_the_prior_is_an_h100_8b_until_told_otherwise() -> None:
    model = ServiceModel()
    assert model.step_scale == 1.0 and model.prefill_scale == 1.0
    # A lone 2048-token prompt on an idle pod: ~one step plus its prefill (shared/calibration).
    assert 0.04 < model.ttft(2048, 2048 * 1024, 0, 0).seconds < 0.07
    assert model.prefill_rate(0, 0) > 20_000  # tokens/s
    assert 0.006 < model.step_seconds(64, 64 * 1000) < 0.012


@pytest.mark.parametrize("scales", [(1.0, 1.0), (2.7, 3.1), (0.6, 1.8), (4.0, 0.9)])
def test_converges_on_synthetic_data(scales: tuple[float, float]) -> None:
    model = ServiceModel()
    synthetic_pod(*scales, random.Random(1), model, 400)
    assert model.step_scale == pytest.approx(scales[0], rel=0.1)
    assert model.prefill_scale == pytest.approx(scales[1], rel=0.1)


def test_outliers_do_not_drag_the_fit() -> None:
    model = ServiceModel()
    rng = random.Random(2)
    synthetic_pod(2.0, 2.0, rng, model, 300)
    for _ in range(30):  # a preempted request, a network hiccup: 20x the time, 10% of the data
        model.observe(0.02, 0.05, 1.4)
        synthetic_pod(2.0, 2.0, rng, model, 9)
    assert model.step_scale == pytest.approx(2.0, rel=0.2)
    assert model.prefill_scale == pytest.approx(2.0, rel=0.2)


def test_follows_a_pod_that_slows_down() -> None:
    model = ServiceModel()
    rng = random.Random(3)
    synthetic_pod(1.0, 1.0, rng, model, 300)
    synthetic_pod(3.0, 3.0, rng, model, 600)
    assert model.step_scale == pytest.approx(3.0, rel=0.15) and model.prefill_scale == pytest.approx(3.0, rel=0.15)


def test_garbage_and_idle_observations_change_nothing() -> None:
    model = ServiceModel()
    for bad in (0.0, -1.0, math.nan, math.inf):
        model.observe(0.01, 0.01, bad)
    model.observe(math.nan, 0.01, 0.1)
    model.observe(-0.01, 0.01, 0.1)
    model.observe(0.0, 0.0, 0.1)  # nothing to explain it by
    assert model.observations == 0 and model.step_scale == 1.0 and model.prefill_scale == 1.0
    # An idle pod is predicted at one step, however long it has been idle.
    assert model.ttft(1, 0, 0, 0).seconds == pytest.approx(model.prior.overhead + model.prior.per_prefill_token)


def test_scales_are_bounded() -> None:
    model = ServiceModel(prior=StepCosts())
    for _ in range(500):
        model.observe(1e-6, 1e-6, 10.0)  # absurdly slow
    assert model.step_scale <= 50.0 and model.prefill_scale <= 50.0


def test_a_noisy_first_token_time_does_not_bias_the_fit() -> None:
    """A request that reaches a busy pod waits out a random share of the step in flight, so its
    time to first token scatters by up to a step around the prediction. Warm requests (a step of
    that noise, a little prefill) are most of what a pod answers; a fit on errors relative to the
    *observed* time read that scatter as a pod cheaper than it is (the mean of 1/t exceeds 1/mean
    t) and halved its prefill scale on long-document traffic, so a cold prompt was then predicted
    at half its cost."""
    model = ServiceModel()
    rng = random.Random(4)
    p = model.prior
    for i in range(2000):
        decoding = rng.randint(10, 40)
        context = decoding * 20_000
        step = p.overhead + p.per_decode_seq * decoding + p.per_context_token * context
        cold = i % 25 == 0
        own, cached = (20_000, 0) if cold else (rng.randint(50, 400), 20_000)
        estimate = model.ttft(own, own * (cached + own * 0.5), decoding, context)
        steps = estimate.steps
        true = step * (steps + rng.random()) + (p.per_prefill_token * own + p.per_attention_pair * own * (cached + own * 0.5))
        model.observe(estimate.step_feature, estimate.prefill_feature, true)
        model.observe(*model.itl_features(decoding, context, 0), step * (1 + rng.gauss(0, 0.05)))
    assert model.step_scale == pytest.approx(1.0, rel=0.1)
    assert model.prefill_scale == pytest.approx(1.0, rel=0.1)


def test_calibration_tracks_the_median_ratio_of_observed_to_predicted() -> None:
    """A pod whose requests take 1.6× the raw prediction at the median, with a long tail (one in
    five 5× late, stuck behind KV admissions): the factor goes to the median, not the mean, and the
    error SREs see shrinks with it. Bad inputs teach nothing."""
    model = ServiceModel()
    rng = random.Random(5)
    errors_before: list[float] = []
    for i in range(2000):
        raw = rng.uniform(0.05, 2.0)
        observed = raw * 1.6 * math.exp(rng.gauss(0.0, 0.2))
        if rng.random() < 0.2:
            observed *= 5.0
        if i < 20:
            errors_before.append(abs(raw - observed) / observed)
        model.calibrate(raw, observed)
    median_ratio = 1.6 * math.exp(0.2 * 0.32)  # the clean part's 62.5th percentile (it is 80% of all)
    assert math.exp(model.ttft_bias) == pytest.approx(median_ratio, rel=0.1)
    assert model.ttft_factor == pytest.approx(math.exp(model.ttft_bias), rel=0.06)
    assert model.ttft_error < sorted(errors_before)[10]
    bias = model.ttft_bias
    for raw, observed in [(0.0, 1.0), (1.0, 0.0), (math.nan, 1.0), (1.0, math.inf), (-1.0, 2.0)]:
        model.calibrate(raw, observed)
    assert model.ttft_bias == bias


def test_calibration_is_bounded_and_leaves_a_well_predicted_pod_alone() -> None:
    model = ServiceModel()
    for _ in range(1000):
        model.calibrate(0.001, 100.0)  # absurdly late: the factor stops at its bound
    assert model.ttft_factor == pytest.approx(math.exp(1.5 - 0.05), rel=1e-6)
    fine = ServiceModel()
    rng = random.Random(6)
    for _ in range(500):  # right at the median: the factor wanders within its dead band
        raw = rng.uniform(0.05, 2.0)
        fine.calibrate(raw, raw * math.exp(rng.gauss(0.0, 0.3)))
    assert fine.ttft_factor == pytest.approx(1.0, abs=0.03)
