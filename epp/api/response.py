"""Reading token usage from model-server responses, JSON or SSE, without parsing every token event.

The response path is hot (one call per streamed chunk), so the observer never parses an event it
does not need. Where usage lives, per API:

- OpenAI APIs: a `usage` object. With `stream_options.include_usage` it comes once, in the last
  event before `data: [DONE]`; the observer parses only events that mention `"usage"`.
- TGI `/generate`: the `x-prompt-tokens` / `x-generated-tokens` response headers TGI always sets,
  and `details.generated_tokens` (+ `details.prefill`) when the client asked for `details`.
- TGI `/generate_stream`: the last event. With `parameters.details` it carries
  `details.generated_tokens` and `details.input_length`; without, its `index` is the number of
  tokens generated and the prompt is the EPP's own estimate (TGI reports it nowhere else).
- SGLang `/generate`: `meta_info.prompt_tokens`, `completion_tokens`, `cached_tokens`, on the
  response (a list of them for a batch) or, cumulatively, on every streamed event; the last
  event is the total (of its batch item: a streamed batch is accounted by its last item).

For the native streams only the span of the last event is remembered, and parsed once at the end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from epp.api.apis import Api

if TYPE_CHECKING:
    from epp.api.request import InferenceRequest

_USAGE = b'"usage"'
_SSE_DATA = b"data:"
_DONE = b"[DONE]"
_MAX_TOKENS = 1 << 31  # a token count a pod reports is believed only below this
TGI_PROMPT_TOKENS = "x-prompt-tokens"
TGI_GENERATED_TOKENS = "x-generated-tokens"


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_TOKENS:
        return value
    return None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0
    cached_reported: bool = False  # the response carried a cached-token count (0 is a real count then)

    @classmethod
    def from_json(cls, usage: object) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        if not isinstance(prompt, int) and not isinstance(completion, int):
            return None
        prompt = prompt if isinstance(prompt, int) else 0
        completion = completion if isinstance(completion, int) else 0
        total = usage.get("total_tokens")
        details = usage.get("prompt_tokens_details") or usage.get("prompt_token_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=total if isinstance(total, int) else prompt + completion,
            cached_tokens=cached if isinstance(cached, int) else 0,
            cached_reported=isinstance(cached, int),
        )

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int | None = None) -> Usage:
        """`cached`: the reported cached prompt tokens; None when the response gave none."""
        return cls(prompt, completion, prompt + completion, cached or 0, cached is not None)


def _document(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _usage_of(document: bytes) -> Usage | None:
    parsed = _document(document)
    if not isinstance(parsed, dict):
        return None
    usage = parsed.get("usage")
    if usage is None and isinstance(parsed.get("response"), dict):  # Responses API event
        usage = parsed["response"].get("usage")
    return Usage.from_json(usage)


def tgi_usage(parsed: Any, prompt_estimate: int = 0) -> Usage | None:
    """Usage in a TGI `GenerateResponse` or in the last `StreamResponse` event."""
    if not isinstance(parsed, dict) or "error" in parsed:
        return None
    details = parsed.get("details")
    if isinstance(details, dict):
        completion = _count(details.get("generated_tokens"))
        prompt = _count(details.get("input_length"))  # stream details
        prefill = details.get("prefill")
        if prompt is None and isinstance(prefill, list) and prefill:  # decoder_input_details
            prompt = len(prefill)
        if completion is not None:
            return Usage.of(prompt_estimate if prompt is None else prompt, completion)
    index = _count(parsed.get("index"))  # a stream without details: tokens so far
    if index is not None and "token" in parsed:
        return Usage.of(prompt_estimate, index)
    return None


def _sglang_one(item: Any) -> Usage | None:
    meta = item.get("meta_info") if isinstance(item, dict) else None
    if not isinstance(meta, dict):
        return None
    prompt, completion = _count(meta.get("prompt_tokens")), _count(meta.get("completion_tokens"))
    if prompt is None and completion is None:
        return None
    return Usage.of(prompt or 0, completion or 0, _count(meta.get("cached_tokens")))


def sglang_usage(parsed: Any) -> Usage | None:
    """Usage in an SGLang `/generate` response (one object, or a list for a batch) or event."""
    if not isinstance(parsed, list):
        return _sglang_one(parsed)
    parts = [u for u in map(_sglang_one, parsed) if u is not None]
    if not parts:
        return None
    return Usage.of(sum(u.prompt_tokens for u in parts), sum(u.completion_tokens for u in parts),
                    sum(u.cached_tokens for u in parts))


def _header_usage(headers: Mapping[str, str]) -> tuple[int | None, int | None]:
    """TGI's `x-prompt-tokens` / `x-generated-tokens`, when they are sane integers."""
    def number(name: str) -> int | None:
        text = headers.get(name, "")
        return _count(int(text)) if text.isdigit() and len(text) < 12 else None
    return number(TGI_PROMPT_TOKENS), number(TGI_GENERATED_TOKENS)


