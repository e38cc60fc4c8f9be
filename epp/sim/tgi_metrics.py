"""TGI 3.3's metrics, fed from the simulated engine's steps and the TGI router's handlers.

What TGI records where (tests/fixtures/tgi-3.3/README.md has the source lines): the router counts
requests and records the per-request histograms when a request ends (`tgi_request_*`); the batching
loop records one prefill or decode call per engine step (`tgi_batch_*`); the queue and batch gauges
are read from the engine at exposition time. A family exists only once something was recorded in
it, as with TGI's `metrics` crate, so a pod that has not seen a request exports nothing.

The engine underneath is vLLM-like, so two readings are approximations: a step with any prefill
tokens is TGI's `prefill` call (TGI's chunked prefill also decodes the running batch in it), and
`tgi_batch_current_max_tokens` is the KV held by running requests, where TGI reserves a request's
whole `max_new_tokens` when it admits it. Detokenisation and filtering are not modelled:
`tgi_batch_decode_duration` and `tgi_batch_filter_duration` observe 0, and there is no
`tgi_batch_concat_duration`. Latencies are engine-clock seconds, like the vLLM pods'.
"""

from __future__ import annotations

from epp.sim.engine import StepResult
from epp.sim.metrics import Histogram
from epp.sim.request import Request


def _duration_buckets() -> tuple[float, ...]:
    """35 bounds from 0.00015, each 1.5 times the last (router/src/server.rs)."""
    out: list[float] = []
    value = 0.0001
    for _ in range(35):
        value *= 1.5
        out.append(value)
    return tuple(out)


def _token_buckets(limit: int) -> tuple[float, ...]:
    """One hundred bounds, `limit / 100` apart (input length, generated and max-new tokens)."""
    step = limit / 100.0
    return tuple(step * (i + 1) for i in range(100))


DURATION_BUCKETS = _duration_buckets()
BATCH_SIZE_BUCKETS = tuple(float(i + 1) for i in range(1024))
Labels = str  # rendered label pairs, e.g. 'method="prefill"'; "" for none


class TgiMetrics:
    """Counters and histograms keyed by family and label string, in order of first use."""

    def __init__(self, max_input_tokens: int, max_total_tokens: int) -> None:
        self.counters: dict[str, dict[Labels, float]] = {}
        self.histograms: dict[str, dict[Labels, Histogram]] = {}
        self.skipped_tokens = 0  # observations of tgi_request_skipped_tokens (all 0: no speculation)
        self.queue_used = False  # tgi_queue_size exists after the first request is queued
        self.batch_used = False  # the batch gauges exist after the first batch
        self._buckets = {
            "tgi_request_input_length": _token_buckets(max_input_tokens),
            "tgi_request_generated_tokens": _token_buckets(max_total_tokens),
            "tgi_request_max_new_tokens": _token_buckets(max_total_tokens),
            "tgi_batch_next_size": BATCH_SIZE_BUCKETS,
        }

    # -- primitives

    def inc(self, family: str, labels: Labels = "", by: float = 1.0) -> None:
        series = self.counters.setdefault(family, {})
        series[labels] = series.get(labels, 0.0) + by

    def observe(self, family: str, value: float, labels: Labels = "") -> None:
        series = self.histograms.setdefault(family, {})
        h = series.get(labels)
        if h is None:
            h = series[labels] = Histogram(self._buckets.get(family, DURATION_BUCKETS))
        h.observe(value)

    # -- the router (HTTP handlers)

    def request_received(self, openai: bool = False) -> None:
        # The OpenAI-style handlers count a request, then generate_internal counts it again.
        self.inc("tgi_request_count", by=2.0 if openai else 1.0)

    def request_failed(self, err: str) -> None:
        self.inc("tgi_request_failure", f'err="{err}"')

    def request_validated(self, input_length: int, max_new_tokens: int) -> None:
        self.observe("tgi_request_input_length", input_length)
        self.observe("tgi_request_max_new_tokens", max_new_tokens)
        self.queue_used = True

    def request_succeeded(self, r: Request) -> None:
        queue = r.first_scheduled_time - r.arrival_time
        inference = r.finish_time - r.first_scheduled_time
        n = max(1, r.num_output_tokens)
        self.inc("tgi_request_success")
        self.observe("tgi_request_duration", r.finish_time - r.arrival_time)
        self.observe("tgi_request_validation_duration", 0.0)
        self.observe("tgi_request_queue_duration", queue)
        self.observe("tgi_request_inference_duration", inference)
        self.observe("tgi_request_mean_time_per_token_duration", inference / n)
        self.observe("tgi_request_generated_tokens", r.num_output_tokens)

    # -- the batching loop (engine steps), the pod's `metrics.record_step` hook

    def record_step(self, step: StepResult) -> None:
        out = step.output
        method = 'method="prefill"' if out.num_prefill_tokens else 'method="decode"'
        self.batch_used = True
        self.inc("tgi_batch_inference_count", method)
        self.observe("tgi_batch_forward_duration", out.duration, method)
        self.observe("tgi_batch_decode_duration", 0.0, method)
        self.observe("tgi_batch_filter_duration", 0.0, method)
        self.observe("tgi_batch_inference_duration", out.duration, method)
        self.inc("tgi_batch_inference_success", method)
        new = sum(1 for r in out.scheduled if r.first_scheduled_time == out.start_time)
        if new:
            self.observe("tgi_batch_next_size", new)
            if new < len(out.scheduled):
                self.inc("tgi_batch_concat", 'reason="chunking"')
        self.skipped_tokens += len(step.new_tokens)

    def record_lora(self, running: dict[str, int], waiting: dict[str, int], wall_time: float) -> None:
        """TGI exports no LoRA metric."""
