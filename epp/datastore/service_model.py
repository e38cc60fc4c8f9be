"""What a pod charges for work, learned online per pod: the step-time model of an engine.

One continuous-batching step costs `t = c + a_p·P + a_d·D + a_kv·K + a_qk·Q` (P prefill tokens,
D decoding sequences, K KV tokens those decodes read, Q prefill query-key pairs: the shape of the
queueing-theory seed and of the published GPU measurements in shared/calibration). The prior is
an 8B model on one H100 (`StepCosts`); every pod then learns two multipliers from what the EPP
observes of it — `step_scale` on the per-step part (c + a_d·D + a_kv·K) and `prefill_scale` on the
per-token prefill part (a_p·P + a_qk·Q) — so a pool that mixes GPU types or engine settings is
modelled as it is, while two parameters stay identifiable from few, noisy observations
(a full regression on five collinear features would not be).

Observations: a request's time to first token against the prefill queued ahead of it (both
parts), and its mean inter-token latency against the batch it decoded in (mostly the step part).
The fit is a least-squares regression on errors relative to the current prediction that starts
from the prior (as a few pseudo-observations), with exponential forgetting (a pod that slows down
is followed) and Huber weights (a preempted or network-delayed request does not drag the fit).
Relative to the *prediction*, not to the observation: dividing the features by a noisy observed
time biases both scales low (the mean of 1/t exceeds 1/mean t), and a time to first token is
noisy by construction — a request waits out a random share of the step in flight. Divided by the
observation, warm requests on a busy pod (one step of noise, little prefill) pulled a pod's
prefill scale to half its truth, and a cold prompt there was then predicted at half its cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_MIN_SCALE = 0.05
_MAX_SCALE = 50.0
_CALIBRATION_STEP = 0.01  # of `ttft_bias` per observation: ~1% of the factor, a memory of ~100
_MAX_BIAS = 1.5  # |ttft_bias|: the factor stays within e^±1.5 (0.22–4.5)
# Of `ttft_bias`, what is applied: none of its first 0.05 either way. A fixed-step median wanders
# by a few steps around its target; on a pod the model already predicts well that wander was
# pure noise (a point of median error on ordinary workloads), while the errors it is for are
# tens of percent.
_DEAD_BAND = 0.05


@dataclass(slots=True, frozen=True)
class StepCosts:
    """Prior step costs in seconds (Llama-3-8B on an H100, vLLM; see shared/calibration)."""

    overhead: float = 6.6e-3  # c: per step
    per_prefill_token: float = 2.05e-5  # a_p
    per_decode_seq: float = 1.48e-5  # a_d
    per_context_token: float = 5.06e-8  # a_kv: per KV token a decode reads
    per_attention_pair: float = 1.89e-9  # a_qk: per prefill query-key pair
    max_batched_tokens: int = 8192  # vLLM's token budget per step
    max_num_seqs: int = 256  # vLLM's batch limit


@dataclass(slots=True, frozen=True)
class TtftEstimate:
    """A predicted time to first token and its parts (seconds, after the learned scales)."""

    seconds: float
    steps: int
    step_feature: float  # unscaled per-step part: steps × (c + a_d·D + a_kv·K)
    prefill_feature: float  # unscaled prefill part: a_p·W + a_qk·Q


@dataclass(slots=True)
class ServiceModel:
    """One pod's learned step-time model."""

    prior: StepCosts = field(default_factory=StepCosts)
    step_scale: float = 1.0
    prefill_scale: float = 1.0
    observations: int = 0
    # EWMA of |predicted - observed| / observed over the reported TTFT predictions (what SREs watch).
    ttft_error: float = 0.0
    ttft_errors: int = 0  # observations behind `ttft_error`
    # log of the factor the reported TTFT prediction is multiplied by (`calibrate`): the running
    # median of log(observed / uncalibrated prediction) on this pod. It corrects what the two
    # scales cannot — waits the model does not see, such as a pod's KV admissions — in what is
    # reported (the decision trace, the error histogram, the SLO filter), never the ranking.
    ttft_bias: float = 0.0
    # Least squares on features relative to the prediction, A = Σ w·x·xᵀ and b = Σ w·x·y, plus
    # `prior_weight` pseudo-observations of scale 1 that are forgotten like real ones.
    prior_weight: float = 2.0
    forgetting: float = 0.995  # per observation (an effective memory of ~200)
    _prior: float = 0.0  # what is left of the prior's weight
    _a11: float = 0.0
    _a12: float = 0.0
    _a22: float = 0.0
    _b1: float = 0.0
    _b2: float = 0.0

    def __post_init__(self) -> None:
        self._prior = self.prior_weight

    # -- predictions --

    def step_seconds(self, decoding: float, context_tokens: float) -> float:
        """The per-step part of a step with this decode batch."""
        p = self.prior
        return self.step_scale * (p.overhead + p.per_decode_seq * decoding + p.per_context_token * context_tokens)

    def prefill_rate(self, decoding: float, context_tokens: float) -> float:
        """Prefill tokens per second the pod works through while it has a backlog."""
        p = self.prior
        budget = max(1.0, p.max_batched_tokens - decoding)
        step = self.step_seconds(decoding, context_tokens) + self.prefill_scale * p.per_prefill_token * budget
        return budget / step

    def ttft(self, prefill_tokens: float, attention_pairs: float, decoding: float,
             context_tokens: float) -> TtftEstimate:
        """Time until `prefill_tokens` of queued prefill (this request's last) are done."""
        p = self.prior
        budget = max(1.0, p.max_batched_tokens - decoding)
        steps = max(1, math.ceil(prefill_tokens / budget))
        # A busy pod finishes the step in flight first: half a step on average.
        waits = steps + (0.5 if decoding > 0 else 0.0)
        step_feature = waits * (p.overhead + p.per_decode_seq * decoding + p.per_context_token * context_tokens)
        prefill_feature = p.per_prefill_token * prefill_tokens + p.per_attention_pair * attention_pairs
        seconds = self.step_scale * step_feature + self.prefill_scale * prefill_feature
        return TtftEstimate(seconds, steps, step_feature, prefill_feature)

    def itl_features(self, decoding: float, context_tokens: float, prefill_per_step: float) -> tuple[float, float]:
        """Unscaled (step, prefill) parts of one decode step that carries some prefill."""
        p = self.prior
        step = p.overhead + p.per_decode_seq * decoding + p.per_context_token * context_tokens
        return step, p.per_prefill_token * prefill_per_step

    # -- learning --

    def observe(self, step_feature: float, prefill_feature: float, observed: float) -> None:
        """One observation `observed ≈ step_scale·step_feature + prefill_scale·prefill_feature`
        (a time to first token, or a mean inter-token latency)."""
        if not (observed > 0.0 and math.isfinite(observed)) or step_feature < 0.0 or prefill_feature < 0.0:
            return
        if not (math.isfinite(step_feature) and math.isfinite(prefill_feature)):
            return
        predicted = self.step_scale * step_feature + self.prefill_scale * prefill_feature
        if predicted <= 0.0:
            return
        # observed / predicted ≈ step_scale·x1 + prefill_scale·x2, each feature relative to the
        # prediction (1.0 on the right is exact).
        x1 = step_feature / predicted
        x2 = prefill_feature / predicted
        y = observed / predicted
        residual = abs(y - 1.0)
        weight = 1.0 if residual <= 1.0 else 1.0 / residual  # Huber: outliers count less
        g = self.forgetting
        self._prior *= g
        self._a11 = g * self._a11 + weight * x1 * x1
        self._a12 = g * self._a12 + weight * x1 * x2
        self._a22 = g * self._a22 + weight * x2 * x2
        self._b1 = g * self._b1 + weight * x1 * y
        self._b2 = g * self._b2 + weight * x2 * y
        self.observations += 1
        self._solve()

    @property
    def ttft_factor(self) -> float:
        """What the reported TTFT prediction is multiplied by: `ttft_bias` less its dead band."""
        bias = self.ttft_bias
        if -_DEAD_BAND <= bias <= _DEAD_BAND:
            return 1.0
        return math.exp(bias - _DEAD_BAND if bias > 0.0 else bias + _DEAD_BAND)

    def calibrate(self, raw_ttft: float, observed: float) -> None:
        """A reported prediction before calibration (`raw_ttft`) against the time to first token
        observed: step `ttft_bias` towards the median of their log ratio.

        A median, stepped by a fixed amount, because the ratio's tail is long (a request stuck
        behind KV admissions waits several times its prediction) and a mean would chase it. Open
        loop, on the uncalibrated prediction: fed back through its own output the factor rang.
        Per pod, because the error is the pod's: a fast GPU in a mixed pool learns a prefill scale
        from its KV-bound outliers and over-predicts its ordinary requests."""
        if not (raw_ttft > 0.0 and observed > 0.0 and math.isfinite(raw_ttft) and math.isfinite(observed)):
            return
        error = abs(raw_ttft * self.ttft_factor - observed) / observed
        self.ttft_error = error if self.ttft_errors == 0 else 0.9 * self.ttft_error + 0.1 * error
        self.ttft_errors += 1
        bias = self.ttft_bias + (_CALIBRATION_STEP if observed > raw_ttft * math.exp(self.ttft_bias)
                                 else -_CALIBRATION_STEP)
        self.ttft_bias = min(_MAX_BIAS, max(-_MAX_BIAS, bias))

    def _solve(self) -> None:
        """Refit both scales; the prior pulls on the relative error of the scale it says.

        A real observation of a pod k× slower than the prior has features ~1/k (relative to a
        prediction that has found the pod), so it weighs
        1/k² of a pseudo-observation `scale ≈ 1`: left as it is, the prior would hold a slow pod's
        fit near the fast one's for hundreds of requests (and a slow pod gets few). Weighing the
        prior's pull by 1/scale² (re-linearised at the current fit, two rounds) makes it count as
        `prior_weight` observations on any pod."""
        s1, s2 = self.step_scale, self.prefill_scale
        for _ in range(2):
            p1 = self._prior / (s1 * s1)
            p2 = self._prior / (s2 * s2)
            a11, a22 = self._a11 + p1, self._a22 + p2
            b1, b2 = self._b1 + p1, self._b2 + p2
            a12 = self._a12
            det = a11 * a22 - a12 * a12
            if det <= 1e-12:
                return
            s1 = min(_MAX_SCALE, max(_MIN_SCALE, (b1 * a22 - b2 * a12) / det))
            s2 = min(_MAX_SCALE, max(_MIN_SCALE, (a11 * b2 - a12 * b1) / det))
        self.step_scale, self.prefill_scale = s1, s2
