"""`predicted-latency-producer` (llm-d's name): for every candidate, the seconds until this
request's first token if it were sent there — a prediction, not a weighted sum of proxies.

    TTFT(p) = steps × step_p(D, K) + prefill_p(queued_p + own_p)  +  slot wait  +  KV wait

- `queued_p`: prefill tokens already queued on p — the EPP's own ledger of what it sent p and p has
  not started answering (`EndpointLoad`, exact for its own traffic, drained at p's learned rate),
  plus what p's scraped queue shows beyond that (traffic the EPP did not route);
- `own_p`: this request's prompt tokens minus those p is predicted to hold in its prefix cache
  (the cache credit, from the configured prefix producer's `PrefixMatch`);
- `step_p(D, K)`, `prefill_p`: p's service model (`ServiceModel`), the step-time model of the
  calibration data with two multipliers learned online per pod from observed first-token times
  and inter-token latencies;
- slot wait: p's batch is full (`maxNumSeqs`) and the request must wait for a running one to end
  — at a steady pace when outputs end at their own length, and at the ledger's expected end of
  the first of them (counted in p's steps) when requests run to their `max_tokens`;
  KV wait: p's KV cache cannot hold the prompt until running requests free blocks.

The prediction reported (`ttft`: the decision trace, the prediction-error histogram, the SLO
filter) also counts the prefill the pod will do that the cache credit leaves out: where its
requests in flight pin more prefixes than its cache holds, the share of the prefix it will
compute again (the prefix producer's `recompute_share`), for this prompt and the queued ones; and
queued prefill well past its expected end with no first token yet. The ranking and the ledger's
timeline keep the whole credit (`credited_ttft`): ranked on the expected credit, a document's
requests scatter over more pods, each computing it again (BENCHMARKS.md); kept together, they
share it once it is back.
Two corrections, again to what is reported only: on a pod whose KV cache is full and whose queue
is not empty, the prediction is at least the queue ahead at the pace the pod has been measured to
give first tokens while backlogged (`EndpointLoad.drain_seconds`: it admits as running requests
end, which the step model cannot see; the ranking takes it for a cold prompt only,
`_charge_drain`); and each pod's prediction is multiplied by its learned calibration factor, the
running median of observed over predicted (`ServiceModel.calibrate`).

Candidates are ranked on `cost`: the TTFT with the whole credit plus what the pick costs the
requests after it (its decode's share of their steps, its prefill ahead of theirs, its chunk in
the step of the prefills still waiting there for a first token, the steps a prompt beyond the step
budget fills alone while the pod's next requests wait them out, the prefix it evicts), less the
copy credit — what a new copy of a hot prefix on a pod without it saves that prefix's next requests
(all of them, on a pod clearly faster than its holders, or as the second holder of a prefix whose one
pod is busier on average). A saturated pool (every candidate's KV
cache full with a queue) is ranked for its throughput instead (`_rank_saturated`): on the
prediction with the prefill each pod will compute again, without the externality (the same work
on whichever of its full pods), and a copy of a prefix its holders have
charged as work the pool cannot absorb. Short of that, a full pod with a queue is ranked for a cold
prompt at the pace it admits (`_charge_drain`), while at least half the pool has room; and while
at least half the candidates' KV caches have room, a pod counts as busy as the fuller of its
compute and its KV cache in the externality (`_kv_utilization`); and, however full the pool,
past the cap where the pick would overflow its cache (`_kv_overflow`). A prompt that comes back soon
after it came in cold is charged, on a pod whose cache turns over too fast to keep it, the
recompute of its next request (`_charge_evictions`). On a pod whose KV cache is full with a
queue, a request's new blocks (its uncached prompt and its output), for as long as it holds them,
hold up the requests queued there (`_kv_time_charge`); short of full, while the pool's caches
bind, a prompt the pod does not hold brings them to a cache whose queue grows as it fills
(`_kv_filling_charge`), and a long generation does so wherever the requests lately sent will
fill the cache (`_kv_forecast_charge`). A request that must wait for a batch slot is charged what it adds,
holding one for its decode, to the waits of the requests sent there meanwhile (`_slot_charge`).
A copy of a prefix in its first seconds of reuse, while its holder is likely still computing it,
is charged the prefill it repeats at the load the candidate's queue shows (`_charge_copies`). Every candidate is charged for the TTFT tail: the seconds it would
spend beyond the pool's running p90 of first tokens, and its externality again by the share of
the pod's requests lately in that tail (`_charge_tail`).
The pods' recent pick and work rates are read corrected for the history they cover, so a warming
pool does not look idle (`epp.datastore.load.coverage`).

The predictions land in `CycleState.predictions` for `latency-scorer`, `slo-headroom-tier-filter`,
the decision trace, and the ledger entry request control books at the pick.

Parameters (all optional):
- `prefixMatchInfoProducerName`: the prefix producer whose `PrefixMatch` is the cache credit
  (default: the configured `approx-prefix-cache-producer`, created if there is none).
- `maxNumBatchedTokens` (8192), `maxNumSeqs` (256): the engines' scheduler limits (vLLM's
  defaults; vLLM does not export them).
- `stepOverheadMs` (6.6), `prefillMsPerToken` (0.0205), `decodeMsPerSeq` (0.0148),
  `contextMsPerToken` (5.06e-5), `attentionMsPerPair` (1.89e-6): the prior step costs, an 8B model
  on one H100; each pod corrects them online.
- `learn` (true): learn each pod's rates from what it answers.
- `copyCredit` (true): value a new copy of a reused prefix on a pod without it (`_credit_copies`),
  so a hot document or system prompt spreads to more pods once its holders are overloaded, a reused
  one held by a single busier pod gets a second, and one placed on a slower GPU moves to a faster
  one — onto pods whose KV has room for it.
- `saturatedPool` (true): rank a saturated pool for its throughput (`_rank_saturated`), so a
  document stays where it is computed, on the holders that still have it, while the pool is past
  its capacity.
- `drainCharge` (true): charge a cold prompt a full pod's drain (`_charge_drain`), so it goes to a
  pod with room instead of queueing for admission behind a full one.
- `kvUtilization` (true): a pod's KV cache use (with the output its running requests have yet to
  write) is its utilisation where that exceeds its compute's (`_kv_utilization`), and a pick
  that would overflow the cache is charged past the utilisation cap by the overflow
  (`_kv_overflow`), so long generations do not fill the caches of the pods that are fastest until
  they preempt while others have room.
- `evictionCharge` (true): charge a copy of a prompt that came back (asked for again soon after
  it came in cold) on a pod whose cache turns over in under 30 s the recompute its next request
  will likely need there (`_charge_evictions`), so reused contexts settle on pods with room to
  keep them.
- `slotCharge` (true): charge a request that must wait for a batch slot the wait it adds, holding
  a slot for its decode, to the requests sent to that pod meanwhile (`_slot_charge`), so long
  generations do not gather on the pods of few slots.
- `kvTimeCharge` (true): on a pod whose KV cache is full with a queue, charge each candidate the
  share of the cache's time its new blocks take (uncached prompt and output, over its prefill and
  decode) for each request queued there, up to 19 (`_kv_time_charge`), so a document is not
  copied onto a full pod, where its blocks hold the queue up, to save this request a short wait.
- `kvFillingCharge` (true): short of that, while the pool's caches bind (a candidate full with a
  queue in the last 10 s), charge a prompt the pod does not hold the same share of the cache's
  time for the queue a cache as full as its would make, rho^2 / (1 - rho) requests, up to 18
  (`_kv_filling_charge`), so long prompts and generations do not fill the caches of the pods
  whose compute looks no busier until they preempt while others have room.
- `kvForecastCharge` (true): short of both, charge a request that will hold its blocks longer
  than the pick rates' 10 s window (a long generation) the same on a pod whose KV forecast — the
  KV token-seconds lately sent there per second, the tokens its requests will hold by Little's
  law, with this one's — reaches 0.8 of its cache, at the fuller of that and its cache's use
  (`_kv_forecast_charge`), once the model's output lengths are learned (50 responses), so long
  generations do not herd onto one pod whose cache reads half empty until it overflows. All
  three show as `kv_time_charge=` in `x-epp-decision`.
- `youngPrefixCharge` (true): charge a copy of a prefix in its first seconds of reuse the prefill
  it repeats at the load the candidate's queue shows (`_charge_copies`), so the documents of a
  cold start are computed once, where they were first sent, not again wherever the first
  holders' queues look long.
- `youngCopyCredit` (true): in a long prefix's first seconds of reuse, while one pod holds it
  or its best holder is still computing a long prefill, value a copy on an idle candidate whose
  cache stays under half full with it as a hit (`_credit_copies`' fourth case), so each document
  of a pool with room starts on two pods or more and its requests take the less busy of them.
- `tailWeight` (1.0; 0: off) and `tailQuantile` (0.9): charge each candidate `tailWeight` × the
  seconds its TTFT would run beyond the pool's running `tailQuantile` of observed first tokens,
  and its externality `tailWeight` × the share of the pod's recent first tokens beyond it
  (`_charge_tail`), so the cost does not buy the mean with the tail: a request is not queued
  long on one pod to save another pod's requests a little each.

```yaml
plugins:
- type: predicted-latency-producer
  parameters: {maxNumSeqs: 256, maxNumBatchedTokens: 8192}
- type: latency-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: latency-scorer}]
```
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from epp.api.request import InferenceRequest
from epp.datastore import Datastore, Endpoint, EndpointMetrics, ModelStats, StepCosts, longest_sequence, output_room
from epp.datastore.load import RATE_WINDOW as LOAD_RATE_WINDOW
from epp.datastore.load import ENDING_UNIT, EndpointLoad, coverage
from epp.params import Params
from epp.scheduling.framework import CycleState, DataProducer, Plugin
from epp.scheduling.plugins._cold_reuse import ColdReuse
from epp.scheduling.plugins._prefix_rates import PrefixRates
from epp.scheduling.plugins._requires import unique_name
from epp.scheduling.plugins.approx_prefix_cache_producer import ApproxPrefixCacheProducer
from epp.scheduling.prediction import Prediction
from epp.scheduling.prefix_match import PrefixMatch

if TYPE_CHECKING:
    from epp.datastore.service_model import ServiceModel
    from epp.plugin import PluginContext

_MS = 1e-3
_RATE_WINDOW = 10.0  # seconds
_MAX_UTILIZATION = 0.95
_SPEED_MARGIN = 0.25  # pods learned within this of each other are not told apart by speed
_MAX_ENDS_LOOKED_UP = 16  # the deepest expected end looked up for a slot wait (cost: a heap's k smallest)
# A slot wait of unknown lengths is ranked at its mean + this many standard deviations (`_slot_wait`).
_SLOT_WAIT_SPREAD = 2.0
_ADAPTER_LOAD_SECONDS = 0.02  # loading a LoRA adapter into a free slot (host to GPU copy)
_KV_FULL = 0.9  # scraped KV use from which a pod with a queue admits at the pace requests end
# The eviction charge: a pool whose cold prompts mostly come back (`ColdReuse`) and how long a
# reused prefix must stay cached to be asked for again.
_REUSED = 0.5
_REUSE_HORIZON = 30.0  # seconds
# What a second of avoidable prefill costs a saturated pool: the externality's u / (1 - u) at its cap.
_SATURATED = _MAX_UTILIZATION / (1.0 - _MAX_UTILIZATION)
# How long after a candidate was last seen full with a queue the pool's caches count as binding
# (`_kv_filling_charge`): a scrape's queue comes and goes, a cache's fill lasts.
_KV_PRESSURE_SECONDS = 10.0
# A pod whose KV forecast (`EndpointLoad.kv_forecast_at`, with the request) reaches this share of
# its cache charges long-lived requests for filling it (`_kv_forecast_charge`).
_KV_FORECAST_BINDS = 0.8
_KV_FORECAST_SAMPLES = 50  # responses of the model before its output lengths are trusted there
_BUSY_CAP = 1.0 / (1.0 - _MAX_UTILIZATION)  # the busy factor 1 / (1 - u) at the cap
# A prefix this long (a document, not a system prompt) is placed, not balanced: a copy of it costs
# a whole prefill, so where it lives decides what each later request of it costs. Its young second
# copy (`_early_copy`) and its copy past a slower holder that takes its requests (`_credit_copies`)
# are made for such prefixes only; shorter ones cost a fraction of a step, and the busy holders'
# rule copies them as soon as it pays.
_LONG_PREFIX_TOKENS = 2048
_YOUNG_COPY_KV = 0.5  # a young prefix's early copy only onto a cache that stays under this share full


class PredictedLatencyProducer(DataProducer):
    type = "predicted-latency-producer"

    def __init__(self, name: str = "", *, datastore: Datastore, prior: StepCosts | None = None,
                 prefix_producer_name: str = "", learn: bool = True, copy_credit: bool = True,
                 saturated_pool: bool = True, drain_charge: bool = True, kv_utilization: bool = True,
                 eviction_charge: bool = True, slot_charge: bool = True, young_prefix_charge: bool = True,
                 kv_time_charge: bool = True, kv_filling_charge: bool = True, kv_forecast_charge: bool = True,
                 young_copy_credit: bool = True,
                 tail_weight: float = 1.0, tail_quantile: float = 0.9) -> None:
        super().__init__(name)
        self.datastore = datastore
        self.prior = prior or StepCosts()
        self.prefix_producer_name = prefix_producer_name
        self.prefix_producer: Plugin | None = None
        self.learn = learn
        # The pool's request rate (an exponential average over `_RATE_WINDOW` seconds): how many
        # requests a pod will receive while this one decodes there.
        self._rate = 0.0
        self._rate_at = 0.0
        self._rate_since = -1.0  # the first request
        self.copy_credit = copy_credit
        self.saturated_pool = saturated_pool
        self.drain_charge = drain_charge
        self.kv_utilization = kv_utilization
        self.eviction_charge = eviction_charge
        self.slot_charge = slot_charge
        self.young_prefix_charge = young_prefix_charge
        self.kv_time_charge = kv_time_charge
        self.kv_filling_charge = kv_filling_charge
        self.kv_forecast_charge = kv_forecast_charge
        self.young_copy_credit = young_copy_credit
        self._kv_full_at = -math.inf  # when a candidate was last full with a queue (`_kv_filling_charge`)
        self.tail_weight = tail_weight
        datastore.ttft_tail.quantile = tail_quantile
        self._prefix_rates = PrefixRates(_RATE_WINDOW)
        # How often the pool's cold prompts are asked for again (`latency-scorer`'s TTFT bound).
        self.cold_reuse = ColdReuse(_RATE_WINDOW)
        datastore.subscribe(on_add=self._endpoint_added)

    @classmethod
    def from_config(cls, name: str, params: Params, ctx: PluginContext) -> PredictedLatencyProducer:
        d = StepCosts()
        prior = StepCosts(
            overhead=params.float("stepOverheadMs", d.overhead / _MS, min=0.0) * _MS,
            per_prefill_token=params.float("prefillMsPerToken", d.per_prefill_token / _MS, min=0.0,
                                           min_exclusive=True) * _MS,
            per_decode_seq=params.float("decodeMsPerSeq", d.per_decode_seq / _MS, min=0.0) * _MS,
            per_context_token=params.float("contextMsPerToken", d.per_context_token / _MS, min=0.0) * _MS,
            per_attention_pair=params.float("attentionMsPerPair", d.per_attention_pair / _MS, min=0.0) * _MS,
            max_batched_tokens=params.int("maxNumBatchedTokens", d.max_batched_tokens, min=1),
            max_num_seqs=params.int("maxNumSeqs", d.max_num_seqs, min=1),
        )
        if prior.overhead <= 0.0:
            raise params.error("stepOverheadMs", "must be > 0")
        producer = params.str("prefixMatchInfoProducerName", "")
        learn = params.bool("learn", True)
        copy_credit = params.bool("copyCredit", True)
        saturated_pool = params.bool("saturatedPool", True)
        drain_charge = params.bool("drainCharge", True)
        kv_utilization = params.bool("kvUtilization", True)
        eviction_charge = params.bool("evictionCharge", True)
        slot_charge = params.bool("slotCharge", True)
        young_prefix_charge = params.bool("youngPrefixCharge", True)
        kv_time_charge = params.bool("kvTimeCharge", True)
        kv_filling_charge = params.bool("kvFillingCharge", True)
        kv_forecast_charge = params.bool("kvForecastCharge", True)
        young_copy_credit = params.bool("youngCopyCredit", True)
        tail_weight = params.float("tailWeight", 1.0, min=0.0, max=100.0)
        tail_quantile = params.float("tailQuantile", 0.9, min=0.5, max=0.999)
        params.done()
        return cls(name, datastore=ctx.datastore, prior=prior, prefix_producer_name=producer, learn=learn,
                   copy_credit=copy_credit, saturated_pool=saturated_pool, drain_charge=drain_charge,
                   kv_utilization=kv_utilization, eviction_charge=eviction_charge, slot_charge=slot_charge,
                   young_prefix_charge=young_prefix_charge, kv_time_charge=kv_time_charge,
                   kv_filling_charge=kv_filling_charge, kv_forecast_charge=kv_forecast_charge,
                   young_copy_credit=young_copy_credit,
                   tail_weight=tail_weight, tail_quantile=tail_quantile)

    def _endpoint_added(self, endpoint: Endpoint) -> None:
        """Every pod starts from this producer's prior (a pod keeps what it learned while it lives)."""
        if endpoint.service.observations == 0:
            endpoint.service.prior = self.prior

    # -- wiring --

    def create_missing_producers(self, ctx: PluginContext) -> list[Plugin]:
        """Bind the prefix producer named by `prefixMatchInfoProducerName` (else the approximate
        one, created with default parameters when none is configured)."""
        if self.prefix_producer_name:
            plugin = ctx.plugins.get(self.prefix_producer_name)
            if plugin is None or not isinstance(plugin, DataProducer):
                from epp.params import ConfigError

                raise ConfigError(f"{self.name}: prefixMatchInfoProducerName: no data producer named "
                                  f"{self.prefix_producer_name!r}")
            self.prefix_producer = plugin
            return []
        for plugin in ctx.plugins.values():
            if isinstance(plugin, ApproxPrefixCacheProducer):
                self.prefix_producer = plugin
                return []
        producer = ApproxPrefixCacheProducer(unique_name(ApproxPrefixCacheProducer.type, ctx.plugins))
        producer.attach(ctx.datastore)
        self.prefix_producer = producer
        return [producer]

    def depends_on(self) -> list[str]:
        return [self.prefix_producer.name] if self.prefix_producer is not None else []

    # -- the prediction --

    def prepare(self, cycle: CycleState, request: InferenceRequest, endpoints: list[Endpoint]) -> None:
        match = cycle.data.get(self.prefix_producer.name) if self.prefix_producer is not None else None
        if not isinstance(match, PrefixMatch):
            match = None
        stats = self.datastore.models.get(request.target_model)
        prompt = stats.prompt_tokens(len(request.prompt))
        lengths = self.datastore.models.output_stats(request.target_model, request.fairness_id)
        output = max(1, lengths.expected_output(request.max_tokens, output_room(longest_sequence(endpoints), prompt)))
        now = self.datastore.clock()
        returned = False  # a prompt asked for again that came in cold (`_charge_evictions`)
        if match is not None and match.hashes:
            returned = self.cold_reuse.observe(match.hashes, max(match.matched.values(), default=0), now)
        arrivals = self._arrival_rate(now) / max(1, len(endpoints))
        source = self.prefix_producer.name if match is not None and self.prefix_producer is not None else ""
        # A pod's KV counts as its utilisation while at least half the candidates have room in
        # theirs (below `_KV_FULL`): only then is there somewhere else to go (`_kv_utilization`).
        kv_uses, with_room, full = _kv_states(endpoints)
        kv_floor = self.kv_utilization and with_room * 2 >= len(endpoints)
        if full:
            self._kv_full_at = now
        # The pool's caches bind while a candidate was full with a queue lately (`_kv_filling_charge`).
        kv_pressure = self.kv_filling_charge and now - self._kv_full_at <= _KV_PRESSURE_SECONDS
        # Not before the model's output lengths are learned (of requests with a max_tokens, from
        # theirs): until then a request is expected to write all its max_tokens, often many times
        # what it will (`_kv_forecast_charge`).
        learned = stats.limited_samples if request.max_tokens else stats.samples
        kv_forecast = self.kv_forecast_charge and learned >= _KV_FORECAST_SAMPLES
        found = self.predict_all(endpoints, match, prompt, output, now, stats, source, arrivals, request.target_model,
                                 lengths.length_certainty(request.max_tokens), kv_floor, kv_pressure, kv_forecast,
                                 kv_uses)
        saturated = self.saturated_pool and 0 < full == len(endpoints)  # the pool past its capacity
        if saturated:
            self._rank_saturated(found)
        elif self.drain_charge and full * 2 <= len(endpoints):
            _charge_drain(found)
        if self.eviction_charge and returned and not saturated and self.cold_reuse.share >= _REUSED:
            _charge_evictions(endpoints, found, now, self.cold_reuse.share)
        reused = _reused_prefix(match)  # (depth, key) of the prefix this prompt shares with a pod
        young = False
        if reused is not None:
            depth, key = reused
            rate = self._prefix_rates.hit(key, now)
            if self.copy_credit and rate > 0.0:
                self._credit_copies(endpoints, found, match, depth, key, rate, now, room=full == 0)
            young = not saturated and self.young_prefix_charge and self._prefix_rates.young(key, now)
        if match is not None and (saturated or young):
            self._charge_copies(endpoints, found, match, young)
        tail = self.datastore.ttft_tail.seconds
        if self.tail_weight > 0.0 and tail > 0.0:
            _charge_tail(endpoints, found, tail, self.tail_weight)
        predictions = cycle.predictions
        cold_reused = self.cold_reuse.share
        for ep, prediction in zip(endpoints, found):
            prediction.cold_prompts_reused = cold_reused
            predictions[ep.address] = prediction

    def _arrival_rate(self, now: float) -> float:
        """Requests per second reaching the pool, counting this one: the bare average, which reads
        low while the EPP warms up. It is the floor of each pod's arrivals in the decode term (a
        pod nobody is sent to yet still gets its share); corrected for its coverage like the
        pods' own rates, it made every idle pod look busy in the first seconds, and long
        generations then gathered on a few pods of a mixed pool (BENCHMARKS.md)."""
        dt = max(0.0, now - self._rate_at)
        self._rate_at = now
        if self._rate_since < 0.0:
            self._rate_since = now
        self._rate = self._rate * math.exp(-dt / _RATE_WINDOW) + 1.0 / _RATE_WINDOW
        return self._rate

    def _credit_copies(self, endpoints: list[Endpoint], found: list[Prediction], match: PrefixMatch, depth: int,
                       key: int, rate: float, now: float, room: bool = True) -> None:
        """Value a new copy of a reused prefix (`key`, held to `depth` blocks, asked for `rate` times
        a second) on the candidates that lack it.

        Greedy on each request alone, a hot prefix stays on the pods that have it: the first
        pod without it always looks a whole prefill dearer, so its holders fill until their queue
        costs more than that prefill, and every request of the prefix waits that long. A copy is an
        investment: while it is made (its premium, the prefill the holders would not need) the
        prefix's requests keep arriving, and the share of them the new copy would take each gain
        what the best holder costs beyond this candidate's cost with the prefix cached. That gain
        is credited against the premium (never beyond it: a copy never looks cheaper than a hit).
        So with s the best holder's excess over this candidate warm, λ the prefix's arrivals per
        copy and P the premium, a copy is made when s > P / (1 + λ·P): as greedily as before
        (s > P) for a prefix that is rarely reused, and for a hot one (λ·P ≫ 1) once λ·s > 1 —
        the holders' excess delay is more than one request's worth of extra waiting (Little's
        law) — not for a cheap prefix or a holder that is merely a little busier.

        A holder that is slower, not busier, is another case: a copy on a faster pod gains every
        later request of the prefix. In a pool that mixes GPU types, a document placed on a slow
        pod before the EPP had learned its speed otherwise stays there for good (BENCHMARKS.md).
        Such a copy ranks as a hit would: credited its premium and the wait that premium's prefill
        adds to the prefills queued behind it. For a long prefix (`_LONG_PREFIX_TOKENS`) the
        holder to beat is the one this request would take, not the fastest: a document with one
        copy on a fast pod and one on a slow pod sends its requests to the slow one whenever the
        fast one is the busier, and a second fast copy gains each of those. On 50 H100 + 50 A100
        pods of the B2B shape, the documents placed on A100s in the first second (before any
        speed was learned) kept one fast copy each and spilled onto the slow one: 7% of requests
        on A100s at TTFT p50 98 ms against 55 on the H100s, p90 84-89 ms over four seeds against
        the greedy oracle's 77-79 (it places none there); 78-80 so (BENCHMARKS.md round 37). Not
        for a short prefix: a copy of a system prompt pays back on any hot prefix, and crediting
        it past a busy fast holder overrode the balance between GPU types (the multi-tenant mix
        at 1.3x the rate on 8 H100 + 8 A100, TTFT p90 +5-15% over four seeds).

        A prefix on a single pod is the third case: its requests have no choice, so they wait for
        whatever else that pod is doing. A second copy lets each later request take the less busy
        of two, the big step of the power of two choices (on 100 pods of the B2B overload shape,
        the documents left on one pod held 40% of the TTFT tail, p90 102 ms against 75 for those
        on two). The sole holder's excess is averaged over the prefix's requests after its first
        seconds (a moment's queue is no reason: on KV pressure such copies, cold requests every
        one, put the p99 1.7x up; nor the holder's first prefill of it, in a warming pool); if
        that excess, over the requests the copy would take in one window, pays the premium back,
        the copy ranks as a hit would, as a faster pod's does. Only while the pool has `room` (no
        candidate full with a queue): a second copy is prefill spent for shorter tails, which an
        overloaded pool has none of (the mixed pools' B2B overload, p99 1.46x without this).

        The fourth case is that second copy made early (`youngCopyCredit`, `_early_copy`): in the
        prefix's first seconds of reuse (`PrefixRates.young`), on an idle candidate whose cache
        has room for it, it ranks as a hit would. The average excess above needs the prefix's
        history, and by then the copy costs one request a whole cold prefill; in its first
        seconds the prefix's first request is often still being prefilled on the holder, which
        the second would wait for anyway, and a copy made then stays for as long as the caches
        have room. Waiting for the excess, each document of `long-context` stayed on one pod (1.2
        holders per request against the greedy oracle's 3.2, which copies a document whenever its
        first prefill is unfinished), and requests arriving together for a document queued
        behind each other: TTFT p99 79 ms against the oracle's 60 (16 pods, seed 3; 59 so,
        BENCHMARKS.md round 36). A third copy and more likewise, while the best holder still has
        a long prefix's worth of prefill queued (`_LONG_PREFIX_TOKENS`): the request would wait
        that out there too. With two holders at most, 100 pods of that shape had 2.8 pods holding
        a request's document when it was picked against the oracle's 6.3 (4.7 so), and the
        slowest tenth of requests found 13 in flight on their pod against its 11: TTFT p90 46-48
        ms over three seeds against its 45, 43 so (BENCHMARKS.md round 39). Onto idle pods with
        room only, so an overloaded pool's cold start (every pod busy computing its documents)
        makes none; not for short prefixes (a system prompt of a few hundred tokens), whose early
        copies only moved the engine-mix pool's head-of-line traffic (p90 1.20x).
        """
        held, best = _holders(endpoints, found, match.matched, depth)
        if best is None:
            return
        # The rates are this process's; other workers and replicas route the same prefix (their
        # picks reach the shared ledger, so the pool's pick rate over this process's tells how much).
        own_rate = self._rate / coverage(self._rate_since, now)  # (as the pods' rates are read)
        pool_rate = sum(ep.load.rate_at(now) for ep in endpoints)
        if own_rate > 0.0 and pool_rate > own_rate:
            rate *= pool_rate / own_rate
        holders = sum(held)
        per_copy = rate / (holders + 1)
        sole = holders == 1
        # An early copy of a young prefix (the docstring's fourth case): a second holder, or one
        # more while the best holder is still computing a long prefill, which this request would wait out.
        computing = best.queued_prefill >= _LONG_PREFIX_TOKENS
        young = (sole or computing) and room and self.young_copy_credit and self._prefix_rates.young(key, now)
        persistent = self._prefix_rates.excess(key) if sole and room else 0.0  # the sole holder's, on average
        excess = 0.0  # this request's sample of it: over the best candidate with room
        suffix, cached = best.own_prefill, best.cached_tokens
        # The holder speed a copy must beat: the fastest holder's; for a long prefix, that of the
        # holder this request would take (the docstring's second case).
        if cached >= _LONG_PREFIX_TOKENS:
            taken = next(ep for ep, p in zip(endpoints, found) if p is best)
            to_beat = self._idle_hit_seconds(taken, suffix, cached)
        else:
            to_beat = min(self._idle_hit_seconds(ep, suffix, cached) for ep, has in zip(endpoints, held) if has)
        for ep, p, has in zip(endpoints, found, held):
            if has:
                continue
            # The premium: the prefill of the prefix this candidate would not need if it held it,
            # at its own speed (a holder on a slower GPU would make it look smaller than it is).
            warm = self._own_prefill_seconds(ep, suffix, cached)
            premium = p.prefill_work_seconds - warm
            if premium <= 0.0:
                continue
            # A copy adds capacity only where it has room: on a pod whose requests in flight fill
            # its KV the copy's blocks wait for others to end and push another prefix out, and
            # every copy there is one more prefix its queue cycles through (in deep overload,
            # copies onto full pods had each document on 1.7 pods against the weighted sum's
            # 1.3, and every pod recomputing; BENCHMARKS.md).
            free = self._kv_free_tokens(ep)
            if free is not None and free < p.own_prefill + p.output_tokens:
                continue
            # A copy on a faster pod gains every later request of the prefix, not only those
            # arriving while it is made. If that pays its premium back within one window of the
            # prefix's requests (as far ahead as the rate looks back), it is credited in full: the
            # copy ranks as a hit would, without the premium and without the wait the premium's
            # prefill adds to the prefills queued behind it (the externality's prefill term).
            # Differences within the fit's noise are not speed. A second copy of a prefix on one
            # pod is credited so too, once its holder's excess on average pays the premium back
            # over the requests the copy would take (the docstring's third case).
            hit = self._idle_steps_seconds(ep, suffix) + warm  # (`_idle_hit_seconds`, its `warm` reused)
            speedup = to_beat - hit * (1.0 + _SPEED_MARGIN)
            gain = best.cost - (p.cost - premium)
            excess = max(excess, gain)
            faster = speedup > 0.0 and speedup * rate * _RATE_WINDOW >= premium
            early = young and _early_copy(ep, p, best, match)
            if faster or early or (sole and min(gain, persistent) * per_copy * _RATE_WINDOW >= premium):
                u_prefill = min(_MAX_UTILIZATION, ep.load.prefill_utilization_at(now))
                credit, reason = premium / (1.0 - u_prefill), "faster" if faster else "young" if early else "choice"
            else:
                if gain <= 0.0:
                    continue
                credit, reason = min(premium, gain * per_copy * premium), "busy"
            p.cost -= credit
            p.copy_credit, p.copy_reason = credit, reason
        if sole:
            self._prefix_rates.record_excess(key, excess, now)

    @staticmethod
    def _rank_saturated(found: list[Prediction]) -> None:
        """Rank a saturated pool on what each pod will compute again, and keep prefixes on their holders.

        When every candidate's last scrape shows a full KV cache and a queue (`_full_with_queue`), the
        pool is past what it can serve: its backlog grows by every second of work it is given,
        and the requests queued on every pod wait it out. What it serves is then set by how much
        prefill it does again. Three corrections to the cost, for such a pool only:
        - the externality is left out (the cost starts from `credited_ttft`): what a pick adds
          to the waits of the requests after it is the same work on whichever pod it lands,
          each of them full with a queue, and its estimate follows each queue's noise. Kept, a
          deep overload's picks chased it: `flood-sustained` without flow control, TTFT p99
          1.15-1.25x the best other policy's over three seeds, 1.02-1.08x without; the B2B
          overload's TTFT p90 / p99 over eight runs (two pools, five and three seeds) 1.02x /
          1.06x the weighted sum's (geometric mean), 1.00x / 1.02x without (BENCHMARKS.md
          round 32).
          The slot and KV-time charges, parts of it, read 0;
        - each candidate's cost counts the prefill the pod will compute again that the whole
          cache credit leaves out (`Prediction.recompute_seconds`: its cache thrashing, the
          queued requests' prefixes it lost): among a document's holders the one still holding
          it wins. Ranked on it everywhere, a document's requests scatter over pods that each
          compute it again (BENCHMARKS.md); here the charge below keeps them together;
        - a copy of a prefix its holders have is charged (`_charge_copies`).
        Diagnosed on the mixed pool's B2B overload: every pick was on a saturated pool, 2% went
        away from the holders to a pod whose queue looked shorter, and the hit rate was 4 points
        below the weighted sum's, its backlog 2-3 s longer (BENCHMARKS.md).
        """
        for p in found:
            p.cost = p.credited_ttft + p.recompute_seconds
            p.slot_charge = p.kv_time_charge = 0.0
            p.saturated = True

    def _charge_copies(self, endpoints: list[Endpoint], found: list[Prediction], match: PrefixMatch,
                       young: bool = False) -> None:
        """On a saturated pool, charge a copy of the prompt's prefix its prefill at the utilisation
        cap; for a `young` prefix (its first seconds of reuse), at the candidate's queue's load.

        A prefix its holders have computed is work done once; a copy elsewhere is the same work
        done again, and one more prefix in a full cache to push another out. The cost's
        externality charges a prompt's prefill at the pod's own prefill utilisation, which reads
        low on a KV-bound pod (it admits as requests end, not as fast as it prefills), so a copy
        onto a pod whose queue was a little shorter looked cheap. Here the premium (the prefill
        the copy adds to what the best holder would do) is charged at the cap, u / (1 − u) with
        u = 0.95. Priced at the holder's speed, the same for every candidate: a saturated pod
        admits as its running requests end, not at its prefill rate, so a fast GPU absorbs a
        copy no better than a slow one; priced at each candidate's own speed, copies onto the
        fast pods looked cheap and documents piled up there (the 4:12 pool's overload,
        BENCHMARKS.md). Only the copy's premium: charging every candidate's own prefill so put
        more load on the faster pods (their prefill is cheaper), whose queues then grew longest.
        Pods that do not hold the prefix at its deepest match are the candidates for a copy, as
        for the copy credit.

        A young prefix is charged so too short of saturation, but at the load the candidate's
        queue shows rather than the cap: u / (1 - u) with u the share of its next step the
        prefill queued there fills (the cap from 95% of a step). In its first
        `MIN_HISTORY` seconds of reuse a prefix's holder is likely still computing it for the
        first time, so its queue there is that prefill and the prefix's first burst, an excess
        that passes; a copy made then is the same prefill twice within seconds, and one more
        copy in the pool's caches for good. Where a pool's prefixes first arrive together (a
        cold start, a burst of new customers) every pod is busy computing them, and the pods'
        rates, read from a few seconds of history, say too little of it: on 8 H100 + 8 A100 pods,
        B2B overload, the EPP's first 5 s missed the cache 199 times against the weighted sum's
        147 (150 documents), and a pool past its capacity never works that backlog off (TTFT p90
        11.4 s against its 9.2; 9.8 s with this, 10-16% lower on three other seeds; round 29,
        BENCHMARKS.md). An idle candidate is charged nothing, so a burst of a new system prompt
        on an idle pool still spreads; charged at the cap on any queue, such a burst piled onto
        its first holder.
        """
        matched = match.matched
        if not matched:
            return
        held, best = _holders(endpoints, found, matched, max(matched.values()))
        if best is None:
            return
        holder = next(ep for ep, p in zip(endpoints, found) if p is best)
        for ep, p, has in zip(endpoints, found, held):
            if has:
                continue
            premium = self._own_prefill_seconds(holder, p.own_prefill, p.cached_tokens) - best.prefill_work_seconds
            factor = _SATURATED
            if young:  # at the candidate's prefill load now: the share of its next step its queue fills
                u = min(_MAX_UTILIZATION, p.queued_prefill / ep.service.prior.max_batched_tokens)
                factor = u / (1.0 - u)
            if premium > 0.0 and factor > 0.0:
                p.saturation_charge = premium * factor
                p.cost += p.saturation_charge
                p.young_prefix = young

    @staticmethod
    def _idle_steps_seconds(ep: Endpoint, own: int) -> float:
        """The steps' own time of prefilling `own` tokens on `ep` with nothing else running: with
        `_own_prefill_seconds`, a prefix hit's time to first token there, its speed."""
        service = ep.service
        return service.step_scale * service.prior.overhead * max(1, math.ceil(own / service.prior.max_batched_tokens))

    @classmethod
    def _idle_hit_seconds(cls, ep: Endpoint, own: int, cached: int) -> float:
        """A prefix hit's time to first token on idle `ep` (`own` tokens after `cached` ones): its speed."""
        return cls._idle_steps_seconds(ep, own) + cls._own_prefill_seconds(ep, own, cached)

    @staticmethod
    def _own_prefill_seconds(ep: Endpoint, own: int, cached: int) -> float:
        """Pod time to prefill `own` prompt tokens after `cached` cached ones (as `Prediction.prefill_work_seconds`)."""
        prior = ep.service.prior
        return ep.service.prefill_scale * (prior.per_prefill_token * own
                                           + prior.per_attention_pair * own * (cached + own * 0.5))

    def predict(self, ep: Endpoint, match: PrefixMatch | None, prompt: int, output: int, now: float,
                stats: ModelStats, source: str = "", arrivals_per_pod: float = 0.0, model: str = "",
                length_certainty: float = 0.0, kv_floor: bool = False, kv_pressure: bool = False,
                kv_forecast: bool = False) -> Prediction:
        """One candidate's prediction (`predict_all` of one)."""
        return self.predict_all([ep], match, prompt, output, now, stats, source, arrivals_per_pod, model,
                                length_certainty, kv_floor, kv_pressure, kv_forecast)[0]

    def predict_all(self, endpoints: list[Endpoint], match: PrefixMatch | None, prompt: int, output: int,
                    now: float, stats: ModelStats, source: str = "", arrivals_per_pod: float = 0.0,
                    model: str = "", length_certainty: float = 0.0, kv_floor: bool = False,
                    kv_pressure: bool = False, kv_forecast: bool = False,
                    kv_uses: list[float] | None = None) -> list[Prediction]:
        """Every candidate's prediction. This runs for each candidate of every request, so the
        per-request terms are computed once and the cheap cases of each wait are decided inline;
        it computes exactly what `_predict` (the readable form, kept for reference) does, in the
        same order of operations, so the results are identical to the last bit (a test holds
        them so on random states). `kv_uses`: each candidate's `_kv_utilization`, when the caller
        has it already."""
        mean_output = stats.mean_output_tokens
        mean_prompt = stats.mean_prompt_tokens
        unexplained_context = mean_prompt + mean_output * 0.5
        half_output = output * 0.5
        prompt_context = prompt + half_output
        learn = self.learn
        slot_charging = self.slot_charge
        kv_timing = self.kv_time_charge
        assumed_seqs = self.assumed_batch_limit(endpoints)
        exp, ceil = math.exp, math.ceil
        if match is not None:
            per_block = match.tokens_per_block or match.block_size_tokens
            matched, weighted, evicted_tokens = match.matched, match.weighted, match.evicted_tokens
            recompute_share = match.recompute_share
        out: list[Prediction] = []
        append = out.append
        if kv_uses is None:
            kv_uses = [_kv_utilization(ep) for ep in endpoints]
        configured_seqs = self.prior.max_num_seqs
        for ep, kv_use in zip(endpoints, kv_uses):
            load, service, metrics = ep.load, ep.service, ep.metrics
            capacity = metrics.cache_num_blocks * metrics.cache_block_size  # .kv_capacity_tokens
            prior = service.prior
            if match is not None:
                address = ep.address
                credit = weighted.get(address) if weighted else None
                if credit is None:
                    credit = float(matched.get(address, 0))
                cached = int(credit * per_block)
                if cached > prompt - 1:
                    cached = prompt - 1
                evicted = evicted_tokens.get(address, 0) if evicted_tokens else 0
                share = recompute_share.get(address) if recompute_share else None
                recompute = int(cached * share) if share else 0
            else:
                cached = evicted = recompute = 0
            own = prompt - cached
            decoding = float(load.decoding)
            context = float(load.context_tokens)
            waiting_queue = metrics.waiting_queue_size
            unexplained = waiting_queue + metrics.running_requests - load.requests_at_scrape
            if unexplained < 0:
                unexplained = 0
            running_output = float(load.decode_output)
            if unexplained:
                decoding += unexplained
                context += unexplained * unexplained_context
                running_output += unexplained * mean_output
            if load.pending:
                queued = load.backlog_at(now)
            else:
                queued = float(load.prefill_backlog)
                if not queued > 0.0:
                    queued = 0.0
            ledger_queued = queued
            if waiting_queue > load.pending_at_scrape:
                queued += (waiting_queue - load.pending_at_scrape) * mean_prompt
            pairs = load.prefill_pairs + own * (cached + own * 0.5)
            # ServiceModel.ttft(queued + own, pairs, decoding, context), inline
            step_scale, prefill_scale = service.step_scale, service.prefill_scale
            overhead, per_seq, per_context = prior.overhead, prior.per_decode_seq, prior.per_context_token
            per_prefill = prior.per_prefill_token
            prefill_tokens = queued + own
            budget = prior.max_batched_tokens - decoding
            if not budget > 1.0:
                budget = 1.0
            steps = ceil(prefill_tokens / budget)
            if steps < 1:
                steps = 1
            waits = steps + (0.5 if decoding > 0 else 0.0)
            step_feature = waits * (overhead + per_seq * decoding + per_context * context)
            prefill_feature = per_prefill * prefill_tokens + prior.per_attention_pair * pairs
            prefill_seconds = step_scale * step_feature + prefill_scale * prefill_feature
            wait = paced_wait = ranked_only = slot_wait = 0.0
            slots = 1
            if decoding > 0.0:
                ending_output = running_output / decoding  # of the requests running there
                batch_limit = ep.batch_limit  # BatchLimit.limit, inline
                most_running = batch_limit.most_running
                if batch_limit.taken:
                    slots = most_running
                elif configured_seqs and most_running > assumed_seqs:
                    slots = configured_seqs if configured_seqs >= most_running else most_running
                else:
                    slots = assumed_seqs if assumed_seqs >= most_running else most_running
                if load.requests + unexplained >= slots:
                    wait, paced_wait, ranked_only = self._slot_wait(ep, decoding, context, ending_output, unexplained,
                                                                    assumed_seqs, now, length_certainty)
                    slot_wait = wait
                if capacity > 0:  # _kv_wait and _kv_free_tokens, inline
                    used = metrics.kv_cache_usage * capacity
                    if not used > 0.0:
                        used = 0.0
                    footprint = load.footprint_tokens
                    grown = footprint - load.footprint_at_scrape
                    if grown > 0:
                        used += grown
                    ahead = queued - (load.prefill_total - load.prefill_total_at_scrape)  # load.unallocated
                    if not ahead > 0.0:
                        ahead = 0.0
                    short = ahead + own - (capacity - used)
                    if short > 0.0:
                        kv_wait = self._kv_short_wait(load, service, short, prefill_seconds, decoding, context,
                                                      ending_output)
                        wait += kv_wait
                        paced_wait += kv_wait
            if model and metrics.max_active_models > 0:
                wait += self._adapter_wait(ep, model, decoding, context, mean_output)
            step = step_scale * (overhead + per_seq * (decoding + 1.0) + per_context * (context + prompt))
            itl = step + prefill_scale * per_prefill * min(queued, prior.max_batched_tokens)
            share = step_scale * (per_seq + per_context * prompt_context)
            own_seconds = prefill_scale * (per_prefill * own + prior.per_attention_pair * own * (cached + own * 0.5))
            work = own_seconds + output * share
            # EndpointLoad.utilization_at / prefill_utilization_at / rate_at, inline (one decay)
            work_rate, pick_rate, prefill_rate = load.work_rate, load.pick_rate, load.prefill_rate
            if work_rate > 0.0 or pick_rate > 0.0:
                age = now - load.rates_at
                decay = exp(-(age if age > 0.0 else 0.0) / LOAD_RATE_WINDOW) / coverage(load.rates_since, now)
                utilization = work_rate * decay if work_rate > 0.0 else 0.0
                prefill_utilization = prefill_rate * decay if prefill_rate > 0.0 else 0.0
                rate = pick_rate * decay if pick_rate > 0.0 else 0.0
            else:
                utilization = prefill_utilization = rate = 0.0
            kv_overflow = 0.0
            if kv_floor and kv_use > utilization:
                utilization = kv_use
            if capacity > 0:  # _kv_overflow, inline
                overflow = kv_use + (own + output) / capacity - 1.0
                outputs = (running_output * 0.5 + output) / capacity
                if outputs < overflow:
                    overflow = outputs
                if overflow > 0.0:
                    kv_overflow = overflow
            u = utilization if utilization < _MAX_UTILIZATION else _MAX_UTILIZATION
            busy = 1.0 / (1.0 - u)
            if kv_overflow > 0.0:
                busy = max(busy, _BUSY_CAP * (1.0 + kv_overflow * _BUSY_CAP))
            u_prefill = prefill_utilization if prefill_utilization < _MAX_UTILIZATION else _MAX_UTILIZATION
            arrivals = arrivals_per_pod if arrivals_per_pod > rate else rate
            lifetime = output * step
            queued_steps = ceil(queued / budget)
            newcomer_waits = 0.5 + (queued_steps if queued_steps > 1 else 1)
            blocking = own_seconds * (own - budget) / own if own > budget else 0.0
            decode_charge = newcomer_waits * share * arrivals * lifetime * busy
            externality = (decode_charge
                           + (own_seconds * u_prefill + rate * blocking * blocking * 0.5) / (1.0 - u_prefill))
            if evicted:
                externality += prefill_scale * per_prefill * evicted
            kv_time = 0.0
            if waiting_queue > 0 and metrics.kv_cache_usage >= _KV_FULL:  # _full_with_queue, inline
                if kv_timing:
                    kv_time = _kv_time_charge(ep, own + output, own_seconds + lifetime)
                    externality += kv_time
            elif kv_pressure and kv_floor and cached * 2 < prompt and capacity > 0:
                kv_time = _kv_filling_charge(kv_use, capacity, own, output, own_seconds + lifetime)
                externality += kv_time
            elif kv_forecast and kv_floor and lifetime > LOAD_RATE_WINDOW and capacity > 0:
                kv_time = _kv_forecast_charge(ep, kv_use, own, output, own_seconds + lifetime, now)
                externality += kv_time
            # _slot_charge, inline
            slot_charge = rate * slot_wait * lifetime / slots if slot_wait > 0.0 and slot_charging else 0.0
            externality += slot_charge
            chunk_charge = 0.0
            if (load.pending or load.peer_pending) and queued < budget:
                chunk_charge = load.prefilling_at(now) * (prefill_scale * per_prefill * min(own, budget - queued))
                externality += chunk_charge
            if (load.stalled or load.pending) and service.observations:
                wait += load.lateness(now)
            credited = prefill_seconds + wait
            reported_wait = wait - ranked_only
            if paced_wait > 0.0:
                reported_wait -= paced_wait * (1.0 - self._mean_pace_share(load, decoding, running_output,
                                                                            unexplained, mean_output))
            ttft = prefill_seconds + reported_wait
            extra = self._expected_extra(load, now, recompute, ledger_queued) if recompute or load.pending else 0.0
            recompute_seconds = 0.0
            if extra > 0:
                tokens = prefill_tokens + extra
                waits_x = max(1, ceil(tokens / budget)) + (0.5 if decoding > 0 else 0.0)
                ttft = (step_scale * (waits_x * (overhead + per_seq * decoding + per_context * context))
                        + prefill_scale * (per_prefill * tokens + prior.per_attention_pair * pairs)) + reported_wait
                recompute_seconds = ttft - (prefill_seconds + reported_wait)
            drain = self._drain(load, metrics, ttft) if waiting_queue > 0 and load.busy_interval > 0.0 else 0.0
            if drain:
                ttft = drain
            raw_ttft = ttft
            ttft = raw_ttft * service.ttft_factor
            # (by position, in the order of `Prediction`'s fields: several times faster than by name)
            append(Prediction(ttft, credited + externality, queued, own, cached, prompt, output, prefill_seconds, wait,
                              itl, step_feature if learn else 0.0, prefill_feature if learn else 0.0, source, work,
                              own_seconds, recompute, credited, recompute_seconds, reported_wait, raw_ttft, drain,
                              kv_overflow, slot_charge, kv_time, (own + half_output) * (own_seconds + lifetime),
                              decode_charge, busy >= _BUSY_CAP, chunk_charge))
        return out

    def _predict(self, ep: Endpoint, match: PrefixMatch | None, prompt: int, output: int, now: float,
                 stats: ModelStats, source: str = "", arrivals_per_pod: float = 0.0, model: str = "",
                 assumed_seqs: int = 0, length_certainty: float = 0.0, kv_floor: bool = False,
                 kv_pressure: bool = False, kv_forecast: bool = False) -> Prediction:
        """The prediction for one candidate, term by term (what `predict_all` computes faster);
        `assumed_seqs`: `assumed_batch_limit` of the candidates (0: the configured limit)."""
        load, service, metrics = ep.load, ep.service, ep.metrics
        mean_output = stats.mean_output_tokens
        prior = service.prior
        cached = min(match.tokens(ep.address), prompt - 1) if match is not None else 0
        share = match.recompute_share.get(ep.address) if match is not None else None
        recompute = int(cached * share) if share else 0
        own = prompt - cached
        decoding = float(load.decoding)
        context = float(load.context_tokens)
        # Traffic the ledger cannot explain (other replicas, clients bypassing the gateway): what
        # the last scrape showed beyond the EPP's own requests of that moment.
        unexplained = max(0, metrics.waiting_queue_size + metrics.running_requests - load.requests_at_scrape)
        running_output = float(load.decode_output)  # the expected outputs of what runs there
        if unexplained:  # about the model's usual request each
            decoding += unexplained
            context += unexplained * (stats.mean_prompt_tokens + mean_output * 0.5)
            running_output += unexplained * mean_output
        # How soon the running requests end, for the slot and KV waits: a pod full of long
        # generations frees its slots and blocks far later than the model's mean output says.
        ending_output = running_output / decoding if decoding > 0.0 else mean_output
        queued = load.backlog_at(now)
        ledger_queued = queued
        if metrics.waiting_queue_size > load.pending_at_scrape:
            queued += (metrics.waiting_queue_size - load.pending_at_scrape) * stats.mean_prompt_tokens
        pairs = load.prefill_pairs + own * (cached + own * 0.5)
        estimate = service.ttft(queued + own, pairs, decoding, context)
        slot_wait, paced_wait, ranked_only = self._slot_wait(ep, decoding, context, ending_output, unexplained,
                                                             assumed_seqs or self.prior.max_num_seqs, now,
                                                             length_certainty)
        kv_wait = self._kv_wait(ep, own, load.unallocated(queued), estimate.seconds, decoding, context,
                                ending_output)
        paced_wait += kv_wait
        wait = slot_wait + kv_wait + self._adapter_wait(ep, model, decoding, context, mean_output)
        # Requests that should have had their first token long ago and still have not: the pod
        # is that far behind what the ledger's timeline says (stuck on KV, say), and this one
        # would queue behind them.
        if service.observations:  # (without first bytes from it, a stalled one tells nothing)
            wait += ep.load.lateness(now)
        step = service.step_seconds(decoding + 1.0, context + prompt)
        itl = step + service.prefill_scale * prior.per_prefill_token * min(queued, prior.max_batched_tokens)
        # What the pick costs the requests that reach the pod after it, in seconds of their TTFT.
        # While it decodes every step is longer by its share, and each request arriving meanwhile
        # waits that longer step for as many steps as it takes to reach its first token: half the
        # step in flight, then the steps of the queued prefill, its own short chunk in the last
        # (it finds the pod's queue as this one does — a loaded pod stays loaded — but not this
        # one's prefill, done by then). A busy pod amplifies that, since longer steps keep more
        # requests in it longer (u: the pod-seconds of work per second lately sent there). Its
        # prefill delays the prefills that queue behind it, amplified by how busy the pod's
        # prefill is (u_prefill: prefill seconds per second) — not by its decode load: decodes
        # share each step with a prefill chunk and hold no prefill up.
        share = service.step_scale * (prior.per_decode_seq + prior.per_context_token * (prompt + output * 0.5))
        own_seconds = self._own_prefill_seconds(ep, own, cached)
        work = own_seconds + output * share
        # ... of its compute, or of its KV cache where that is fuller (`_kv_utilization`); and,
        # however full the others, beyond the cap where the pick would overflow the KV cache
        # (`_kv_overflow`).
        utilization = load.utilization_at(now)
        if kv_floor:
            utilization = max(utilization, _kv_utilization(ep))
        kv_overflow = _kv_overflow(ep, own, output, running_output)
        u = min(_MAX_UTILIZATION, utilization)
        busy = 1.0 / (1.0 - u)
        if kv_overflow > 0.0:  # the tangent of 1 / (1 - u) at the cap, continued by the overflow
            busy = max(busy, _BUSY_CAP * (1.0 + kv_overflow * _BUSY_CAP))
        u_prefill = min(_MAX_UTILIZATION, load.prefill_utilization_at(now))
        arrivals = max(load.rate_at(now), arrivals_per_pod)
        lifetime = output * step  # its decode, at the pod's steady step (the queued prefill passes)
        budget = max(1.0, prior.max_batched_tokens - decoding)
        newcomer_waits = 0.5 + max(1, math.ceil(queued / budget))
        # A prompt longer than a step's budget holds the pod's prefill for the steps it fills
        # alone, and the requests sent here meanwhile wait for the rest of them: half of it each
        # on average (M/G/1's λ·S²/2, at the pod's own pick rate). A cold copy of a long document
        # on a pod that others' requests keep coming to costs them that.
        blocking = own_seconds * (own - budget) / own if own > budget else 0.0
        decode_charge = newcomer_waits * share * arrivals * lifetime * busy
        externality = (decode_charge
                       + (own_seconds * u_prefill + load.rate_at(now) * blocking * blocking * 0.5) / (1.0 - u_prefill))
        # A full cache evicts some other prompt's prefix for this one's new blocks: that prompt's
        # next request pays the prefill again.
        evicted = match.evicted_tokens.get(ep.address, 0) if match is not None else 0
        if evicted:
            externality += service.prefill_scale * prior.per_prefill_token * evicted
        # On a pod whose KV cache is full with a queue its new blocks, for as long as it holds
        # them, hold up the requests queued there (`_kv_time_charge`).
        kv_time = 0.0
        if _full_with_queue(metrics):
            if self.kv_time_charge:
                kv_time = _kv_time_charge(ep, own + output, own_seconds + lifetime)
                externality += kv_time
        # Short of that, while the pool's caches bind, a prompt the pod does not hold brings them
        # to a cache that, the fuller it is, the more requests will queue at for blocks
        # (`_kv_filling_charge`).
        elif kv_pressure and kv_floor and cached * 2 < prompt and metrics.kv_capacity_tokens > 0:
            kv_time = _kv_filling_charge(_kv_utilization(ep), metrics.kv_capacity_tokens, own, output,
                                         own_seconds + lifetime)
            externality += kv_time
        # Else a request that will hold its blocks longer than the rates remember, on a pod the
        # requests lately sent will fill, is charged the same (`_kv_forecast_charge`).
        elif kv_forecast and kv_floor and lifetime > LOAD_RATE_WINDOW and metrics.kv_capacity_tokens > 0:
            kv_time = _kv_forecast_charge(ep, _kv_utilization(ep), own, output, own_seconds + lifetime, now)
            externality += kv_time
        # On a pod whose batch slots are all taken it will hold one for its decode, and the
        # requests sent there while it waits queue behind it: each waits its share of the slots'
        # time longer (`_slot_charge`).
        slot_charge = self._slot_charge(ep, slot_wait, lifetime, assumed_seqs or self.prior.max_num_seqs, now)
        externality += slot_charge
        # vLLM packs the waiting prefills into one step, first come first served: when what is
        # queued fits in the next step, this prompt fills the rest of it with a chunk, and each
        # request still prefilling there gets its first token that chunk's time later.
        chunk_charge = 0.0
        if (load.pending or load.peer_pending) and queued < budget:
            chunk_seconds = service.prefill_scale * prior.per_prefill_token * min(own, budget - queued)
            chunk_charge = load.prefilling_at(now) * chunk_seconds
            externality += chunk_charge
        credited = estimate.seconds + wait
        # The prediction counts the prefill the pod is expected to do that the credit leaves out:
        # this prompt's blocks it will compute again, the queued prompts' likewise, and the queued
        # prefill well past its expected end with no first token (the timeline counts it done).
        # The cost keeps the whole credit: a prefix's requests kept together share it once back.
        # The slot and KV waits above assume the running requests end at their mean output's
        # pace; really the short ones end first and free theirs sooner (the harmonic mean of the
        # outputs sets the pace). The prediction takes that pace; the ranking keeps the mean's,
        # a pod's long generations weighing on it as a whole; likewise where the expected ends
        # free a slot sooner than the mean's pace, the ranking keeps the pace.
        reported_wait = wait - ranked_only
        if paced_wait > 0.0:
            reported_wait -= paced_wait * (1.0 - self._mean_pace_share(load, decoding, running_output,
                                                                        unexplained, mean_output))
        extra = self._expected_extra(load, now, recompute, ledger_queued)
        ttft = estimate.seconds + reported_wait
        recompute_seconds = 0.0
        if extra > 0:
            ttft = service.ttft(queued + own + extra, pairs, decoding, context).seconds + reported_wait
            recompute_seconds = ttft - (estimate.seconds + reported_wait)
        drain = self._drain(load, metrics, ttft)
        if drain:
            ttft = drain
        # What is left the pod's calibration corrects: its own median ratio of observed to
        # predicted (`ServiceModel.calibrate`).
        raw_ttft = ttft
        ttft = raw_ttft * service.ttft_factor
        return Prediction(
            ttft=ttft,
            cost=credited + externality,
            work_seconds=work,
            prefill_work_seconds=own_seconds,
            queued_prefill=queued,
            own_prefill=own,
            cached_tokens=cached,
            prompt_tokens=prompt,
            output_tokens=output,
            prefill_seconds=estimate.seconds,
            wait_seconds=wait,
            itl=itl,
            step_feature=estimate.step_feature if self.learn else 0.0,
            prefill_feature=estimate.prefill_feature if self.learn else 0.0,
            prefix_source=source,
            recompute_tokens=recompute,
            credited_ttft=credited,
            recompute_seconds=recompute_seconds,
            paced_wait_seconds=reported_wait,
            raw_ttft=raw_ttft,
            drain_seconds=drain,
            kv_overflow=kv_overflow,
            slot_charge=slot_charge,
            kv_time_charge=kv_time,
            kv_token_seconds=(own + output * 0.5) * (own_seconds + lifetime),
            decode_charge=decode_charge,
            at_busy_cap=busy >= _BUSY_CAP,
            chunk_charge=chunk_charge,
        )

    @staticmethod
    def _drain(load: EndpointLoad, metrics: EndpointMetrics, ttft: float) -> float:
        """The prediction of a pod whose KV cache is full and whose queue is not empty, when it
        is later than `ttft` (0 otherwise).

        Such a pod admits its queue as its running requests end, at a pace the step model does
        not know (it depends on how long they run, and how much of the cache a prompt takes);
        while it is so, the pace measured between its first tokens says how long this request's
        turn is (`EndpointLoad.drain_seconds`). The prediction takes the later of the two. Not
        the ranking: on the pods it affects every candidate is full, and ranked on it a prefix's
        requests spread over pods that each compute it again (`_charge_drain` ranks a cold prompt on it)."""
        if load.busy_interval <= 0.0 or not _full_with_queue(metrics):
            return 0.0
        drain = load.drain_seconds(metrics.waiting_queue_size)
        return drain if drain > ttft else 0.0

    @staticmethod
    def _expected_extra(load: EndpointLoad, now: float, recompute: int, ledger_queued: float) -> float:
        """Prefill tokens the pod will compute before this request's first token beyond what the
        ranking's queue counts: this prompt's `recompute`, the queued prefill well past its
        expected end and still without a first token, and the queued prompts' own recompute (as
        much of it as is still ahead by the timeline)."""
        extra = float(recompute)
        if load.pending:
            late = load.late_prefill(now)
            extra += late
            if load.recompute_backlog > 0 and load.prefill_backlog > 0:
                extra += load.recompute_backlog * min(1.0, (ledger_queued + late) / load.prefill_backlog)
        return extra

    @staticmethod
    def _mean_pace_share(load: EndpointLoad, decoding: float, running_output: float, unexplained: int,
                         mean_output: float) -> float:
        """The mean output's pace of ending over the running requests' own (Σ 1 / output): ≤ 1,
        the factor that turns a wait paced by the mean into the real one."""
        by_mean = decoding / max(1.0, running_output / decoding * 0.5)
        by_each = 2.0 * (load.decode_ending / ENDING_UNIT + unexplained / max(2.0, mean_output))
        return min(1.0, by_mean / by_each) if by_each > 0.0 else 1.0

    @staticmethod
    def _completions_per_second(service_step: float, decoding: float, mean_output: float) -> float:
        """How fast running requests end: each needs about half its expected output still
        (`mean_output`: the mean of what runs there)."""
        remaining = max(1.0, mean_output * 0.5)
        return decoding / (remaining * max(service_step, 1e-6))

    def assumed_batch_limit(self, endpoints: list[Endpoint]) -> int:
        """The batch limit of a candidate whose own scrapes have not shown one yet: the smallest
        that another candidate's have (the pods of a pool run one engine configuration), else
        `maxNumSeqs`. Learned pod by pod, the pods that had shown their limit looked full and the
        one that had not drew every request until it ran twice its slots (`bench.routing hol`'s
        pods, `max_num_seqs` 8: TTFT p99 3x the oracle's, BENCHMARKS.md). A pod that runs more
        than that runs another configuration, and is held to `maxNumSeqs` until its own scrapes
        show its limit (`BatchLimit.limit`)."""
        shown = [ep.batch_limit.most_running for ep in endpoints if ep.batch_limit.taken]
        return min(self.prior.max_num_seqs, min(shown)) if shown else self.prior.max_num_seqs

    def _slot_wait(self, ep: Endpoint, decoding: float, context: float, mean_output: float, unexplained: int,
                   assumed_seqs: int, now: float, length_certainty: float) -> tuple[float, float, float]:
        """Seconds until a batch slot frees when the pod already runs its batch limit of requests
        (its own, else `assumed_seqs`), as ranked; of that, the part paced by the running requests'
        mean output, and the part only the ranking counts.

        Two views of when the running requests end. Paced: each has about half its expected
        output still to go, so they end at a steady rate — right when lengths vary (a response
        stops at its own end of text), wrong for a batch that started together with known
        lengths: 256 requests of 800 tokens sent at once free no slot for 800 steps, where the
        pace says one every 3 (in a flood on 4 pods the request sent to a full pod waited 12 s
        for a slot, and the flood took 1.33× as long: `bench.flowcontrol`'s
        `flood-short-prompts`). Expected ends: the ledger's own requests there, each ending when
        its expected output is done, counted in the pod's steps and priced at the step its batch
        runs now. `length_certainty` (the share of responses that run to their `max_tokens`)
        weighs the second. The prediction takes the expected end; the ranking the later of the
        two, as it keeps the mean's pace over the faster real one (a pod full of long generations
        stays full for the requests after this one): ranked on the expected ends alone, short
        requests crowded full pods (`head-of-line` on 8 H100 + 8 A100, TTFT p90 +23–94% on three
        seeds).

        The paced wait is a mean, and the widest-spread part of a TTFT: with the lengths unknown,
        the running requests end as a random stream, so the wait for the `needed`-th end has a
        standard deviation of the mean / √needed (an Erlang wait: as large as the mean itself
        for the next free slot). The bars are on the tail, so the ranking (never the
        prediction) takes the paced part at its mean + `_SLOT_WAIT_SPREAD` standard deviations:
        ranked at its mean, a full pod holding a prompt's prefix drew 9% of the requests on
        pods of 32 slots beside pods of 256, predicted a 38 ms wait, and waited up to 10× that
        (`zipf-system-prompts`, TTFT p99 186 ms against the greedy oracle's 77; 59 ranked so).

        A queue deeper than the ends looked up (`_MAX_ENDS_LOOKED_UP`) that the pod's scrape shows
        waiting is ranked at least at the pace the pod has been measured to admit it
        (`EndpointLoad.drain_seconds`: its first tokens while backlogged come as its slots free).
        Both estimates above price the ends at the step model's pace, which in a deep overload
        reads the steps short (they carry the prefill of each admission), and the cap's end is
        only a bound: in a flood at twice 4 pods' capacity (`flood-sustained` without flow
        control) the ranking's wait read 3-5 s for queues of 300-470 requests that took 30-45 s,
        and the pods' queues drifted apart (TTFT p99 52 s against least-queue's 37; 44 s ranked
        so, BENCHMARKS.md round 30). The prediction keeps its own estimate."""
        running = ep.load.requests + unexplained
        limit = ep.batch_limit.limit(assumed_seqs, self.prior.max_num_seqs)
        if running < limit or decoding <= 0.0:
            return 0.0, 0.0, 0.0
        step = ep.service.step_seconds(decoding, context)
        needed = running - limit + 1
        paced = needed / self._completions_per_second(step, decoding, mean_output)
        # (deeper than the cap, the cap's end: a lower bound, so never a deep queue's advantage)
        steps = ep.load.steps_until_end(min(needed, _MAX_ENDS_LOOKED_UP), now) if length_certainty > 0.0 else -1.0
        spread = _SLOT_WAIT_SPREAD / math.sqrt(needed)  # of the paced part, ranked only
        measured = 0.0
        if needed > _MAX_ENDS_LOOKED_UP and ep.metrics.waiting_queue_size > 0:
            measured = ep.load.drain_seconds(ep.metrics.waiting_queue_size)
        if steps < 0.0:  # lengths not known, or too few of our requests there to say
            if measured > paced * (1.0 + spread):
                return measured, paced, measured - paced
            return paced * (1.0 + spread), paced, paced * spread
        # Priced at the decode step of the batch now: the count's pace (prefill chunks that came
        # and went) says how fast steps went, not how the next ones will (divided by it, the
        # 4:12 load balancing's TTFT prediction error went 9.4% → 11.8%, its p99 7.1 → 12.7 s).
        expected = steps * step
        paced_part = (1.0 - length_certainty) * paced
        tail = paced_part * spread
        ranked = length_certainty * max(expected, paced) + paced_part + tail
        if needed > _MAX_ENDS_LOOKED_UP:  # a bound, not the expected end: the prediction is the ranking's
            if measured > ranked:
                return measured, paced_part, measured - ranked + tail
            return ranked, paced_part, tail
        return ranked, paced_part, length_certainty * max(0.0, paced - expected) + tail

    def _slot_charge(self, ep: Endpoint, slot_wait: float, lifetime: float, assumed_seqs: int, now: float) -> float:
        """What a request that waits `slot_wait` for a batch slot costs the requests sent to the pod
        after it: once it has a slot it holds it for its decode (`lifetime`), so each request that
        queues behind it meanwhile waits its share of the slots' time longer, lifetime / slots;
        those are the pod's arrivals during its own wait. A long generation on a pod of few slots
        full of long generations is charged most. Without it, on a pool mixing 32-slot and
        256-slot engines (`head-of-line`), the long generations gathered on the 32-slot pods
        (two thirds of them, on half the pool), their wait for a slot (10 s) looking cheaper than
        what their decode costs the busy 256-slot pods' short requests: TTFT p99 9.9 s, 5.7 s
        with it (least-queue's 4.5; BENCHMARKS.md round 28). Round 26 charged the wait's own
        share instead (rate × wait² / the slot ends it needs): blind to how long the request
        will hold its slot, it made that p99 34.8 s."""
        if slot_wait <= 0.0 or not self.slot_charge:
            return 0.0
        slots = ep.batch_limit.limit(assumed_seqs, self.prior.max_num_seqs)
        return ep.load.rate_at(now) * slot_wait * lifetime / slots

    def _adapter_wait(self, ep: Endpoint, model: str, decoding: float, context: float, mean_output: float) -> float:
        """Seconds until a LoRA adapter the pod is not running can join its batch: vLLM runs at
        most `max_lora` adapters at once, so with every slot taken the request waits until one
        adapter's requests have all ended (about one request's remaining decode); a free slot
        costs the adapter's load."""
        m = ep.metrics
        if not model or m.max_active_models <= 0 or model in m.models or model in m.active_models:
            return 0.0
        ours = ep.load.models
        if ours.get(model, 0) > 0:
            return 0.0
        busy = len(m.active_models | {name for name in ours if name not in m.models})
        if busy < m.max_active_models:
            return _ADAPTER_LOAD_SECONDS
        step = ep.service.step_seconds(decoding, context)
        return _ADAPTER_LOAD_SECONDS + max(1.0, mean_output * 0.5) * step

    @staticmethod
    def _kv_free_tokens(ep: Endpoint) -> float | None:
        """KV tokens free on the pod (None: it does not say its cache size): the scrape's, less
        what the EPP sent since (its ledger grew by that much)."""
        m = ep.metrics
        capacity = m.kv_capacity_tokens
        if capacity <= 0:
            return None
        used = max(m.kv_cache_usage * capacity, 0.0) + max(0, ep.load.footprint_tokens - ep.load.footprint_at_scrape)
        return capacity - used

    def _kv_wait(self, ep: Endpoint, own: int, ahead: float, prefill_seconds: float, decoding: float,
                 context: float, mean_output: float) -> float:
        """Seconds the pod's KV cache adds before this prompt's first token, beyond its prefill.

        vLLM admits waiting prompts first come first served, each as its blocks fit: the queued
        prefill `ahead` (not yet counted as held) takes the free blocks first, then this prompt's
        uncached ones. What does not fit waits for requests to end, each freeing what it holds
        (its prompt and its output). The queue drains at the slower of its prefill and those
        admissions, so the wait is what the admissions take beyond `prefill_seconds` (the queue's
        and this prompt's prefill)."""
        if decoding <= 0.0:
            return 0.0
        free = self._kv_free_tokens(ep)
        if free is None:
            return 0.0
        short = ahead + own - free
        if short <= 0.0:
            return 0.0
        return self._kv_short_wait(ep.load, ep.service, short, prefill_seconds, decoding, context, mean_output)

    def _kv_short_wait(self, load: EndpointLoad, service: ServiceModel, short: float, prefill_seconds: float,
                       decoding: float, context: float, mean_output: float) -> float:
        """`_kv_wait` once the prompt is `short` tokens of blocks: the admissions' time for them."""
        freed_per_request = load.footprint_tokens / load.requests if load.requests > 0 else context / decoding
        step = service.step_seconds(decoding, context)
        freed_per_second = self._completions_per_second(step, decoding, mean_output) * freed_per_request
        return max(0.0, short / max(freed_per_second, 1.0) - prefill_seconds)


