"""`latency-scorer` (llm-d's name): prefer the candidate whose pick costs least, in seconds.

Score = lowest cost among the candidates / this candidate's (`Prediction.cost`: the predicted TTFT
with the whole cache credit plus what the pick costs the requests after it), so the cheapest
scores 1 and one twice as costly 0.5; with `max-score-picker` the cheapest wins and candidates
within `tieTolerance` of it tie (the picker breaks ties at random, so equally idle pods share a
burst). `tpotWeight` > 0 blends in the predicted inter-token latency the same way:
`score = (1 - w)·cost part + w·itl part`. Predictions come from `predicted-latency-producer`
(created with default parameters when none is configured).

**The TTFT bound.** The cost trades this request's time to first token for the others': an idle
slow pod can cost less than a busy fast one because the request's prefill and decode there delay
fewer requests after it. That lowers the mean, but the loss lands whole on one request (a long
cold prompt sent to a slow pod waits 2-3x what a fast pod would give it) while the saving is
spread over many. So a candidate predicted to answer beyond the bound (`ttftBoundRatio` × the
fastest candidate's TTFT + `ttftBoundSlackMs`, on the credited predictions the cost is made of)
is picked only if it saves the others more than twice what this request loses there (its cost
lower than the fastest's by more than its TTFT is higher); the others score 0. It applies to a
cold prompt (no candidate holds a quarter of it) and only while the pool's recent cold prompts
are mostly not asked for again (`ColdReuse`: the share reused below `ttftBoundMaxReuse`): where
the first request of a document or conversation lands, its later ones follow by cache affinity,
and bounded onto the few fast pods a pool's documents pile up there. Not bounded either: a
saturated pool (ranked for its throughput), a candidate whose TTFT is mostly a wait for a batch
slot or KV blocks, and a pool whose fastest candidate has more prefill queued than this prompt's
own (there the TTFTs are queues to wait out, which the cost ranks).
Measured (BENCHMARKS.md, 4 H100 + 12 A100 pods, TTFT p99): mixed traffic 262 -> 150 ms,
head-of-line 4.7 -> 2.9 s, load balancing 13.7 -> 12.1 s, multi-tenant 511 -> 551 ms (the one
loss). Applied whatever the pool's reuse, it had cost 8 H100 + 8 A100's B2B shared context
587 -> 744 ms; applied to warm prompts too, the 4:12 head-of-line 4.7 -> 48 s.
`inference_extension_ttft_bounded_picks_total` counts the picks it made,
`inference_extension_cold_prompt_reuse_ratio` shows the share it is gated on; `beyond_bound=` and
`bounded` in `x-epp-decision` show it per candidate.

**A shared decode overload.** A long generation's cost is mostly its decode charge
(`Prediction.decode_charge`: what its decode adds to the steps of the requests that reach the pod
meanwhile, tens of seconds for 2,000 tokens on a loaded pod). While every candidate's busy factor
is at its cap (the pool's recent work past what it can do everywhere, or the pick overflowing a
KV cache), that charge differs between pods by a few percent, its own noise, and ranked on it
alone such requests landed where they waited longest for their first token (head-of-line at 1.3x
its rate, 16 pods: the long class's TTFT p90 342 ms against the greedy oracle's 207; 89% of its
costly picks had the EPP's own prediction put another pod first). So when the cheapest
candidate's decode charge is above 4x its TTFT and every candidate is at its cap, candidates
within 5% of the cheapest cost tie and the one predicted to answer first wins (`overload_ranked`
in the decision trace) — if the candidates are pods alike (the request's work on each within
1.25x of the least): between pods of different speeds the charges differ by the speeds, not by
noise (applied there, it gave the H100s of 4 H100 + 12 A100 pods the long generations,
head-of-line p90 / p99 2.6 / 4.7 -> 3.7 / 8.9 s, and moved the mixed pools' KV-heavy overloads
by ±30-50% at p99, for better on some seeds and worse on others). Measured (`bench.variants --set
stress`, TTFT p99, 16 pods): head-of-line at 1.3x 253 / 268 / 237 -> 215 / 220 / 214 ms on seeds
1-3 (p90 level), head-of-line-heavy 330 -> 270 ms; in the reports only the homogeneous pools'
head-of-line and the quick pool's B2B overload moved (BENCHMARKS.md, round 47).

**Ranked by first token, its own and the others'.** Wherever the decode charge dominates on pods
alike, below the cap too (at the usual tie tolerance), tied candidates are told apart the same
way, and the first tokens counted include the others': a long prompt whose prefill chunk joins
the step of requests still prefilling on the pod delays each of their first tokens by its chunk
(`Prediction.chunk_charge`: 100-200 ms for a few thousand tokens on an H100). The cost has always
carried that term, but a tie 2-5% wide of a 20 s cost hides it, and the tie-break by work ignored
it: in head-of-line-heavy (16 pods), 226 of the 234 short requests slower than 140 ms had a long
prompt sent to their pod after them, before their first token. The key is `ttft + chunk_charge`
(`first_token_ranked` in the decision trace). Measured (16 pods, TTFT p90 ms, seeds 1-3):
head-of-line-heavy 150 / 152 / 155 -> 134 / 135 / 140, head-of-line at 1.3x 104 / 101 / 101 ->
99 / 97 / 96 (the greedy oracle's 135 / 106 / 167 and 98 / 96 / 96); the p99 moves with the
long prompts' own (BENCHMARKS.md, round 48).

Parameters: `tpotWeight` (0.0), `tieTolerance` (0.02, relative), `ttftBoundRatio` (1.5; 0: off;
else at least 1), `ttftBoundSlackMs` (20), `ttftBoundMaxReuse` (0.5; 1: whatever the reuse).

```yaml
plugins:
- type: latency-scorer
  parameters: {tpotWeight: 0.0, ttftBoundRatio: 1.5, ttftBoundSlackMs: 20, ttftBoundMaxReuse: 0.5}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: latency-scorer}]
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epp.api.request import InferenceRequest
from epp.datastore import Endpoint
from epp.params import Params
from epp.scheduling.framework import CycleState, Plugin, Scorer
from epp.scheduling.plugins._requires import unique_name
from epp.scheduling.plugins.predicted_latency_producer import PredictedLatencyProducer
from epp.scheduling.prediction import Prediction

if TYPE_CHECKING:
    from epp.plugin import PluginContext

_FLOOR = 1e-4  # seconds: predictions below this are equal
_WORK_TIE = 1e-3  # how far apart tied candidates' scores are set by their work
# A shared decode overload (the module docstring): the cheapest candidate's decode charge above
# this many times its TTFT, on pods alike (the most work the request costs one within this many
# times the least), and candidates within this share of the cheapest cost tie.
_DECODE_DOMINATES = 4.0
_LIKE_PODS = 1.25
_OVERLOAD_TOLERANCE = 0.05


class LatencyScorer(Scorer):
    type = "latency-scorer"

    def __init__(self, name: str = "", *, tpot_weight: float = 0.0, tie_tolerance: float = 0.02,
                 ttft_bound_ratio: float = 1.5, ttft_bound_slack: float = 0.02,
                 ttft_bound_max_reuse: float = 0.5) -> None:
        super().__init__(name)
        self.tpot_weight = tpot_weight
        self.tie_tolerance = tie_tolerance
        self.ttft_bound_ratio = ttft_bound_ratio
        self.ttft_bound_slack = ttft_bound_slack  # seconds
        self.ttft_bound_max_reuse = ttft_bound_max_reuse
        self.producer: PredictedLatencyProducer | None = None

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> LatencyScorer:
        tpot = params.float("tpotWeight", 0.0, min=0.0, max=1.0)
        tolerance = params.float("tieTolerance", 0.02, min=0.0, max=1.0)
        ratio = params.float("ttftBoundRatio", 1.5, min=0.0, max=100.0)
        if 0.0 < ratio < 1.0:
            raise params.error("ttftBoundRatio", f"must be 0 (off) or at least 1, got {ratio}")
        slack_ms = params.float("ttftBoundSlackMs", 20.0, min=0.0, max=60_000.0)
        max_reuse = params.float("ttftBoundMaxReuse", 0.5, min=0.0, max=1.0)
        params.done()
        return cls(name, tpot_weight=tpot, tie_tolerance=tolerance, ttft_bound_ratio=ratio,
                   ttft_bound_slack=slack_ms * 1e-3, ttft_bound_max_reuse=max_reuse)

    def create_missing_producers(self, ctx: PluginContext) -> list[Plugin]:
        for plugin in ctx.plugins.values():
            if isinstance(plugin, PredictedLatencyProducer):
                self.producer = plugin
                return []
        producer = PredictedLatencyProducer(unique_name(PredictedLatencyProducer.type, ctx.plugins),
                                            datastore=ctx.datastore)
        self.producer = producer
        return [producer, *producer.create_missing_producers(ctx)]

    def score(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> list[float]:
        predictions = cycle.predictions
        found = [predictions.get(ep.address) for ep in endpoints]
        if any(p is None for p in found):  # (not `None in found`: that calls each prediction's __eq__)
            return [0.0] * len(endpoints)
        costs = [c if c > _FLOOR else _FLOOR for c in [p.cost for p in found]]  # type: ignore[union-attr]
        within = self._within_bound(found)  # type: ignore[arg-type]
        dominated, overload = _decode_dominated(found, costs)  # type: ignore[arg-type]
        tolerance = _OVERLOAD_TOLERANCE if overload else self.tie_tolerance
        if within is None:
            scores = _relative(costs, tolerance)
        else:  # ranked among the candidates within the bound; the others score 0
            kept = [i for i, ok in enumerate(within) if ok]
            scores = [0.0] * len(costs)
            for i, v in zip(kept, _relative([costs[i] for i in kept], tolerance)):
                scores[i] = v
        # Among the candidates that tie, the one the pick costs least work (a cached prefix
        # rather than a second copy of it) wins, or where the decode charge dominates the one that
        # gives this request its first token soonest and delays the fewest others' (the module
        # docstring); exact ties stay ties, for the picker's coin.
        tied = [i for i, v in enumerate(scores) if v == 1.0]
        if len(tied) > 1:
            keys = ([p.ttft + p.chunk_charge for p in found] if dominated  # type: ignore[union-attr]
                    else [p.work_seconds for p in found])  # type: ignore[union-attr]
            most = max(keys[i] for i in tied) or 1.0
            for i in tied:
                scores[i] = 1.0 - _WORK_TIE * keys[i] / most
        w = self.tpot_weight
        if w > 0.0:
            itls = [max(_FLOOR, p.itl) for p in found]  # type: ignore[union-attr]
            scores = [(1.0 - w) * a + w * b for a, b in zip(scores, _relative(itls, self.tie_tolerance))]
            if within is not None:
                scores = [v if ok else 0.0 for v, ok in zip(scores, within)]
        return scores

    def _within_bound(self, found: list[Prediction]) -> list[bool] | None:
        """Which candidates the TTFT bound leaves in the ranking (None: all of them).

        Left out: a candidate predicted (credited) to answer beyond the bound (the fastest
        candidate's TTFT × the ratio + the slack) whose cost is not lower than the fastest's by
        more than its TTFT is higher: it saves the others less than twice what this request
        loses. Kept: one clearly cheaper (a long generation spread off a busy pod, a prefix not
        evicted), one whose TTFT is mostly a wait for a batch slot or KV blocks (a queue, which
        the cost ranks: bounded off the full pod the cost chose, a long generation on 8 H100 + 8
        A100 pods took a busy H100 from the short requests, head-of-line p90 133 -> 200 ms), and
        every candidate when the fastest has more prefill queued than this prompt's own (there
        the TTFTs are the queues' waits, which the cost already ranks).
        Marks the ones left out (`beyond_bound`: seconds past it) and, when the cheapest is among
        them, `ttft_bounded` on the others: the pick the bound made. Only for a cold prompt, while
        the pool's cold prompts are mostly not asked for again (the class docstring)."""
        ratio = self.ttft_bound_ratio
        if ratio <= 0.0 or len(found) < 2 or any(p.saturated for p in found):
            return None
        if self.ttft_bound_max_reuse < 1.0 and found[0].cold_prompts_reused >= self.ttft_bound_max_reuse:
            return None  # the pool's cold prompts come back: where one lands, its later requests follow
        if max(p.cached_tokens for p in found) * 4 >= found[0].prompt_tokens:
            return None  # a pod holds a quarter of it: not a cold prompt
        ttfts = [p.credited_ttft or p.ttft for p in found]
        fastest = min(range(len(found)), key=ttfts.__getitem__)
        best = found[fastest]
        if best.queued_prefill > best.own_prefill:
            return None
        ttft_best = ttfts[fastest]
        limit = ttft_best * ratio + self.ttft_bound_slack
        within = [t <= limit or best.cost - p.cost > t - ttft_best or p.wait_seconds > 0.5 * t
                  for p, t in zip(found, ttfts)]
        if all(within):
            return None
        for p, t, ok in zip(found, ttfts, within):
            if not ok:
                p.beyond_bound = t - limit
        if not within[min(range(len(found)), key=lambda i: found[i].cost)]:
            for p, ok in zip(found, within):
                p.ttft_bounded = ok
        return within


def _decode_dominated(found: list[Prediction], costs: list[float]) -> tuple[bool, bool]:
    """Whether the cheapest candidate's cost is mostly this request's decode charge, on pods
    alike, and whether, besides, every candidate's busy factor is at its cap (a shared decode
    overload; the module docstring); marks them `first_token_ranked` and `overload_ranked`."""
    cheapest = found[min(range(len(costs)), key=costs.__getitem__)]
    if not cheapest.decode_charge > _DECODE_DOMINATES * cheapest.credited_ttft:
        return False, False
    least = most = cheapest.work_seconds
    at_cap = True
    for p in found:
        at_cap = at_cap and p.at_busy_cap
        work = p.work_seconds
        if work < least:
            least = work
        elif work > most:
            most = work
    if most > least * _LIKE_PODS:
        return False, False  # pods of different speeds, or a prefix some hold: the charges differ by those
    for p in found:
        p.first_token_ranked = True
        p.overload_ranked = at_cap
    return True, at_cap


def _relative(values: list[float], tolerance: float) -> list[float]:
    """best / value, with everything within `tolerance` of the best scoring exactly 1."""
    best = min(values)
    limit = best * (1.0 + tolerance)
    return [1.0 if v <= limit else best / v for v in values]
