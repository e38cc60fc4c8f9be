"""TGI 3.3's request bodies as its router reads and validates them, with its exact error shapes.

Two layers reject a request, as in TGI (tests/fixtures/tgi-3.3/README.md):
- axum's `Json` extractor, before any handler: plain-text 415 (no JSON content type), 400 (not
  JSON) and 422 (JSON of the wrong shape: serde's message; its line/column is approximate here);
- TGI's validation (`router/src/validation.rs`): `{"error": "Input validation error: ...",
  "error_type": "validation"}`, 422, or, on `/generate_stream`, the same as an SSE event.
Unknown fields are ignored, as serde does without `deny_unknown_fields`; they are counted so a
test can see what a client (or the EPP) sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from array import array

from epp.sim.tokens import Tokenizer, load_tokenizer


class Rejection(Exception):
    """axum's extractor rejection: a plain-text body."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


class TgiError(Exception):
    """One of TGI's `InferError`s: status plus `ErrorResponse {error, error_type}`."""

    def __init__(self, status: int, error: str, error_type: str) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.error_type = error_type

    def body(self) -> bytes:
        return orjson.dumps({"error": self.error, "error_type": self.error_type})


def validation_error(message: str) -> TgiError:
    return TgiError(422, f"Input validation error: {message}", "validation")


@dataclass(slots=True)
class Limits:
    """The launcher's limits (its defaults, with TGI's max_total_tokens = the model's length)."""

    max_total_tokens: int
    max_input_tokens: int
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    tokenizer: Tokenizer | None = None  # the pod's (None: the simulator's default)

    @classmethod
    def for_model_len(cls, max_model_len: int, tokenizer: Tokenizer | None = None) -> Limits:
        return cls(max_total_tokens=max_model_len, max_input_tokens=max_model_len - 1, tokenizer=tokenizer)

    def encode(self, text: str) -> array:
        """TGI tokenizes `inputs` with the tokenizer's special tokens (a BOS where it has one)."""
        tokenizer = self.tokenizer or load_tokenizer()
        return tokenizer.encode(text, add_special_tokens=True)


@dataclass(slots=True)
class Generation:
    """A request TGI accepted: what the engine runs and how the answer is shaped."""

    inputs: str
    input_length: int
    max_new_tokens: int
    input_ids: array  # what the engine computes (truncated to `input_length` from the left)
    details: bool
    sampling: bool  # a seed is reported only when sampling
    seed: int | None
    adapter_id: str | None
    ignored: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- axum + serde

_TYPES = {  # GenerateParameters (router/src/lib.rs): field -> serde's expectation
    "best_of": "usize?", "temperature": "f32?", "repetition_penalty": "f32?", "frequency_penalty": "f32?",
    "top_k": "i32?", "top_p": "f32?", "typical_p": "f32?", "do_sample": "bool", "max_new_tokens": "u32?",
    "return_full_text": "bool?", "stop": "[string]", "truncate": "usize?", "watermark": "bool",
    "details": "bool", "decoder_input_details": "bool", "seed": "u64?", "top_n_tokens": "u32?",
    "adapter_id": "string?", "grammar": "any?",
}
_CHAT_TYPES = {  # ChatRequest
    "model": "string?", "frequency_penalty": "f32?", "logprobs": "bool?", "top_logprobs": "u32?",
    "max_tokens": "u32?", "max_completion_tokens": "u32?", "n": "u32?", "presence_penalty": "f32?",
    "stop": "[string]?", "stream": "bool", "seed": "u64?", "temperature": "f32?", "top_p": "f32?",
    "tools": "any?", "tool_prompt": "string?", "tool_choice": "any?", "response_format": "any?",
    "stream_options": "any?", "logit_bias": "any?",
}
_COMPLETION_TYPES = {  # CompletionRequest
    "model": "string?", "prompt": "any", "max_tokens": "u32?", "temperature": "f32?", "top_p": "f32?",
    "stream": "bool", "seed": "u64?", "suffix": "string?", "repetition_penalty": "f32?",
    "frequency_penalty": "f32?", "stop": "[string]?",
}
_EXPECTED = {"usize": "usize", "u32": "u32", "u64": "u64", "i32": "i32", "f32": "f32", "bool": "a boolean",
             "string": "a string", "[string]": "a sequence"}
