"""Configuration of a simulated engine and of a simulated model-server pod.

Defaults describe vLLM v1 serving a Llama-3-8B-class model on one H100-80GB: the numbers the
calibration in shared/calibration/ was made for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from epp.sim.steptime import DEFAULT_PROFILE, StepTimeModel, kv_capacity_blocks

SchedulingPolicy = Literal["fcfs", "priority"]
# "mixed": vLLM v1 / Sarathi-style work-conserving batches of decodes plus prefill chunks.
# "prefill_first": old vLLM behaviour; a step is either all prefill (preferred) or all decode.
BatchingPolicy = Literal["mixed", "prefill_first"]
# The model server whose HTTP API and /metrics a pod imitates, over the same engine model.
ServerKind = Literal["vllm", "tgi"]
SERVER_KINDS: tuple[str, ...] = ("vllm", "tgi")


@dataclass(slots=True)
class EngineConfig:
    """What the engine model needs: scheduler limits, KV cache geometry and step time."""

    block_size: int = 16
    num_gpu_blocks: int = field(default_factory=lambda: kv_capacity_blocks(DEFAULT_PROFILE))
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    # vLLM's `scheduler_reserve_full_isl` (on by default in 0.32): a waiting request is admitted
    # only if the KV cache can hold its whole sequence, not just its first chunk.
    scheduler_reserve_full_isl: bool = True
    # Record vLLM's KV-cache events (`--kv-events-config '{"enable_kv_cache_events": true}'`);
    # `Engine.take_kv_events()` hands them over after each step.
    enable_kv_cache_events: bool = False
    scheduling_policy: SchedulingPolicy = "fcfs"
    batching: BatchingPolicy = "mixed"
    # 0 disables LoRA; otherwise the number of adapters that can be active in one batch (and the
    # GPU's LoRA slots, an LRU).
    max_loras: int = 0
    # Time to load an adapter that is not in a GPU slot when a step needs it; the step waits for
    # it. An estimate, not a measurement: a rank-16 adapter on all seven projections of
    # Llama-3-8B is ~84 MB; read from the page cache and copied from pageable host memory at
    # ~10 GB/s that is ~8 ms, plus parsing and one copy per module, so ~20 ms. 0 disables.
    lora_load_ms: float = 20.0
    step_profile: str = DEFAULT_PROFILE
    cpu_overhead: bool = False
    # Per-token timestamps (array of float64) on every request; turn off for huge virtual runs.
    record_token_times: bool = True
    gpu_memory_utilization: float = 0.9

    def validate(self) -> None:
        """Raise ValueError for settings under which the engine could deadlock or misbehave."""
        if self.block_size <= 0 or self.num_gpu_blocks < 2:
            raise ValueError("block_size must be > 0 and num_gpu_blocks >= 2")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0 or self.max_model_len <= 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens must be > 0, max_model_len > 1")
        if (self.num_gpu_blocks - 1) * self.block_size < self.max_model_len:
            raise ValueError("the KV cache must hold at least one max_model_len sequence "
                             f"({(self.num_gpu_blocks - 1) * self.block_size} < {self.max_model_len} tokens)")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling_policy {self.scheduling_policy!r}")
        if self.batching not in ("mixed", "prefill_first"):
            raise ValueError(f"unknown batching {self.batching!r}")
        if self.max_loras < 0:
            raise ValueError("max_loras must be >= 0")
        if not self.lora_load_ms >= 0:
            raise ValueError("lora_load_ms must be >= 0")

    def step_time_model(self) -> StepTimeModel:
        return StepTimeModel.load(self.step_profile, cpu_overhead=self.cpu_overhead)

    @property
    def kv_capacity_tokens(self) -> int:
        # vLLM reserves one block as the null block.
        return (self.num_gpu_blocks - 1) * self.block_size


@dataclass(slots=True)
class SimConfig:
    """One simulated vLLM pod: the engine plus what the OpenAI server adds around it."""

    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    lora_adapters: tuple[str, ...] = ()
    # Wall seconds per simulated second: 0.1 runs the pod ten times faster than the modelled GPU.
    time_scale: float = 1.0
    seed: int = 0
    # max_tokens when the request has none (capped by max_model_len - prompt tokens).
    default_max_tokens: int = 256
    # Mean of the geometric output-length distribution for requests without ignore_eos.
    mean_output_tokens: float = 128.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerKind = "vllm"  # "tgi": Hugging Face TGI's API and metrics (epp.sim.tgi_server)

    def validate(self) -> None:
        self.engine.validate()
        if self.server not in SERVER_KINDS:
            raise ValueError(f"unknown server {self.server!r} (one of {', '.join(SERVER_KINDS)})")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.lora_adapters and self.engine.max_loras <= 0:
            raise ValueError("lora_adapters need engine.max_loras > 0")
        if self.model in self.lora_adapters:
            raise ValueError("a LoRA adapter cannot have the served model's name")
        if self.default_max_tokens <= 0 or self.mean_output_tokens < 1:
            raise ValueError("default_max_tokens must be > 0 and mean_output_tokens >= 1")
