"""Request bodies → `InferenceRequest`, the one request type every layer below reads.

The API is chosen by the path (`epp.api.apis`). OpenAI bodies follow the reference's
`openai-parser`: unknown paths are treated as completions, the body must be a JSON object with a
string `model`, and the field the API needs (`prompt`, `messages`, ...) must be present and
non-empty. The engines' native APIs are parsed in their own modules (`epp.api.tgi`,
`epp.api.sglang`); TGI and SGLang share `/generate` and are told apart by the body.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from epp.api import headers as h
from epp.api.apis import Api, BodyFields, api_for_path, bad_request, token_count
from epp.api.sglang import INPUT_FIELDS as SGLANG_INPUTS
from epp.api.sglang import parse_sglang
from epp.api.tgi import parse_tgi

__all__ = ["CHARS_PER_TOKEN", "TOKENIZED_PROMPT", "Api", "InferenceRequest", "api_for_path", "parse_body",
           "parse_request", "prompt_bytes", "slo_seconds"]

CHARS_PER_TOKEN = 4  # the reference's fixed estimate; also used by the prefix hasher
TOKENIZED_PROMPT = "tokenized-prompt"  # the `request.state` key of a `TokenizedPrompt` (`epp.api.preparer`)
# Longest `model` accepted. vLLM itself has no cap (an unknown name is a 404 NotFound, "The model
# `...` does not exist."), but the name travels on into logs, traces and metric labels, so a
# client must not choose its size: real names are far shorter (a Hugging Face repo id is at most
# 96 characters).
MAX_MODEL_NAME_BYTES = 1024


@dataclass(slots=True)
class InferenceRequest:
    """A parsed inference request plus the routing context the proxy sent with it."""

    request_id: str
    api: Api
    model: str  # as the client sent it; native APIs: the adapter named, else the engine ("tgi")
    target_model: str  # after rewrite; what the model server is asked for
    # None for header-only requests; emptied (not None) once the pick is made (`drop_payload`)
    body: dict[str, Any] | None
    prompt: bytes = b""  # the text prefix-affinity hashes (see `prompt_bytes`); b"" after `drop_payload`
    stream: bool = False
    max_tokens: int | None = None
    cache_salt: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    objective: str = ""
    priority: int = 0
    fairness_id: str = h.DEFAULT_FAIRNESS_ID
    body_size: int = 0
    subset: list[str] | None = None  # proxy's subset hint (ip or ip:port); None = no hint
    slo_ttft: float | None = None  # seconds, from x-slo-ttft-ms
    slo_tpot: float | None = None  # seconds, from x-slo-tpot-ms
    received_at: float = 0.0  # when request control received it (its clock), for latency objectives
    # Per-request state of the plugins that handle this request, keyed by plugin name; it lives
    # exactly as long as the request, so no plugin keeps a table of requests of its own.
    state: dict[str, Any] = field(default_factory=dict)
    prompt_chars: int = -1  # len(prompt), kept when the prompt is dropped (-1: set from `prompt`)

    def __post_init__(self) -> None:
        if self.prompt_chars < 0:
            self.prompt_chars = len(self.prompt)

    def drop_payload(self) -> None:
        """Let go of the parsed body and the prompt once the pick is made and the body is on its
        way: a request holds about twice its body in them (the prompt's text in the parsed body
        and again as `prompt`), ~1.2 MB for a 100k-token prompt, for as long as it runs. What
        is read after the pick is kept: `prompt_chars`, and `body is not None` (it had one). The
        prompt's token ids go too (`TOKENIZED_PROMPT`, 4 bytes a token), read only by the pick."""
        if self.body is not None:
            self.body = {}
        self.prompt = b""
        self.state.pop(TOKENIZED_PROMPT, None)

    @property
    def sheddable(self) -> bool:
        return self.priority < 0

    @property
    def prompt_tokens_estimate(self) -> int:
        return self.prompt_chars // CHARS_PER_TOKEN

    @property
    def model_rewritten(self) -> bool:
        return self.target_model != self.model