def _reused_prefix(match: PrefixMatch | None) -> tuple[int, int] | None:
    """The prefix this prompt shares with some pod, as (depth, key): the deepest block a
    candidate holds and that block's key (`PrefixRates`); None when no candidate holds any."""
    if match is None or not match.matched or not match.hashes:
        return None
    depth = max(match.matched.values())
    if depth <= 0 or depth > len(match.hashes):
        return None
    return depth, match.hashes[depth - 1]


def _holders(endpoints: list[Endpoint], found: list[Prediction], matched: dict[str, int],
             depth: int) -> tuple[list[bool], Prediction | None]:
    """Which candidates hold the prompt's prefix to its deepest match (`depth` blocks), and the
    cheapest of them; None for it when none or every candidate does (there is no copy to make)."""
    held = [depth > 0 and matched.get(ep.address, 0) >= depth for ep in endpoints]
    holders = [p for p, has in zip(found, held) if has]
    if not holders or len(holders) == len(found):
        return held, None
    return held, min(holders, key=lambda p: p.cost)


def _early_copy(ep: Endpoint, p: Prediction, best: Prediction, match: PrefixMatch) -> bool:
    """Whether candidate `ep` (prediction `p`) takes a young prefix's second copy early
    (`_credit_copies`' fourth case): nothing queued to prefill there, a prefix of at least
    `_LONG_PREFIX_TOKENS` (what the copy computes that the best holder, `best`, does not), nothing
    evicted for it, and its cache under `_YOUNG_COPY_KV` full with this prompt and output."""
    capacity = ep.metrics.kv_capacity_tokens
    return (p.queued_prefill <= 0 and p.own_prefill - best.own_prefill >= _LONG_PREFIX_TOKENS
            and not match.evicted_tokens.get(ep.address, 0) and capacity > 0
            and _kv_utilization(ep) + (p.prompt_tokens + p.output_tokens) / capacity < _YOUNG_COPY_KV)


