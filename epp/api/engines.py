"""The model-server engines the EPP knows, and what each one's request API understands.

One small table every layer can read (the api layer is below scheduling, flow control and the
data layer): the data layer maps each engine's metric names; flow control asks whether an engine
has vLLM's `priority` body field; admission asks whether an engine serves a request's API.

Facts behind the table (sources in tests/fixtures/tgi-3.3/README.md and tests/fixtures/sglang/):
- vLLM: `priority` is a top-level body field (lower = sooner) under `--scheduling-policy priority`.
- SGLang: `GenerateReqInput.priority` exists, but by default *higher* values run first (the
  opposite of vLLM unless `--schedule-low-priority-values-first`), is ignored without
  `--enable-priority-scheduling`, and `--abort-on-priority-when-disabled` aborts such requests.
  Writing vLLM-ordered numbers there could invert the order or fail requests, so it is not written.
- TGI: no priority field at all; the EPP's own queues are the only ordering.
"""

from __future__ import annotations

VLLM = "vllm"
SGLANG = "sglang"
TGI = "tgi"
TRTLLM_SERVE = "trtllm-serve"
TRITON_TENSORRT_LLM = "triton-tensorrt-llm"

DEFAULT_ENGINE = VLLM  # the reference's default for pods without an engine label
ENGINE_LABEL_KEY = "inference.networking.k8s.io/engine-type"

# Engines whose request body takes flow control's vLLM-ordered `priority` field.
PRIORITY_FIELD_ENGINES: frozenset[str] = frozenset({VLLM})


def accepts_vllm_priority(engine: str) -> bool:
    """Whether flow control may write its vLLM `priority` into a body bound for `engine`."""
    return engine in PRIORITY_FIELD_ENGINES