_INT_LIMITS = {"u32": (0, 2**32 - 1), "usize": (0, 2**64 - 1), "u64": (0, 2**64 - 1), "i32": (-2**31, 2**31 - 1)}


def _where(raw: bytes) -> str:
    """serde_json's position, taken at the end of the document (exact for a missing field)."""
    text = raw.rstrip()
    line = text.count(b"\n") + 1
    column = len(text) - (text.rfind(b"\n") + 1)
    return f"at line {line} column {column}"


def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{str(v).lower()}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map"


def _type_error(kind: str, v: Any) -> str | None:
    """serde's complaint about `v` for a field of `kind`, or None if it fits."""
    optional = kind.endswith("?")
    base = kind.rstrip("?")
    if v is None:
        return None if optional or base == "any" else f"invalid type: null, expected {_EXPECTED[base]}"
    if base == "any":
        return None
    if base == "bool":
        ok = isinstance(v, bool)
    elif base == "string":
        ok = isinstance(v, str)
    elif base == "[string]":
        if not isinstance(v, list):
            return f"invalid type: {_unexpected(v)}, expected a sequence"
        for item in v:
            if not isinstance(item, str):
                return f"invalid type: {_unexpected(item)}, expected a string"
        return None
    elif base == "f32":
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    else:
        if isinstance(v, int) and not isinstance(v, bool):
            low, high = _INT_LIMITS[base]
            return None if low <= v <= high else f"invalid value: integer `{v}`, expected {base}"
        ok = False
    return None if ok else f"invalid type: {_unexpected(v)}, expected {_EXPECTED[base]}"


def decode(raw: bytes, content_type: str) -> Any:
    """axum's `Json` extractor up to the JSON value."""
    mime = content_type.split(";", 1)[0].strip().lower()
    if not (mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))):
        raise Rejection(415, "Expected request with `Content-Type: application/json`")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise Rejection(400, f"Failed to parse the request body as JSON: {e.msg} {_where(raw)}") from None


def _shape_error(raw: bytes, message: str) -> Rejection:
    return Rejection(422, f"Failed to deserialize the JSON body into the target type: {message} {_where(raw)}")


def _check(raw: bytes, obj: Any, types: dict[str, str], path: str, ignored: list[str]) -> None:
    if not isinstance(obj, dict):
        where = f"{path}: " if path else ""
        raise _shape_error(raw, f"{where}invalid type: {_unexpected(obj)}, expected struct")
    for key, value in obj.items():
        kind = types.get(key)
        if kind is None:
            if not path:
                ignored.append(key)
            continue
        problem = _type_error(kind, value)
        if problem is not None:
            raise _shape_error(raw, f"{path}{'.' if path else ''}{key}: {problem}")


# ---------------------------------------------------------------- validation (validation.rs)