def _charge_drain(found: list[Prediction]) -> None:
    """Rank a cold prompt on a full pod with a queue at the pace that pod admits (its drain);
    the caller has checked that at least half the candidates are not full with a queue.

    Such a pod admits as its running requests end; the step model cannot see that, so its
    credited TTFT reads as a pod with room would, and prompts kept queueing there for admission
    (the 4 H100 + 12 A100 pool's multi-tenant mix: its H100s full with a queue, the A100s with
    room; BENCHMARKS.md). The prediction already says it (`Prediction.drain_seconds`); here the
    cost is charged what the drain adds to the credited TTFT, on two conditions:
    - the prompt is cold there (under half of it cached): it computes most of it wherever it
      goes, so moving it loses no affinity. A prefix's requests ranked on the drain spread over
      pods that each compute it again (why the drain is otherwise left out of the ranking);
    - at least half the candidates have room (not full with a queue). With most of the pool full
      (an overload short of saturation), cold prompts moved off the full pods piled onto the few
      with room: the 8 H100 + 8 A100 pool's overload p99 12.4 → 15.2 s without this condition.
    """
    for p in found:  # (a drain is set only on a pod full with a queue)
        if p.drain_seconds > 0.0 and p.cached_tokens * 2 < p.prompt_tokens:
            p.drain_charge = max(0.0, p.drain_seconds - (p.credited_ttft or p.ttft))
            p.cost += p.drain_charge


