"""Prometheus text exposition of a simulated TGI pod, in TGI 3.3's exact shape.

TGI renders with `metrics-exporter-prometheus` 0.15: one block per family and a blank line after
it, `# HELP` only for the families TGI describes (its first description of a name wins), bucket
lines then `_sum` then `_count`, `tgi_request_skipped_tokens` as a summary, numbers as Rust prints
an `f64`. Families appear only once used (see `epp.sim.tgi_metrics`). The family order is the one
of the real capture cited in tests/fixtures/tgi-3.3/README.md (TGI's exporter does not promise one).
"""

from __future__ import annotations

import math
from decimal import Decimal

from epp.sim.engine import Engine
from epp.sim.tgi_metrics import TgiMetrics

CONTENT_TYPE = "text/plain; charset=utf-8"

HELP: dict[str, str] = {
    "tgi_request_success": "Number of successful requests",
    "tgi_request_count": "Total number of requests",
    "tgi_batch_inference_success": "Number of successful inference calls per method (prefill or decode)",
    "tgi_batch_inference_count": "Inference calls per method (prefill or decode)",
    "tgi_queue_size": "Current queue size",
    "tgi_batch_current_max_tokens": "Maximum tokens for the current batch",
    "tgi_batch_current_size": "Current batch size",
    "tgi_request_input_length": "Input token length per request",
    "tgi_request_max_new_tokens": "Maximum new tokens per request",
    "tgi_request_inference_duration": "Request inference duration",
    "tgi_request_skipped_tokens": "Speculated tokens per request",
    "tgi_batch_forward_duration": "Batch forward duration per method (prefill or decode)",
    "tgi_request_duration": "Request duration",
    "tgi_request_validation_duration": "Request validation duration",
    "tgi_request_queue_duration": "Request queue duration",
    "tgi_batch_filter_duration": (
        "Time spent filtering batches and sending generated tokens per method (prefill or decode)"),
    "tgi_batch_decode_duration": "Time spent decoding a batch per method (prefill or decode)",
    "tgi_batch_inference_duration": "Batch inference duration",
    "tgi_request_mean_time_per_token_duration": "Mean time per token per request",
    "tgi_request_generated_tokens": "Generated tokens per request",
    "tgi_batch_next_size": "Batch size of the next batch",
}
COUNTERS = ("tgi_request_success", "tgi_batch_concat", "tgi_request_count", "tgi_request_failure",
            "tgi_batch_inference_success", "tgi_batch_inference_count")
HISTOGRAMS_BEFORE_SUMMARY = ("tgi_request_input_length", "tgi_request_max_new_tokens",
                             "tgi_request_inference_duration")
HISTOGRAMS_AFTER_SUMMARY = (
    "tgi_batch_forward_duration", "tgi_request_duration", "tgi_request_validation_duration",
    "tgi_request_queue_duration", "tgi_batch_filter_duration", "tgi_batch_decode_duration",
    "tgi_batch_inference_duration", "tgi_request_mean_time_per_token_duration",
    "tgi_request_generated_tokens", "tgi_batch_next_size",
)
QUANTILES = ("0", "0.5", "0.9", "0.95", "0.99", "0.999", "1")


def rust_float(v: float) -> str:
    """An f64 as Rust's `Display` writes it: shortest round trip, no exponent, `128` for 128.0."""
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-inf"
    if v != v:
        return "NaN"
    if v.is_integer() and abs(v) < 1e16:
        return str(int(v))
    text = repr(v)
    return format(Decimal(text), "f") if "e" in text else text


def _header(out: list[str], name: str, kind: str) -> None:
    help_ = HELP.get(name)
    if help_ is not None:
        out.append(f"# HELP {name} {help_}\n")
    out.append(f"# TYPE {name} {kind}\n")


class TgiExposition:
    """Renders /metrics for one simulated TGI pod."""

    def render(self, engine: Engine, metrics: TgiMetrics) -> str:
        out: list[str] = []
        for name in COUNTERS:
            series = metrics.counters.get(name)
            if series:
                _header(out, name, "counter")
                out.extend(f"{name}{{{labels}}} {rust_float(v)}\n" if labels else f"{name} {rust_float(v)}\n"
                           for labels, v in series.items())
                out.append("\n")
        snap = engine.snapshot()
        if metrics.queue_used:
            self._gauge(out, "tgi_queue_size", snap.num_waiting)
        if metrics.batch_used:
            kv = engine.kv  # tokens in the blocks the running requests hold
            held = (kv.num_usable_blocks - kv.num_free_blocks) * kv.block_size if snap.num_running else 0
            self._gauge(out, "tgi_batch_current_max_tokens", held)
            self._gauge(out, "tgi_batch_current_size", snap.num_running)
        for name in HISTOGRAMS_BEFORE_SUMMARY:
            self._histogram(out, name, metrics)
        if metrics.skipped_tokens:
            _header(out, "tgi_request_skipped_tokens", "summary")
            out.extend(f'tgi_request_skipped_tokens{{quantile="{q}"}} 0\n' for q in QUANTILES)
            out.append(f"tgi_request_skipped_tokens_sum 0\ntgi_request_skipped_tokens_count "
                       f"{metrics.skipped_tokens}\n\n")
        for name in HISTOGRAMS_AFTER_SUMMARY:
            self._histogram(out, name, metrics)
        return "".join(out)

    @staticmethod
    def _gauge(out: list[str], name: str, value: float) -> None:
        _header(out, name, "gauge")
        out.append(f"{name} {rust_float(float(value))}\n\n")

    @staticmethod
    def _histogram(out: list[str], name: str, metrics: TgiMetrics) -> None:
        series = metrics.histograms.get(name)
        if not series:
            return
        _header(out, name, "histogram")
        for labels, h in series.items():
            prefix = f"{labels}," if labels else ""
            for bound, count in zip((*h.buckets, math.inf), h.cumulative()):
                out.append(f'{name}_bucket{{{prefix}le="{rust_float(bound)}"}} {count}\n')
            tail = f"{{{labels}}}" if labels else ""
            out.append(f"{name}_sum{tail} {rust_float(h.sum)}\n{name}_count{tail} {h.count}\n")
        out.append("\n")