def _last_event(block: bytes, end: int) -> tuple[int, int] | None:
    """Span of the payload of the last `data:` line in block[:end] that is not `[DONE]`.

    `data:` counts only at the start of a line: JSON strings cannot hold a raw newline, so a
    generated text that says "data:" is never taken for an event."""
    pos = end
    while True:
        i = block.rfind(_SSE_DATA, 0, pos)
        if i < 0:
            return None
        if i == 0 or block[i - 1] in b"\r\n":
            stop = block.find(b"\n", i, end)
            stop = end if stop < 0 else stop
            start = i + len(_SSE_DATA)
            if start < stop and block[start] == 0x20:  # "data: {...}" (SGLang) or "data:{...}" (TGI)
                start += 1
            # Looked at in place: an event can be large (SGLang repeats the whole text in each).
            if stop - start > 2 and not block.startswith(_DONE, start):
                return start, stop
        pos = i


class ResponseObserver:
    """Feed response body chunks; `usage` holds the last usage seen.

    `streaming` decides the framing: SSE events (`data: {...}`), else one JSON document that is
    buffered up to `max_buffer` bytes (larger bodies are not parsed; they are still forwarded).
    `api` decides where usage is read (see the module docstring); `headers` are the response's
    (TGI's token-count headers); `prompt_estimate` stands in for a prompt size TGI did not report.
    """

    def __init__(self, streaming: bool, max_buffer: int = 4 << 20, *, api: Api = Api.COMPLETIONS,
                 headers: Mapping[str, str] | None = None, prompt_estimate: int = 0) -> None:
        self.streaming = streaming
        self.api = api
        self.usage: Usage | None = None
        self.bytes_seen = 0
        self.first_chunk_seen = False
        self._max_buffer = max_buffer
        self._pending = bytearray()  # SSE: an incomplete last line; JSON: the whole body so far
        self._overflow = False
        self._native = api in (Api.TGI_GENERATE, Api.TGI_GENERATE_STREAM, Api.SGLANG_GENERATE)
        self._last: tuple[bytes, int, int] | None = None  # native SSE: where the last event is
        self._prompt_estimate = prompt_estimate
        self._header_counts = _header_usage(headers) if headers and api is Api.TGI_GENERATE else (None, None)

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        self.bytes_seen += len(chunk)
        self.first_chunk_seen = True
        if not self.streaming:
            if not self._overflow:
                if len(self._pending) + len(chunk) > self._max_buffer:
                    self._overflow = True
                    self._pending.clear()
                else:
                    self._pending += chunk
            return
        # SSE: only complete lines are looked at; carry a partial line across chunks.
        if self._pending:
            data = bytes(self._pending) + chunk
            self._pending.clear()
        else:
            data = chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._keep_tail(data)
            return
        if cut + 1 < len(data):
            self._keep_tail(data[cut + 1 :])
        if self._native:
            span = _last_event(data, cut + 1)
            if span is not None:
                self._last = (data, *span)
            return
        if _USAGE not in data:
            return
        for line in data[: cut + 1].split(b"\n"):
            if _USAGE in line and line.startswith(_SSE_DATA):
                usage = _usage_of(line[len(_SSE_DATA) :].strip())
                if usage is not None:
                    self.usage = usage

    def _keep_tail(self, tail: bytes) -> None:
        if len(tail) <= self._max_buffer:
            self._pending += tail

    def finish(self) -> Usage | None:
        """Call at end of body: parses the buffered JSON, the last native event, or a final
        unterminated SSE line."""
        tail = bytes(self._pending)
        self._pending.clear()
        if self._native:
            self._finish_native(tail)
        elif tail:
            if not self.streaming:
                usage = _usage_of(tail)
            elif tail.startswith(_SSE_DATA) and _USAGE in tail:
                usage = _usage_of(tail[len(_SSE_DATA) :].strip())
            else:
                usage = None
            if usage is not None:
                self.usage = usage
        return self.usage

    def _finish_native(self, tail: bytes) -> None:
        if self.streaming:
            span = _last_event(tail, len(tail)) if tail else None
            if span is not None:
                self._last = (tail, *span)
            document = self._last[0][self._last[1]:self._last[2]] if self._last is not None else b""
        else:
            document = tail
        parsed = _document(document) if document else None
        if self.api is Api.SGLANG_GENERATE:
            usage = sglang_usage(parsed)
        else:
            usage = tgi_usage(parsed, self._prompt_estimate)
            header_prompt, header_completion = self._header_counts
            if header_completion is not None:  # TGI's own count, on every /generate answer
                if header_prompt is None:
                    header_prompt = usage.prompt_tokens if usage is not None else self._prompt_estimate
                usage = Usage.of(header_prompt, header_completion)
        if usage is not None:
            self.usage = usage


def observer_for(request: InferenceRequest | None, headers: Mapping[str, str], streaming: bool) -> ResponseObserver:
    """The observer for a request's response, reading usage where its API puts it."""
    if request is None:
        return ResponseObserver(streaming=streaming)
    return ResponseObserver(streaming=streaming, api=request.api, headers=headers,
                            prompt_estimate=request.prompt_tokens_estimate)


def rewrite_model_name(chunk: bytes, target: str, incoming: str) -> bytes:
    """Put the client's model name back into a response, as the reference does (byte replace)."""
    if target == incoming or target.encode() not in chunk:
        return chunk
    t, i = orjson.dumps(target), orjson.dumps(incoming)
    return chunk.replace(b'"model":' + t, b'"model":' + i).replace(b'"model": ' + t, b'"model": ' + i)