def _charge_evictions(endpoints: list[Endpoint], found: list[Prediction], now: float, reused: float) -> None:
    """Charge a copy of a prompt that came back on a pod whose cache turns over too fast to keep it.

    A prompt asked for again soon after it came in cold (`ColdReuse`: a document, a conversation,
    a customer's context) is placed for its later requests too, and they find it only if the pod
    still holds it. A pod's cache turns over in its KV capacity over the uncached prompt tokens per
    second lately sent to it; a copy on a pod that turns over in under `_REUSE_HORIZON` seconds is
    likely evicted before the next request, which then computes it again. So the cost of a
    candidate that holds less than half the prompt is charged that recompute: its own prefill
    there × `reused` (the pool's share of cold prompts asked for again) × (1 − turnover / horizon).
    Diagnosed on 8 H100 + 8 A100 pods, B2B shared context (seed 3): the H100s' faster prefill drew
    82% of the traffic and 32-42 customer contexts each where ~10 fit, so 31% of the requests after
    warm-up computed their 6k-token context again while the A100s (3-5 contexts each) had room;
    TTFT p99 471 ms against the greedy oracle's 327, 311 with this (BENCHMARKS.md).
    Only for a prompt that came back: charged for every prompt of a pool whose prompts are mostly
    reused, a long one-off prompt or a system prompt's next chat was pushed off the fast pods onto
    slow ones with a backlog (4 H100 + 12 A100 head-of-line p99 3.0 -> 43-51 s). Only while at
    least a quarter of the candidates' caches outlast the horizon: where nearly all turn over fast
    (an overload) there is nowhere to keep a copy, and the charge, largest on the slowest prefill,
    piled the copies onto the fast pods (the mixed pool's B2B overload, p99 11.3 -> 17.8 s). The
    prediction does not change, only the ranking."""
    turnovers: list[float] = []
    for ep, p in zip(endpoints, found):
        m, load = ep.metrics, ep.load
        capacity = m.cache_num_blocks * m.cache_block_size  # .kv_capacity_tokens
        # Uncached tokens per second sent here: its prefill seconds per second, at its speed for a
        # prompt of this length (`_own_prefill_seconds` of it with nothing cached, inline).
        prompt, service = p.prompt_tokens, ep.service
        prior = service.prior
        seconds = service.prefill_scale * (prior.per_prefill_token * prompt
                                           + prior.per_attention_pair * prompt * (prompt * 0.5))
        tokens_per_second = 0.0
        if seconds > 0.0 and load.prefill_rate > 0.0:  # load.prefill_utilization_at(now), inline
            age = now - load.rates_at
            utilization = load.prefill_rate * (math.exp(-(age if age > 0.0 else 0.0) / LOAD_RATE_WINDOW)
                                               / coverage(load.rates_since, now))
            tokens_per_second = utilization * prompt / seconds
        turnovers.append(capacity / tokens_per_second if capacity > 0 and tokens_per_second > 0.0 else math.inf)
    if sum(1 for t in turnovers if t >= _REUSE_HORIZON) * 4 < len(turnovers):
        return
    for p, turnover in zip(found, turnovers):
        if turnover < _REUSE_HORIZON and p.own_prefill * 2 >= p.prompt_tokens:  # (holding half: not a copy)
            p.eviction_charge = reused * (1.0 - turnover / _REUSE_HORIZON) * p.prefill_work_seconds
            p.cost += p.eviction_charge


