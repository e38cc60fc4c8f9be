"""Hugging Face TGI's native API: `POST /generate` and `POST /generate_stream`.

The body is TGI's `GenerateRequest` (router/src/lib.rs): a required string `inputs` and an
optional `parameters` object (`max_new_tokens`, `stop`, `details`, `adapter_id`, sampling knobs).
Streaming is chosen by the path, never by the body: TGI's `/generate` ignores a `stream` field.

TGI's native API has no `model` field. TGI serves one base model and names LoRA adapters in
`parameters.adapter_id`; its Messages API treats `model: "tgi"` (or none) as the base model and
any other name as the adapter. The EPP follows that convention: such a request is accounted under
its adapter when it names one, else under "tgi", and a model rewrite cannot apply (there is no
field to rewrite).
"""

from __future__ import annotations

from typing import Any

from epp.api.apis import Api, BodyFields, bad_request, token_count
from epp.api.engines import TGI

BASE_MODEL = TGI  # TGI's own name for "the base model" (`model: "tgi"` in its docs)


def parse_tgi(body: dict[str, Any], api: Api) -> BodyFields:
    """Validate a TGI `GenerateRequest` body; raises `EppError` (400) with a clear message."""
    inputs = body.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise bad_request("invalid TGI generate request: must have a non-empty string inputs field")
    parameters = body.get("parameters")
    if parameters is None:
        parameters = {}
    elif not isinstance(parameters, dict):
        raise bad_request("invalid TGI generate request: parameters must be an object")
    stop = parameters.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("invalid TGI generate request: parameters.stop must be a list of strings")
    adapter = parameters.get("adapter_id")
    return BodyFields(
        api=api,
        model=adapter if isinstance(adapter, str) and adapter else BASE_MODEL,
        prompt=inputs.encode(),
        stream=api is Api.TGI_GENERATE_STREAM,
        max_tokens=token_count(parameters.get("max_new_tokens")),
        rewritable=False,
    )
