"""Small builders for scheduling tests: endpoints with given metrics, requests with given prompts."""

from __future__ import annotations

import itertools
from typing import Any

from epp.api.request import Api, InferenceRequest
from epp.datastore import Endpoint, EndpointMetrics, EndpointSpec
from epp.scheduling.framework import CycleState

_ids = itertools.count(1)


def endpoint(ip: str, port: int = 8000, *, inflight: int = 0, tokens: int = 0, **metrics: Any) -> Endpoint:
    ep = Endpoint(EndpointSpec(name=f"pod-{ip}-{port}", ip=ip, port=port))
    ep.metrics = EndpointMetrics(**metrics)
    ep.inflight_requests = inflight
    ep.inflight_tokens = tokens
    return ep


def request(
    prompt: bytes | str = b"",
    *,
    model: str = "m",
    salt: str = "",
    headers: dict[str, str] | None = None,
    request_id: str = "",
) -> InferenceRequest:
    if isinstance(prompt, str):
        prompt = prompt.encode()
    return InferenceRequest(
        request_id=request_id or f"req-{next(_ids)}",
        api=Api.COMPLETIONS,
        model=model,
        target_model=model,
        body={"model": model},
        prompt=prompt,
        cache_salt=salt,
        headers=headers or {},
    )


def cycle() -> CycleState:
    return CycleState()