def _charge_tail(endpoints: list[Endpoint], found: list[Prediction], tail: float, weight: float) -> None:
    """Weigh the TTFT tail the bars are on: charge each candidate `weight` × the seconds its
    credited TTFT runs beyond the pool's tail (`TtftTail`, p90 by default) or beyond the fastest
    candidate's, whichever is later, and its externality `weight` × the share of the pod's
    recent first tokens beyond the tail.

    The cost is a sum of TTFTs: this request's, and the small delays its decode and prefill add
    to the many requests sent to the pod after it. Minimising that sum minimises the mean, and
    it will make one request wait long to save many a little each, which is how a mean falls
    while its tail grows. Add to the sum `weight` × the seconds each request spends beyond the
    tail (the conditional value at risk at the tail's quantile, in the form one pick can
    charge): this request's excess counts 1 + `weight` times, and the delay it adds to another
    request 1 + `weight` times where that request is itself beyond the tail, which on this pod
    lately was `EndpointLoad.tail_share` of them. A pick that saves a pod's fast requests a few
    milliseconds each by queueing this one for a slot now counts what it really does to the
    tail, and so does one that delays a pod whose requests already wait long.
    Diagnosed on 8 H100 at vLLM's defaults beside 8 with 32 slots and a 2,048-token budget,
    `prefix-heavy`: every request of the TTFT's top 2% was a chat turn queued 150-400 ms for a
    slot on the small pod that held its context, its decode 0.4-1.4 s of externality on the
    fast pods (busy factor ~7); p99 315 ms against the greedy oracle's 228 (BENCHMARKS.md round
    30). The excess is counted from the fastest candidate's TTFT where that is beyond the tail
    too: the wait no candidate avoids (a pool in overload, every request beyond the tail) is
    this request's whatever the pick, and charged so it weighed this request's TTFT (1 +
    `weight`)× against the others' everywhere (the 4:12 pool's B2B overload 22.0 → 23.3 s at
    p90; 21.1 s counted from the fastest). A fixed TTFT bound would not do either: in an
    overload every request is beyond it, and the tail moves with the load."""
    floor = max(tail, min(p.credited_ttft for p in found))  # what no candidate avoids is not charged
    for ep, p in zip(endpoints, found):
        charge = weight * ep.load.tail_share * (p.cost - p.credited_ttft)
        if p.credited_ttft > floor:
            charge += weight * (p.credited_ttft - floor)
        if charge > 0.0:
            p.tail_charge = charge
            p.cost += charge


