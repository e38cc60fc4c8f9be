"""vLLM's request and step histograms, fed from engine step results (pure, no clock of its own).

Latencies are engine-clock seconds, i.e. the modelled GPU's time, so a pod sped up with
`time_scale` still reports H100-like TTFT and ITL. Gauges and counters are read from the engine
at exposition time, so only histograms and LoRA-info series live here.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict

from epp.sim.engine import StepResult
from epp.sim.request import FINISH_ABORT, Request

# Bucket bounds exactly as vLLM 0.32 declares them (see the fixture metrics-busy.txt).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# How many past LoRA label combinations stay exposed (real vLLM keeps every one forever).
LORA_INFO_SERIES = 64


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's token-count buckets."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            v = m * scale
            if v > max_value:
                return tuple(out)
            out.append(v)
        scale *= 10


class Histogram:
    """Prometheus histogram state: per-bucket counts (not cumulative), sum and count."""

    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def cumulative(self) -> list[int]:
        out = []
        acc = 0
        for c in self.counts:
            acc += c
            out.append(acc)
        return out


class VllmMetrics:
    """The histograms vLLM exports, plus the timestamped LoRA-info series."""

    HISTOGRAMS = (
        "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
        "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
        "time_to_first_token_seconds", "inter_token_latency_seconds",
        "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
        "request_queue_time_seconds", "request_inference_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds", "request_num_preemptions",
        "request_prefill_kv_computed_tokens",
    )

    def __init__(self, max_model_len: int) -> None:
        tokens = one_two_five_buckets(max_model_len)
        self.hist: dict[str, Histogram] = {
            "request_prompt_tokens": Histogram(tokens),
            "request_generation_tokens": Histogram(tokens),
            "iteration_tokens_total": Histogram(ITERATION_TOKEN_BUCKETS),
            "request_max_num_generation_tokens": Histogram(tokens),
            "request_params_n": Histogram(PARAMS_N_BUCKETS),
            "request_params_max_tokens": Histogram(tokens),
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "request_time_per_output_token_seconds": Histogram(ITL_BUCKETS),
            "e2e_request_latency_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_queue_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_inference_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_prefill_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_decode_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
            "request_num_preemptions": Histogram(PREEMPTION_BUCKETS),
            "request_prefill_kv_computed_tokens": Histogram(tokens),
        }
        # (running adapters, waiting adapters) -> wall-clock time they were last seen.
        self.lora_info: OrderedDict[tuple[str, str], float] = OrderedDict()

    def record_step(self, step: StepResult) -> None:
        h = self.hist
        h["iteration_tokens_total"].observe(step.output.num_tokens)
        end = step.output.end_time
        ttft = h["time_to_first_token_seconds"]
        itl = h["inter_token_latency_seconds"]
        for r in step.new_tokens:
            if r.num_output_tokens == 1:
                ttft.observe(end - r.arrival_time)
            else:
                itl.observe(r.last_itl)
        for r in step.finished:
            if r.finish_reason != FINISH_ABORT:
                self._record_finished(r)

    def _record_finished(self, r: Request) -> None:
        h = self.hist
        n = r.num_output_tokens
        h["request_prompt_tokens"].observe(r.prompt_len)
        h["request_generation_tokens"].observe(n)
        h["request_max_num_generation_tokens"].observe(r.max_tokens)
        h["request_params_n"].observe(1)
        h["request_params_max_tokens"].observe(r.max_tokens)
        h["e2e_request_latency_seconds"].observe(r.finish_time - r.arrival_time)
        h["request_queue_time_seconds"].observe(r.first_scheduled_time - r.arrival_time)
        h["request_inference_time_seconds"].observe(r.last_token_time - r.first_scheduled_time)
        h["request_prefill_time_seconds"].observe(r.first_token_time - r.first_scheduled_time)
        decode = r.last_token_time - r.first_token_time
        h["request_decode_time_seconds"].observe(decode)
        if n > 1:
            h["request_time_per_output_token_seconds"].observe(decode / (n - 1))
        h["request_num_preemptions"].observe(r.num_preemptions)
        h["request_prefill_kv_computed_tokens"].observe(r.prompt_len - max(0, r.num_cached_tokens))

    def record_lora(self, running: dict[str, int], waiting: dict[str, int], wall_time: float) -> None:
        """vLLM sets a gauge labelled with the adapter lists to the current time at every step."""
        key = (",".join(running), ",".join(waiting))
        info = self.lora_info
        info[key] = wall_time
        info.move_to_end(key)
        while len(info) > LORA_INFO_SERIES:
            info.popitem(last=False)
