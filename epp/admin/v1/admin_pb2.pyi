from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ("decisions",)
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    decisions: int
    def __init__(self, decisions: _Optional[int] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("pool_name", "pool_namespace", "version", "uptime_seconds", "ready", "pool_saturation", "endpoints", "queues", "decisions", "flow_control_enabled", "requests_total")
    POOL_NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    POOL_SATURATION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    FLOW_CONTROL_ENABLED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    pool_name: str
    pool_namespace: str
    version: str
    uptime_seconds: float
    ready: bool
    pool_saturation: float
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointStatus]
    queues: _containers.RepeatedCompositeFieldContainer[QueueStatus]
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    flow_control_enabled: bool
    requests_total: int
    def __init__(self, pool_name: _Optional[str] = ..., pool_namespace: _Optional[str] = ..., version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., ready: _Optional[bool] = ..., pool_saturation: _Optional[float] = ..., endpoints: _Optional[_Iterable[_Union[EndpointStatus, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[QueueStatus, _Mapping]]] = ..., decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., flow_control_enabled: _Optional[bool] = ..., requests_total: _Optional[int] = ...) -> None: ...

class EndpointStatus(_message.Message):
    __slots__ = ("address", "name", "engine", "waiting_queue_size", "running_requests", "kv_cache_usage", "inflight_requests", "inflight_tokens", "metrics_age_seconds", "scrape_error", "active_adapters", "inter_token_latency_seconds", "queued_prefill_tokens", "decoding_requests", "prefill_tokens_per_second", "step_seconds", "step_scale", "prefill_scale", "ttft_prediction_error", "service_observations", "batch_limit", "ttft_calibration", "first_token_interval_seconds")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WAITING_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METRICS_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCRAPE_ERROR_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    INTER_TOKEN_LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SCALE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SCALE_FIELD_NUMBER: _ClassVar[int]
    TTFT_PREDICTION_ERROR_FIELD_NUMBER: _ClassVar[int]
    SERVICE_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_LIMIT_FIELD_NUMBER: _ClassVar[int]
    TTFT_CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    name: str
    engine: str
    waiting_queue_size: int
    running_requests: int
    kv_cache_usage: float
    inflight_requests: int
    inflight_tokens: int
    metrics_age_seconds: float
    scrape_error: str
    active_adapters: _containers.RepeatedScalarFieldContainer[str]
    inter_token_latency_seconds: float
    queued_prefill_tokens: float
    decoding_requests: int
    prefill_tokens_per_second: float
    step_seconds: float
    step_scale: float
    prefill_scale: float
    ttft_prediction_error: float
    service_observations: int
    batch_limit: int
    ttft_calibration: float
    first_token_interval_seconds: float
    def __init__(self, address: _Optional[str] = ..., name: _Optional[str] = ..., engine: _Optional[str] = ..., waiting_queue_size: _Optional[int] = ..., running_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., inflight_requests: _Optional[int] = ..., inflight_tokens: _Optional[int] = ..., metrics_age_seconds: _Optional[float] = ..., scrape_error: _Optional[str] = ..., active_adapters: _Optional[_Iterable[str]] = ..., inter_token_latency_seconds: _Optional[float] = ..., queued_prefill_tokens: _Optional[float] = ..., decoding_requests: _Optional[int] = ..., prefill_tokens_per_second: _Optional[float] = ..., step_seconds: _Optional[float] = ..., step_scale: _Optional[float] = ..., prefill_scale: _Optional[float] = ..., ttft_prediction_error: _Optional[float] = ..., service_observations: _Optional[int] = ..., batch_limit: _Optional[int] = ..., ttft_calibration: _Optional[float] = ..., first_token_interval_seconds: _Optional[float] = ...) -> None: ...

class QueueStatus(_message.Message):
    __slots__ = ("priority", "fairness_id", "requests", "bytes", "oldest_seconds")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    OLDEST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    priority: int
    fairness_id: str
    requests: int
    bytes: int
    oldest_seconds: float
    def __init__(self, priority: _Optional[int] = ..., fairness_id: _Optional[str] = ..., requests: _Optional[int] = ..., bytes: _Optional[int] = ..., oldest_seconds: _Optional[float] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("request_id", "time", "model", "target_model", "objective", "fairness_id", "priority", "outcome", "http_status", "message", "targets", "candidates", "scheduling_seconds", "queued_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    FAIRNESS_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    time: float
    model: str
    target_model: str
    objective: str
    fairness_id: str
    priority: int
    outcome: str
    http_status: int
    message: str
    targets: _containers.RepeatedScalarFieldContainer[str]
    candidates: _containers.RepeatedCompositeFieldContainer[CandidateScore]
    scheduling_seconds: float
    queued_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., time: _Optional[float] = ..., model: _Optional[str] = ..., target_model: _Optional[str] = ..., objective: _Optional[str] = ..., fairness_id: _Optional[str] = ..., priority: _Optional[int] = ..., outcome: _Optional[str] = ..., http_status: _Optional[int] = ..., message: _Optional[str] = ..., targets: _Optional[_Iterable[str]] = ..., candidates: _Optional[_Iterable[_Union[CandidateScore, _Mapping]]] = ..., scheduling_seconds: _Optional[float] = ..., queued_seconds: _Optional[float] = ...) -> None: ...

class CandidateScore(_message.Message):
    __slots__ = ("address", "total", "scores")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    address: str
    total: float
    scores: _containers.ScalarMap[str, float]
    def __init__(self, address: _Optional[str] = ..., total: _Optional[float] = ..., scores: _Optional[_Mapping[str, float]] = ...) -> None: ...