def _kv_utilization(ep: Endpoint) -> float:
    """Share of the pod's KV cache in use, and about to be: its last scrape's, plus the prompt
    tokens the EPP sent it since that it will compute, plus the output its decoding requests have
    yet to write (half of what each is expected to write: about half way through it) (0: the pod
    does not say its cache size).

    The externality's busy factor 1 / (1 - u) takes the larger of this and the pod's compute
    utilisation: a pod whose cache its running requests fill admits the next ones only as they
    end, however fast its steps. Without it, the fast GPUs of a mixed pool (4 H100 + 12 A100, the
    multi-tenant mix) drew the long prompts and long batch generations until their caches were
    full and preempting, while the slower pods' caches were 10-40% used; the TTFT p99 there was
    1.2-1.6x the greedy oracle's (BENCHMARKS.md). Counted in
    uncached tokens since the scrape: a prompt that hits a prefix the pod holds shares its blocks.
    The output still to come is what a scrape cannot show: a long generation grows its blocks
    for as long as it runs. Counted at what they held, four of 8 H100s beside 8 A100s drew
    99-126 long generations each (the other pods 16-57), their caches filled as those grew, and
    they preempted 25-95 requests each while the requests queued there waited up to 50 s
    (`head-of-line`, seed 4: TTFT p90 511 ms against the weighted sum's 380; 195 so)."""
    m = ep.metrics
    capacity = m.kv_capacity_tokens
    if capacity <= 0:
        return 0.0
    load = ep.load
    used = (max(m.kv_cache_usage, 0.0) * capacity + max(0, load.prefill_total - load.prefill_total_at_scrape)
            + load.decode_output * 0.5)
    return used / capacity