def parse_body(raw: bytes) -> dict[str, Any]:
    """JSON object or a 400. orjson also rejects invalid UTF-8, which is what we want."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"error unmarshaling request body: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("error unmarshaling request body: not a JSON object")
    return body


def _nonempty(value: Any) -> bool:
    return value is not None and value != "" and value != [] and value != {}


def prompt_bytes(api: Api, body: dict[str, Any]) -> bytes:
    """The bytes prefix affinity hashes, per API, as the reference chooses them.

    Chat messages are serialised as JSON so role boundaries count; a completions prompt list is
    joined with spaces; token-id prompts are serialised as JSON too (stable, C speed).
    """
    if api is Api.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt.encode()
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            return " ".join(prompt).encode()
        return orjson.dumps(prompt)
    if api is Api.CHAT_COMPLETIONS:
        messages = body.get("messages") or []
        return orjson.dumps(
            [{"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m for m in messages]
        )
    if api is Api.RESPONSES:
        parts: list[dict[str, Any]] = []
        if "instructions" in body:
            parts.append({"instructions": body["instructions"]})
        if "tools" in body:
            parts.append({"tools": body["tools"]})
        parts.append({"input": body.get("input")})
        return orjson.dumps(parts)
    if api is Api.CONVERSATIONS:
        return orjson.dumps(body.get("items"))
    return orjson.dumps(body.get("input"))


def _validate(api: Api, body: dict[str, Any]) -> None:
    if api is Api.CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("invalid chat completions request: must have valid messages field")
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad_request("invalid chat completions request: each message needs a string role")
            content = message.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise bad_request("invalid chat completions request: content must be a string or a list of parts")
    elif api is Api.COMPLETIONS:
        prompt = body.get("prompt")
        if not _nonempty(prompt) or not isinstance(prompt, (str, list)):
            raise bad_request("invalid completions request: must have valid prompt field")
    elif api is Api.RESPONSES:
        if not _nonempty(body.get("input")):
            raise bad_request("invalid responses request: must have input field")
    elif api is Api.CONVERSATIONS:
        if not isinstance(body.get("items"), list) or not body["items"]:
            raise bad_request("invalid conversations request: must have items field")
    elif not _nonempty(body.get("input")):
        raise bad_request("invalid embeddings request: must have input field")


def _max_tokens(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = token_count(body.get(key))
        if value is not None:
            return value
    return None


def _check_model_length(name: str, what: str) -> None:
    # len(str) <= bytes <= 4 * len(str): encode only names that may be too long.
    if len(name) > MAX_MODEL_NAME_BYTES // 4 and len(name.encode()) > MAX_MODEL_NAME_BYTES:
        raise bad_request(f"{what} too long: {len(name.encode())} bytes, at most {MAX_MODEL_NAME_BYTES} are accepted")


def slo_seconds(headers: dict[str, str], name: str) -> float | None:
    """A latency objective header in milliseconds, as seconds; None if absent or not a finite
    non-negative number (an objective is a hint: a bad one is ignored, never an error)."""
    raw = headers.get(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return value / 1000.0


def _openai_fields(api: Api, body: dict[str, Any]) -> BodyFields:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model not found in request body")
    _validate(api, body)
    salt = body.get("cache_salt")
    return BodyFields(
        api=api,
        model=model,
        prompt=prompt_bytes(api, body),
        stream=body.get("stream") is True,
        max_tokens=_max_tokens(body),
        cache_salt=salt if isinstance(salt, str) else "",
    )


def _native_fields(api: Api, body: dict[str, Any]) -> BodyFields:
    """TGI's `/generate_stream`; `/generate` by its body: `inputs` is TGI's, `text`, `input_ids`
    or `input_embeds` SGLang's."""
    if api is Api.TGI_GENERATE_STREAM:
        return parse_tgi(body, api)
    tgi = "inputs" in body
    sglang = any(name in body for name in SGLANG_INPUTS)
    if tgi and sglang:
        raise bad_request("invalid generate request: inputs (TGI) and text/input_ids/input_embeds (SGLang) "
                          "cannot be combined")
    if tgi:
        return parse_tgi(body, Api.TGI_GENERATE)
    if sglang:
        return parse_sglang(body)
    raise bad_request("invalid generate request: must have inputs (TGI) or text, input_ids or input_embeds (SGLang)")


def parse_request(
    raw: bytes,
    *,
    path: str,
    request_id: str,
    headers: dict[str, str] | None = None,
) -> InferenceRequest:
    """Parse and validate a request body plus the request-control headers (lower-cased names).

    Raises `EppError` (400) with a clear message."""
    headers = headers or {}
    body = parse_body(raw)
    api = api_for_path(path)
    fields = _native_fields(api, body) if api.native else _openai_fields(api, body)
    # A native body has no `model` field to rewrite: the request keeps its own name.
    rewrite = headers.get(h.MODEL_REWRITE) if fields.rewritable else None
    _check_model_length(fields.model, "model name")
    if rewrite:
        _check_model_length(rewrite, f"{h.MODEL_REWRITE} header")
    return InferenceRequest(
        request_id=request_id,
        api=fields.api,
        model=fields.model,
        target_model=rewrite or fields.model,
        body=body,
        prompt=fields.prompt,
        stream=fields.stream,
        max_tokens=fields.max_tokens,
        cache_salt=fields.cache_salt,
        headers=headers,
        objective=headers.get(h.OBJECTIVE, ""),
        fairness_id=headers.get(h.FAIRNESS_ID) or h.DEFAULT_FAIRNESS_ID,
        body_size=len(raw),
        slo_ttft=slo_seconds(headers, h.SLO_TTFT),
        slo_tpot=slo_seconds(headers, h.SLO_TPOT),
    )
