"""A candidate's predicted cost, as the predicted-latency producer computes it.

The producer leaves one `Prediction` per candidate in the cycle (`CycleState.predictions`); the
latency scorer and the SLO filter rank on it, the decision trace shows its parts, and request
control books the chosen one into the endpoint's ledger (what the pick will cost that pod, and
what to compare the observed time to first token with).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Prediction:
    """Seconds until this request's first token on one candidate, and why."""

    ttft: float  # the whole prediction
    cost: float  # what the pick charges the pool, in seconds of TTFT: `credited_ttft` plus what
    # this request's decode adds to the TTFT of the requests that will reach the pod meanwhile
    queued_prefill: float  # prefill tokens already queued on the pod (ledger + unexplained)
    own_prefill: int  # this request's uncached prompt tokens on the pod
    cached_tokens: int  # the cache credit: prompt tokens predicted to hit the pod's prefix cache
    prompt_tokens: int  # the prompt's estimated length
    output_tokens: int  # the output expected
    prefill_seconds: float  # of `ttft`: the queued plus own prefill, in steps
    wait_seconds: float  # of `ttft`: waiting for a batch slot or for KV blocks to free
    itl: float  # the inter-token latency the request would see there
    step_feature: float = 0.0  # the service model's features (for learning at the first byte)
    prefill_feature: float = 0.0
    prefix_source: str = ""  # which producer gave the cache credit ("" when none)
    work_seconds: float = 0.0  # pod time the request costs: its prefill and its share of decode steps
    prefill_work_seconds: float = 0.0  # of `work_seconds`, its own prefill
    # (Up to `kv_token_seconds`, the fields `predict_all` sets for every candidate, in the order it
    # passes them: by position, several times faster than by name for a class this wide.)
    # Of `cached_tokens`, those the pod is expected to compute again first (its requests in
    # flight pin more prefixes than its cache holds), and the queued ones' likewise: `ttft`
    # counts them; `credited_ttft` is the prediction with the whole credit, which `cost` and the
    # ledger's timeline use (a prefix's requests kept together share its blocks once it is back).
    recompute_tokens: int = 0
    credited_ttft: float = 0.0  # (0: the same as `ttft`)
    # Of `ttft` beyond `credited_ttft`'s prefill: the prefill the pod will do that the whole
    # credit leaves out (`recompute_tokens`, the queued prompts' own, queued prefill well late).
    # A saturated pool ranks on it too (`cost`).
    recompute_seconds: float = 0.0
    # The wait `ttft` counts: `wait_seconds` with its slot and KV waits at the pace the running
    # requests really end (the short ones first), where `wait_seconds` (in `credited_ttft` and
    # `cost`) takes the pace of their mean output.
    paced_wait_seconds: float = 0.0
    # `ttft` before the pod's calibration factor (`ServiceModel.ttft_bias`): what the factor
    # learns from, against the observed time to first token (0: the same as `ttft`).
    raw_ttft: float = 0.0
    # The pod's queue at its measured first-token pace when that set `ttft` (a full KV cache with
    # a queue: the prediction is at least this; 0: it did not).
    drain_seconds: float = 0.0
    # The share of the pod's KV cache its requests would need beyond its capacity with this
    # request's and what the running ones have yet to write (a pick that forces preemption): it
    # raises the busy factor in `cost` past its cap (0: none).
    kv_overflow: float = 0.0
    # Added to `cost` on a pod whose batch slots are all taken: the wait this request adds, holding
    # a slot for its decode, to the requests sent there while it waits (0: a free slot, or off).
    slot_charge: float = 0.0
    # Added to `cost` on a pod whose KV cache is full with a queue: the share of the cache's time
    # this request's new blocks take, for each request queued there (`_kv_time_charge`; 0: none).
    kv_time_charge: float = 0.0
    # The KV tokens the request will hold there times the seconds it holds them (its uncached
    # prompt and half its output, over its prefill and decode): what the pick adds to the pod's
    # KV forecast (`EndpointLoad.kv_forecast_at`).
    kv_token_seconds: float = 0.0
    # Of `cost`, what this request's decode adds to the steps of the requests that reach the pod
    # meanwhile, and whether the busy factor that amplifies it is at its cap there (the pod's
    # recent work at or past its capacity, or a pick that overflows its KV cache).
    decode_charge: float = 0.0
    at_busy_cap: bool = False
    # Of `cost`, what this prompt's prefill chunk adds to the first tokens of the requests still
    # prefilling on the pod (they share the step it joins; 0: none, or its queue fills the step).
    chunk_charge: float = 0.0
    copy_credit: float = 0.0  # seconds taken off `cost`: what a new copy of the prefix here saves others
    copy_reason: str = ""  # why: "busy" (holders' queue), "choice" / "young" (a second holder) or "faster" (a faster pod)
    # Ranked on a saturated pool (every candidate's KV cache full with a queue): `cost` is
    # `credited_ttft` (no externality) with `recompute_seconds`, and `saturation_charge`,
    # seconds for a copy of a prefix its holders have (work the pool cannot absorb).
    saturated: bool = False
    saturation_charge: float = 0.0
    # `saturation_charge` set for a prefix in its first seconds of reuse rather than a saturated
    # pool (its holder likely still computing it: `PredictedLatencyProducer._charge_copies`).
    young_prefix: bool = False
    # Set by `latency-scorer`'s TTFT bound (when configured): seconds this candidate's credited
    # TTFT is beyond the bound (the fastest candidate's × the ratio + the slack) when it was left
    # out of the ranking; and, on those kept, that the cheapest was left out (the bound made the pick).
    beyond_bound: float = 0.0
    ttft_bounded: bool = False
    # Set by `latency-scorer` on every candidate when this request's decode charge is far above
    # its TTFT on pods alike: the candidates that tie on cost are told apart by the first token
    # they would give it and delay (`ttft + chunk_charge`) rather than by the work; and in a shared
    # decode overload (every candidate also at its busy cap) the tie is as wide as the charge's
    # noise.
    first_token_ranked: bool = False
    overload_ranked: bool = False
    # The share of the pool's recent cold prompts that a later request asked for again
    # (`ColdReuse`): the TTFT bound stays out at or above its `ttftBoundMaxReuse`.
    cold_prompts_reused: float = 1.0
    # Added to `cost` for a cold prompt on a pod with a `drain_seconds` while most of the pool has
    # room: what the drain adds to `credited_ttft` (0: none).
    drain_charge: float = 0.0
    # Added to `cost` for a new copy of a reused prompt on a pod whose cache turns over too fast to
    # keep it: the expected recompute of its later requests there (0: none).
    eviction_charge: float = 0.0
    # Added to `cost` for the TTFT tail (`_charge_tail`): `tailWeight` × the credited TTFT beyond the
    # pool's tail and × the externality the pod's recent share of tail first tokens weighs (0: none).
    tail_charge: float = 0.0

    def compact(self) -> str:
        """`ttft=...ms(q=...,own=...,hit=...,wait=...ms)` for the debug header and logs."""
        return (f"ttft={self.ttft * 1e3:.1f}ms,cost={self.cost * 1e3:.1f}ms(q={self.queued_prefill:.0f},own={self.own_prefill},"
                f"hit={self.cached_tokens}" + (f",recompute={self.recompute_tokens}" if self.recompute_tokens else "")
                + f",out={self.output_tokens}"
                + f",wait={self.wait_seconds * 1e3:.1f}ms"
                + (f",paced_wait={self.paced_wait_seconds * 1e3:.1f}ms"
                   if self.paced_wait_seconds != self.wait_seconds else "")
                + f",itl={self.itl * 1e3:.1f}ms"
                + (f",drain={self.drain_seconds * 1e3:.1f}ms" if self.drain_seconds else "")
                + (f",drain_charge={self.drain_charge * 1e3:.1f}ms" if self.drain_charge else "")
                + (f",eviction_charge={self.eviction_charge * 1e3:.1f}ms" if self.eviction_charge else "")
                + (f",kv_overflow={self.kv_overflow:.3f}" if self.kv_overflow else "")
                + (f",slot_charge={self.slot_charge * 1e3:.1f}ms" if self.slot_charge else "")
                + (f",kv_time_charge={self.kv_time_charge * 1e3:.1f}ms" if self.kv_time_charge else "")
                + (f",tail_charge={self.tail_charge * 1e3:.1f}ms" if self.tail_charge else "")
                + (f",uncalibrated={self.raw_ttft * 1e3:.1f}ms" if self.raw_ttft and self.raw_ttft != self.ttft else "")
                + (f",{'young_prefix' if self.young_prefix else 'saturated'}={self.saturation_charge * 1e3:.1f}ms"
                   if self.saturation_charge else "")
                + (f",beyond_bound={self.beyond_bound * 1e3:.1f}ms" if self.beyond_bound else "")
                + (",bounded" if self.ttft_bounded else "")
                + (f",chunk_charge={self.chunk_charge * 1e3:.1f}ms" if self.chunk_charge else "")
                + (f",{'overload_ranked' if self.overload_ranked else 'first_token_ranked'}"
                   f"(decode_charge={self.decode_charge * 1e3:.1f}ms)" if self.first_token_ranked else "")
                + (f",copy={self.copy_credit * 1e3:.1f}ms/{self.copy_reason})" if self.copy_credit else ")"))