def _kv_states(endpoints: list[Endpoint]) -> tuple[list[float], int, int]:
    """Each candidate's `_kv_utilization`, how many are below `_KV_FULL` by it, and how many are
    full with a queue (`_full_with_queue`): one pass, as every pick needs all three."""
    uses: list[float] = []
    with_room = full = 0
    for ep in endpoints:
        m = ep.metrics
        capacity = m.cache_num_blocks * m.cache_block_size  # .kv_capacity_tokens
        usage = m.kv_cache_usage
        if m.waiting_queue_size > 0 and usage >= _KV_FULL:
            full += 1
        if capacity <= 0:
            use = 0.0
        else:  # _kv_utilization, inline
            load = ep.load
            grown = load.prefill_total - load.prefill_total_at_scrape
            use = ((usage if usage > 0.0 else 0.0) * capacity + (grown if grown > 0 else 0)
                   + load.decode_output * 0.5) / capacity
        if use < _KV_FULL:
            with_room += 1
        uses.append(use)
    return uses, with_room, full


def _kv_overflow(ep: Endpoint, own: int, output: int, running_output: float) -> float:
    """The share of the pod's KV cache its requests would need beyond its capacity with this
    request's: a pick that forces preemption (0: none).

    `_kv_utilization` counts what the pod holds and is about to (the outputs its running
    requests have yet to write, about half of each); on top of that, this request's uncached
    prompt and its output. Only what the outputs write counts as overflow (theirs and its own):
    a prompt that does not fit now waits for blocks to free (`_kv_wait`), where vLLM admits it.

    vLLM preempts the newest running request when a step finds no free block, and admits
    nothing while its cache is short: every request queued on the pod then waits for running
    ones to end. The busy factor's cap (u = 0.95) cannot see that, since a pool near its decode
    capacity reads at the cap on every pod; so an overflowing pick's busy factor continues
    along the tangent of 1 / (1 - u) past the cap, by the overflow. Diagnosed on 8 H100 + 8 A100
    pods, `head-of-line` seed 4: every pod read at the cap, one H100 that short requests
    avoided drew 37 long generations in 5 s (2-4 on each other pod), its cache overflowed, it
    preempted and admitted nothing for a minute, and 1% of the requests waited 40-60 s (TTFT
    p90 / p99 195 / 1,296 ms against the weighted sum's 380 / 981; 159 / 585 so; BENCHMARKS.md).

    Counted whatever the pool's fill, unlike the KV floor of the busy factor (`_kv_utilization`,
    which would put every pod at the cap once most caches read full): whether this request fits
    is a difference between pods however full the others are. Counted only while half the
    caches had room, the last seconds of `head-of-line-heavy` (16 pods, 13-15 of them past
    `_KV_FULL` with what their long generations had yet to write) sent long prompts to pods at
    0.99-1.00, the costs within 2% of each other, where they queued 1-2.8 s while a few pods had
    room; and `head-of-line` at 1.3x its rate read TTFT p99 375 ms against the oracle's 200
    (253 so; BENCHMARKS.md round 42)."""
    capacity = ep.metrics.kv_capacity_tokens
    if capacity <= 0:
        return 0.0
    return max(0.0, min(_kv_utilization(ep) + (own + output) / capacity - 1.0,
                        (running_output * 0.5 + output) / capacity))