def _validate(p: dict[str, Any], inputs: str, limits: Limits, *, stream: bool, default_sampling: bool) -> Generation:
    best_of = p.get("best_of") or 1
    warpers = any(p.get(k) is not None for k in ("temperature", "top_k", "top_p", "typical_p"))
    sampling = bool(p.get("do_sample", default_sampling)) or warpers
    if stream and best_of != 1:
        raise validation_error("`best_of` != 1 is not supported when streaming tokens")
    if stream and p.get("decoder_input_details"):
        raise validation_error("`decoder_input_details` == true is not supported when streaming tokens")
    if best_of > 1 and not sampling:
        raise validation_error("you must use sampling when `best_of` is > 1")
    if best_of > limits.max_best_of:
        raise validation_error(f"`best_of` must be > 0 and <= {limits.max_best_of}. Given: {best_of}")
    if best_of > 1:
        raise validation_error("the simulator supports only `best_of` == 1")
    if (p.get("temperature") if p.get("temperature") is not None else 1.0) <= 0.0:
        raise validation_error("`temperature` must be strictly positive")
    if (p.get("repetition_penalty") if p.get("repetition_penalty") is not None else 1.0) <= 0.0:
        raise validation_error("`repetition_penalty` must be strictly positive")
    if not -2.0 <= (p.get("frequency_penalty") or 0.0) <= 2.0:
        raise validation_error("`frequency_penalty` must be >= -2.0 and <= 2.0")
    for key in ("top_p", "typical_p"):
        value = p.get(key)
        if value is not None and not 0.0 < value < 1.0:
            raise validation_error(f"`{key}` must be > 0.0 and < 1.0")
    if p.get("top_k") is not None and p["top_k"] <= 0:
        raise validation_error("`top_k` must be strictly positive")
    max_new_tokens = p.get("max_new_tokens")
    if max_new_tokens == 0:
        raise validation_error("`max_new_tokens` must be strictly positive")
    stop = p.get("stop") or []
    if len(stop) > limits.max_stop_sequences:
        raise validation_error(f"`stop` supports up to {limits.max_stop_sequences} stop sequences. "
                               f"Given: {len(stop)}")
    top_n = p.get("top_n_tokens")
    if top_n is not None and top_n > limits.max_top_n_tokens:
        raise validation_error(f"`top_n_tokens` must be >= 0 and <= {limits.max_top_n_tokens}. Given: {top_n}")
    if not inputs:
        raise validation_error("`inputs` cannot be empty")
    truncate = p.get("truncate")
    if truncate is not None and (truncate == 0 or truncate > limits.max_input_tokens):
        raise validation_error(f"`truncate` must be strictly positive and less than {limits.max_input_tokens}. "
                               f"Given: {truncate}")
    ids = limits.encode(inputs)
    input_length = len(ids)
    if truncate is not None and input_length > truncate:
        input_length = truncate
        ids = ids[-truncate:]  # TGI keeps the end of the prompt
    if max_new_tokens is None:
        max_new_tokens = max(0, limits.max_total_tokens - input_length)
    if input_length + max_new_tokens > limits.max_total_tokens:
        raise validation_error(f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
                               f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`")
    if input_length > limits.max_input_tokens:
        raise validation_error(f"`inputs` must have less than {limits.max_input_tokens} tokens. "
                               f"Given: {input_length}")
    adapter = p.get("adapter_id")
    return Generation(inputs=inputs, input_length=input_length, max_new_tokens=max_new_tokens, input_ids=ids,
                      details=bool(p.get("details")) or bool(p.get("decoder_input_details")),
                      sampling=sampling, seed=p.get("seed"), adapter_id=adapter)


def parse_generate(raw: bytes, content_type: str) -> tuple[dict[str, Any], list[str]]:
    """A `GenerateRequest` through axum and serde: (the body, its ignored top-level keys)."""
    body = decode(raw, content_type)
    ignored: list[str] = []
    _check(raw, body, {"inputs": "string", "parameters": "any?"}, "", ignored)
    if body.get("parameters") is not None:
        _check(raw, body["parameters"], _TYPES, "parameters", ignored)
    if "inputs" not in body:
        raise _shape_error(raw, "missing field `inputs`")
    return body, ignored


def validate_generate(body: dict[str, Any], ignored: list[str], limits: Limits, *, stream: bool) -> Generation:
    """TGI's validation of a parsed `GenerateRequest`; raises `TgiError`."""
    params = body.get("parameters")
    # No `parameters` at all: TGI's default_parameters() samples; present, serde's default is false.
    gen = _validate(params or {}, body["inputs"], limits, stream=stream, default_sampling=params is None)
    gen.ignored = ignored
    return gen


@dataclass(slots=True)
class Chat:
    """A Messages API request as `ChatRequest::try_into_generate` turns it into a generation."""

    params: dict[str, Any]
    inputs: str  # the messages through the chat template
    model: str | None
    stream: bool
    include_usage: bool
    ignored: list[str]


def parse_chat(raw: bytes, content_type: str, tokenizer: Tokenizer | None = None) -> Chat:
    """A `ChatRequest` through axum and serde; raises `Rejection`."""
    body = decode(raw, content_type)
    ignored: list[str] = []
    _check(raw, body, {"messages": "any", **_CHAT_TYPES}, "", ignored)
    if "messages" not in body:
        raise _shape_error(raw, "missing field `messages`")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise _shape_error(raw, f"messages: invalid type: {_unexpected(messages)}, expected a sequence")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _shape_error(raw, f"messages[{i}]: missing field `role`")
        if "content" not in m and "tool_calls" not in m:
            raise _shape_error(raw, f"messages[{i}]: data did not match any variant of untagged enum MessageBody")
    options = body.get("stream_options") or {}
    temperature = body.get("temperature")
    model = body.get("model")
    params = {
        "max_new_tokens": body.get("max_completion_tokens", body.get("max_tokens")),
        "stop": body.get("stop") or [], "seed": body.get("seed"), "top_p": body.get("top_p"),
        "temperature": None if temperature == 0 else temperature, "do_sample": temperature != 0,
        "top_n_tokens": body.get("top_logprobs"), "details": True,
        "adapter_id": model if model != "tgi" else None,
    }
    inputs = (tokenizer or load_tokenizer()).render_chat(messages, True)
    return Chat(params=params, inputs=inputs, model=model, stream=body.get("stream") is True,
                include_usage=isinstance(options, dict) and options.get("include_usage") is True, ignored=ignored)


def validate_chat(chat: Chat, limits: Limits) -> Generation:
    """TGI's validation of the generation a chat request becomes; raises `TgiError`."""
    gen = _validate(chat.params, chat.inputs, limits, stream=False, default_sampling=True)
    gen.ignored = chat.ignored
    return gen


@dataclass(slots=True)
class Completion:
    """A `/v1/completions` request as the `completions` handler turns it into generations."""

    params: dict[str, Any]
    prompts: list[str]
    stream: bool
    suffix: bool
    ignored: list[str]


def parse_completion(raw: bytes, content_type: str) -> Completion:
    """A `CompletionRequest` through axum and serde; raises `Rejection`."""
    body = decode(raw, content_type)
    ignored: list[str] = []
    _check(raw, body, _COMPLETION_TYPES, "", ignored)
    if "prompt" not in body:
        raise _shape_error(raw, "missing field `prompt`")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        if not prompt:
            raise _shape_error(raw, "prompt: Empty array detected. Do not use an empty array for the prompt.")
        prompts = list(prompt)
    else:
        raise _shape_error(raw, "prompt: data did not match any variant of untagged enum PromptDeserializer")
    temperature = body.get("temperature")
    model = body.get("model")
    params = {
        "max_new_tokens": body.get("max_tokens"), "stop": body.get("stop") or [], "seed": body.get("seed"),
        "top_p": body.get("top_p"), "temperature": None if temperature == 0 else temperature,
        "do_sample": temperature != 0, "repetition_penalty": body.get("repetition_penalty"),
        "frequency_penalty": body.get("frequency_penalty"), "details": True,
        "adapter_id": model if model != "tgi" else None,
    }
    return Completion(params=params, prompts=prompts, stream=body.get("stream") is True,
                      suffix=body.get("suffix") is not None, ignored=ignored)


def check_completion(c: Completion, max_client_batch_size: int = 4) -> None:
    """The `completions` handler's own checks, before any generation; raises `TgiError`."""
    if c.suffix:
        raise TgiError(422, "Suffix is not supported and can be achieved by preprocessing the prompt.",
                       "suffix not supported")
    if len(c.prompts) > max_client_batch_size:
        raise TgiError(422, f"Number of prompts exceeds the maximum allowed batch size of {max_client_batch_size}",
                       "batch size exceeded")


def validate_completion(c: Completion, limits: Limits) -> Generation:
    """TGI's validation of the generation a (one-prompt) completion becomes; raises `TgiError`."""
    if len(c.prompts) > 1:
        raise validation_error("the simulator supports one prompt per request")
    gen = _validate(c.params, c.prompts[0], limits, stream=c.stream, default_sampling=True)
    gen.ignored = c.ignored
    return gen
