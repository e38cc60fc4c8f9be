"""The predicted-latency producer's per-candidate prediction as it was before it was optimised
for speed (a verbatim copy of `PredictedLatencyProducer.predict` and its helpers at that time):
`test_prediction_equivalence` checks the optimised code gives the very same predictions on random
states. Changing what the producer computes means changing this copy too, on purpose."""

from __future__ import annotations

from epp.datastore import Endpoint, ModelStats
from epp.scheduling.plugins.predicted_latency_producer import (
    _ADAPTER_LOAD_SECONDS,
    _MAX_UTILIZATION,
    _STEPS_PER_TTFT,
)
from epp.scheduling.prediction import Prediction
from epp.scheduling.prefix_match import PrefixMatch


class ReferencePredictor:
    def __init__(self, learn: bool = True) -> None:
        self.learn = learn

    def predict(self, ep: Endpoint, match: PrefixMatch | None, prompt: int, output: int, now: float,
                stats: ModelStats, source: str = "", arrivals_per_pod: float = 0.0, model: str = "") -> Prediction:
        load, service, metrics = ep.load, ep.service, ep.metrics
        mean_output = stats.mean_output_tokens
        prior = service.prior
        cached = min(match.tokens(ep.address), prompt - 1) if match is not None else 0
        own = prompt - cached
        decoding = float(load.decoding)
        context = float(load.context_tokens)
        # Traffic the ledger cannot explain (other replicas, clients bypassing the gateway): what
        # the last scrape showed beyond the EPP's own requests of that moment.
        unexplained = max(0, metrics.waiting_queue_size + metrics.running_requests - load.requests_at_scrape)
        if unexplained:  # about the model's usual request each
            decoding += unexplained
            context += unexplained * (stats.mean_prompt_tokens + mean_output * 0.5)
        queued = load.backlog_at(now)
        if metrics.waiting_queue_size > load.pending_at_scrape:
            queued += (metrics.waiting_queue_size - load.pending_at_scrape) * stats.mean_prompt_tokens
        pairs = load.prefill_pairs + own * (cached + own * 0.5)
        estimate = service.ttft(queued + own, pairs, decoding, context)
        wait = self._slot_wait(ep, decoding, context, output, mean_output, unexplained)
        wait += self._kv_wait(ep, own, decoding, context, mean_output)
        wait += self._adapter_wait(ep, model, decoding, context, mean_output)
        step = service.step_seconds(decoding + 1.0, context + prompt)
        itl = step + service.prefill_scale * prior.per_prefill_token * min(queued, prior.max_batched_tokens)
        # What the pick costs the requests that reach the pod after it, in seconds of their TTFT.
        # While it decodes every step is longer by its share, and each request
        # arriving meanwhile waits `_STEPS_PER_TTFT` steps; its prefill delays the ones that queue
        # behind it. A busy pod amplifies both: what slows it keeps more requests in it longer
        # (utilisation u: the pod-seconds of work per second lately sent there).
        share = service.step_scale * (prior.per_decode_seq + prior.per_context_token * (prompt + output * 0.5))
        own_seconds = service.prefill_scale * (prior.per_prefill_token * own
                                               + prior.per_attention_pair * own * (cached + own * 0.5))
        work = own_seconds + output * share
        u = min(_MAX_UTILIZATION, load.utilization_at(now))
        arrivals = max(load.rate_at(now), arrivals_per_pod)
        lifetime = output * step  # its decode, at the pod's steady step (the queued prefill passes)
        externality = (_STEPS_PER_TTFT * share * arrivals * lifetime + own_seconds * u) / (1.0 - u)
        # A full cache evicts some other prompt's prefix for this one's new blocks: that prompt's
        # next request pays the prefill again.
        evicted = match.evicted_tokens.get(ep.address, 0) if match is not None else 0
        if evicted:
            externality += service.prefill_scale * prior.per_prefill_token * evicted
        ttft = estimate.seconds + wait
        return Prediction(
            ttft=ttft,
            cost=ttft + externality,
            work_seconds=work,
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
        )

    @staticmethod
    def _completions_per_second(service_step: float, decoding: float, mean_output: float) -> float:
        """How fast running requests end: each needs about half the mean output still."""
        remaining = max(1.0, mean_output * 0.5)
        return decoding / (remaining * max(service_step, 1e-6))

    def _slot_wait(self, ep: Endpoint, decoding: float, context: float, output: int, mean_output: float,
                   unexplained: int) -> float:
        """Seconds until a batch slot frees when the pod already runs `maxNumSeqs` requests."""
        running = ep.load.requests + unexplained
        limit = ep.service.prior.max_num_seqs
        if running < limit or decoding <= 0.0:
            return 0.0
        step = ep.service.step_seconds(decoding, context)
        return (running - limit + 1) / self._completions_per_second(step, decoding, mean_output)

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

    def _kv_wait(self, ep: Endpoint, own: int, decoding: float, context: float, mean_output: float) -> float:
        """Seconds until the pod's KV cache can take this prompt's uncached blocks."""
        m = ep.metrics
        capacity = m.cache_num_blocks * m.cache_block_size
        if capacity <= 0 or decoding <= 0.0:
            return 0.0
        # KV in use: the scrape's, plus what the EPP sent since (its ledger grew by that much).
        used = max(m.kv_cache_usage * capacity, 0.0) + max(0, ep.load.footprint_tokens - ep.load.footprint_at_scrape)
        short = used + own - capacity
        if short <= 0.0:
            return 0.0
        step = ep.service.step_seconds(decoding, context)
        freed_per_second = self._completions_per_second(step, decoding, mean_output) * (context / decoding)
        return short / max(freed_per_second, 1.0)