def _kv_time_charge(ep: Endpoint, tokens: int, seconds: float) -> float:
    """What a request that brings `tokens` new KV tokens (its uncached prompt and its output) to
    a pod whose KV cache is full with a queue (`_full_with_queue`), holding them `seconds` (its
    prefill and decode there), costs the requests queued there: each waits the share of the
    cache's time it takes, tokens / capacity × seconds, longer. Counted for the requests queued
    now (the last scrape's and those sent since), at most `_SATURATED` of them (the busy
    factor's cap, u / (1 - u) at u = 0.95); 0 when the pod does not say its cache size.

    Such a pod admits its queue as running requests free blocks, not at its step pace: its
    throughput is its capacity over the KV-seconds each request holds, and what a pick costs
    there is its blocks, not its compute. A hit on a document's holder brings its question's
    blocks; a copy of the document on another full pod brings the document's too, five times
    as many on the B2B shape. The compute externality charges a copy's prefill at the pod's
    prefill load, which on a KV-bound pod reads 0.5-0.8 (it cannot prefill faster than blocks
    free), so copies onto full pods looked nearly free: on 8 H100 + 8 A100 pods, B2B overload,
    the EPP missed the cache 355 times in the first 15 s against the weighted sum's 266, a
    backlog the pool, past its capacity, never worked off (TTFT p90 over five seeds 10.2 s
    against the weighted sum's 9.1; 9.3 s so, BENCHMARKS.md round 31). The cap keeps a deep
    overload's charge from following its queues' noise: counted for every request queued, it
    scaled with queues of 300-500 (`flood-sustained` without flow control, TTFT p99 1.33x
    least-queue's, 1.15-1.25x so)."""
    load, metrics = ep.load, ep.metrics
    capacity = metrics.kv_capacity_tokens
    if capacity <= 0:
        return 0.0
    queued = metrics.waiting_queue_size + max(0, len(load.pending) - load.pending_at_scrape)
    return tokens / capacity * seconds * min(float(queued), _SATURATED)


def _kv_filling_charge(kv_use: float, capacity: int, own: int, output: int, seconds: float) -> float:
    """What a request that brings `own` uncached prompt tokens and `output` tokens of output to a
    pod whose KV cache is `kv_use` full (`_kv_utilization`) of `capacity` tokens, holding them
    `seconds` (its prefill and decode there), costs the requests that will queue there for
    blocks: the share of the cache's time it takes, as `_kv_time_charge`, for the queue a cache
    that full makes, rho^2 / (1 - rho) (M/M/1's mean queue, rho the cache's use with this prompt
    and half its output, capped at 0.95 as the busy factor: at most 18). Charged (by the caller)
    while the pool's caches bind (a candidate was full with a queue in the last
    `_KV_PRESSURE_SECONDS`) and at least half the candidates' caches have room, on a pod not
    already full with a queue, for a prompt the pod does not hold at least half of.

    `_kv_time_charge` prices a pod's cache once it is full with a queue; until then a cache at
    0.99 and one at 0.6 looked alike wherever compute runs at the busy factor's cap (every pod of
    a pool near its decode capacity), and a 6k-token prompt is 1.5% of a 452k-token cache, so the
    overflow term barely moves. Long prompts then gathered on the pods whose prefill is fast until
    those filled while others had room: the KV-heavy tenant mix served in full on 8 H100 + 8 A100
    pods read TTFT p90 / p99 1,136 / 2,360 ms against the weighted sum's 650 / 1,626 (its H100s'
    caches at 0.97-1.00, the A100s' at 0.15-0.40; 560 / 1,914 so), `head-of-line-heavy` on 16
    pods 179 / 1,482 against the greedy oracle's 135 / 240 (140 / 352 so). A prompt whose prefix
    the pod holds is not charged: it brings fewer blocks there than anywhere. Charged too (from
    a cache use of 0.8), a document's hit on its holder, whose cache its documents keep full,
    cost more than a copy onto a pod with room, and the B2B overload's copies spiralled (16
    pods: 213 / 309 ms -> 498 / 1,330). Charged where no cache binds, it traded the queue for the
    cache's fill where compute binds and cost a few ms of p90 (`head-of-line`, 16 pods: 63 -> 68
    ms against the oracle's 61) — though it also spread `head-of-line` at 1.3x its rate, whose
    pods fill their batch slots and caches together without ever showing a queue (312 / 6,508
    ms, 103-106 / 356-363 ungated; BENCHMARKS.md round 35)."""
    rho = min(_MAX_UTILIZATION, kv_use + (own + output * 0.5) / capacity)
    return (own + output) / capacity * seconds * rho * rho / (1.0 - rho)


def _kv_forecast_charge(ep: Endpoint, kv_use: float, own: int, output: int, seconds: float, now: float) -> float:
    """What a request that will hold its blocks (`own` uncached prompt tokens and `output` tokens
    of output) for `seconds`, longer than the pick rates remember (a long generation), costs on a
    pod whose KV forecast with it (`EndpointLoad.kv_forecast_at`: the KV tokens the requests lately
    sent there will hold, by Little's law) reaches `_KV_FORECAST_BINDS` of its cache: the filling
    charge (`_kv_filling_charge`) at the fuller of its cache's use and that forecast (0 below it).

    A long generation fills a cache over its minute of decode, so the cache's use shows a herd of
    them only when it is too late: on 16 pods at 1.3x the head-of-line mix's rate, every pod read
    at the busy factor's cap, the pods within noise of each other for a long generation's cost
    (nearly all externality), and one pod took 15-33 of them in a few seconds at a KV use of
    0.5-0.6; the caches so filled preempted at the end while others had room, and the TTFT p99
    was 6.5 s against the greedy oracle's 0.2 (0.38 s so, BENCHMARKS.md round 41). The forecast
    counts each one's whole stay the moment it is sent. Below `_KV_FORECAST_BINDS` it charges
    nothing: at the mix's own rate, where the caches do not bind, the same charge from any fill
    moved the long generations off the pods the chat's arrivals make costly (TTFT p90 63 -> 68 ms)."""
    capacity = ep.metrics.kv_capacity_tokens
    held = own + output * 0.5
    forecast = (ep.load.kv_forecast_at(now) + held * seconds / LOAD_RATE_WINDOW) / capacity
    if forecast < _KV_FORECAST_BINDS:
        return 0.0
    return _kv_filling_charge(max(kv_use, forecast - held / capacity), capacity, own, output, seconds)


def _full_with_queue(metrics: EndpointMetrics) -> bool:
    """The pod's last scrape shows a full KV cache and a queue: it admits as its running requests end."""
    return metrics.waiting_queue_size > 0 and metrics.kv_cache_usage >= _KV_FULL
