"""Which metric of which engine feeds which field of `EndpointMetrics` (reference §6.1).

A mapping is immutable and built once per config; the scraper reuses its precomputed
`WantedNames` on every scrape. Each field holds *alternatives*, tried in order: the first one
found in a scrape wins. The config schema has one spec string per field, so only built-ins use
more than one — vLLM reads `vllm:kv_cache_usage_perc` and falls back to the older
`vllm:gpu_cache_usage_perc` (vLLM < 0.10) when the new name is absent.

Hugging Face TGI has its own mapping (`TGI_MAPPING`, facts and sources in
tests/fixtures/tgi-3.3/README.md): `tgi_queue_size` and `tgi_batch_current_size` are the queue
and the batch; `tgi_request_mean_time_per_token_duration` is the inter-token latency histogram.
TGI exports no KV-cache utilisation: `tgi_batch_current_max_tokens` is the batch's token
reservation, but its denominator (`tgi_batch_max_total_tokens`) is set before TGI installs its
Prometheus recorder and never appears. So `kv_cache_usage` is never written for a TGI pod: a
ratio invented from a guessed budget would mislead the saturation detector. TGI admits a request
into the batch only while the token budget allows, so its queue is where KV pressure shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from urllib.parse import quote

from epp.api.engines import DEFAULT_ENGINE, ENGINE_LABEL_KEY, TGI
from epp.datalayer.promparse import WantedNames
from epp.datalayer.spec import MetricSpec, parse_spec

__all__ = ["BUILTIN_ENGINES", "DEFAULT_ENGINE", "ENGINE_LABEL_KEY", "RESERVED_ENGINE_NAME", "TGI_MAPPING",
           "EngineMapping", "Specs", "specs"]

RESERVED_ENGINE_NAME = "default"  # the reference's registry key for the fallback mapping

Specs = tuple[MetricSpec, ...]


@dataclass(slots=True, frozen=True)
class EngineMapping:
    """Metric specs per `EndpointMetrics` field; an empty tuple turns the field off."""

    name: str
    queued: Specs = ()
    running: Specs = ()
    kv_usage: Specs = ()
    lora: Specs = ()
    cache_info: Specs = ()  # info gauge whose *labels* carry the block size and count
    cache_block_size_label: str = "block_size"
    cache_num_blocks_label: str = "num_gpu_blocks"
    cache_block_size: Specs = ()  # plain gauges, for engines without an info metric
    cache_num_blocks: Specs = ()
    # Histogram base name(s) of the inter-token latency; `_sum` and `_count` are read and the
    # mean over each scrape window becomes `EndpointMetrics.inter_token_latency`.
    itl: Specs = ()
    # For exporters that create a gauge on its first use (TGI's metrics-rs recorder): the prefix
    # of the engine's metric names. A good scrape that is empty, or has other metrics with this
    # prefix, but not the queue or batch gauge is a server that has not queued a request: 0. A
    # body with none of the engine's metrics is not its exporter (a mislabelled pod): not found.
    first_use_prefix: str = ""
    # What this engine cannot tell the EPP, logged once per endpoint that uses the mapping.
    caveat: str = ""
    # The exporter serves only the series asked for with `?name[]=...` (prometheus_client's
    # exposition does, which vLLM mounts at /metrics): the scraper then asks for the names it
    # reads, a page of ~2 KB instead of ~50 KB, for the pod to render and for the EPP to read.
    # A server that answers such a request with an HTTP 4xx is asked for its whole page again.
    names_query: bool = False
    primary: WantedNames = field(init=False, repr=False, compare=False)
    fallback: WantedNames = field(init=False, repr=False, compare=False)
    query: str = field(init=False, repr=False, compare=False)  # "name%5B%5D=...&..." or ""

    def __post_init__(self) -> None:
        fields = self.fields()
        itl = [(f"{s.name}_sum", f"{s.name}_count") for s in self.itl]
        primary = [specs[0].name for specs in fields if specs] + list(itl[0] if itl else ())
        fallback = [s.name for specs in fields for s in specs[1:]] + [n for pair in itl[1:] for n in pair]
        object.__setattr__(self, "primary", WantedNames(primary))
        object.__setattr__(self, "fallback", WantedNames(fallback))
        names = sorted({*primary, *fallback})
        object.__setattr__(self, "query", "&".join(f"name%5B%5D={quote(n, safe='')}" for n in names)
                           if self.names_query else "")

    def fields(self) -> tuple[Specs, ...]:
        return (self.queued, self.running, self.kv_usage, self.lora, self.cache_info,
                self.cache_block_size, self.cache_num_blocks)


def specs(*texts: str) -> Specs:
    """Parse spec strings, dropping empty ones (an empty string turns a metric off)."""
    out = []
    for text in texts:
        spec = parse_spec(text)
        if spec is not None:
            out.append(spec)
    return tuple(out)


TGI_MAPPING = EngineMapping(
    name=TGI,
    queued=specs("tgi_queue_size"),
    running=specs("tgi_batch_current_size"),
    # Per request: inference time / generated tokens, recorded when the request ends.
    itl=specs("tgi_request_mean_time_per_token_duration"),
    first_use_prefix="tgi_",
    caveat=("TGI exports no KV-cache utilisation (tgi_batch_max_total_tokens never reaches /metrics): "
            "kv_cache_usage stays 0, so saturation and scoring use its queue and batch size "
            "(tgi_queue_size, tgi_batch_current_size) and the EPP's own in-flight accounting; "
            "no LoRA or KV-block metrics either"),
)


def _builtins() -> Mapping[str, EngineMapping]:
    table = (
        EngineMapping(
            name="vllm",
            queued=specs("vllm:num_requests_waiting"),
            running=specs("vllm:num_requests_running"),
            kv_usage=specs("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            lora=specs("vllm:lora_requests_info"),
            cache_info=specs("vllm:cache_config_info"),
            # time_per_output_token is the pre-0.11 name of the same histogram.
            itl=specs("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
            names_query=True,  # vllm/entrypoints/serve/instrumentator/metrics.py: prometheus_client's make_asgi_app
        ),
        EngineMapping(
            name="sglang",
            queued=specs("sglang:num_queue_reqs"),
            running=specs("sglang:num_running_reqs"),
            kv_usage=specs("sglang:token_usage"),
            cache_info=specs("sglang:cache_config_info"),
            cache_block_size_label="page_size",
            cache_num_blocks_label="num_pages",
            itl=specs("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        ),
        EngineMapping(
            name="trtllm-serve",
            queued=specs("trtllm_num_requests_waiting"),
            running=specs("trtllm_num_requests_running"),
            kv_usage=specs("trtllm_kv_cache_utilization"),
            cache_block_size=specs("trtllm_kv_cache_tokens_per_block"),
            cache_num_blocks=specs("trtllm_kv_cache_max_blocks"),
        ),
        EngineMapping(
            name="triton-tensorrt-llm",
            queued=specs("nv_trt_llm_request_metrics{request_type=waiting}"),
            running=specs("nv_trt_llm_request_metrics{request_type=scheduled}"),
            kv_usage=specs("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}"),
            cache_block_size=specs("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=tokens_per}"),
            cache_num_blocks=specs("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max}"),
        ),
        TGI_MAPPING,
    )
    return MappingProxyType({m.name: m for m in table})


BUILTIN_ENGINES: Mapping[str, EngineMapping] = _builtins()
