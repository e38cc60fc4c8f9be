"""Reading `usage` from model-server responses, JSON or SSE, without parsing every token event.

The response path is hot (one call per streamed chunk), so the observer only looks for the bytes
`"usage"` and parses just the event that carries a non-null usage object: with
`stream_options.include_usage`, vLLM sends it once, in the last event before `data: [DONE]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

_USAGE = b'"usage"'
_SSE_DATA = b"data:"


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0

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
        )


def _usage_of(document: bytes) -> Usage | None:
    try:
        parsed = orjson.loads(document)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    usage = parsed.get("usage")
    if usage is None and isinstance(parsed.get("response"), dict):  # Responses API event
        usage = parsed["response"].get("usage")
    return Usage.from_json(usage)


class ResponseObserver:
    """Feed response body chunks; `usage` holds the last usage seen.

    `streaming` decides the framing: SSE events (`data: {...}`), else one JSON document that is
    buffered up to `max_buffer` bytes (larger bodies are not parsed; they are still forwarded).
    """

    def __init__(self, streaming: bool, max_buffer: int = 4 << 20) -> None:
        self.streaming = streaming
        self.usage: Usage | None = None
        self.bytes_seen = 0
        self.first_chunk_seen = False
        self._max_buffer = max_buffer
        self._pending = bytearray()  # SSE: an incomplete last line; JSON: the whole body so far
        self._overflow = False

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
        # SSE: only events that mention "usage" are parsed; carry a partial line across chunks.
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
        """Call at end of body: parses the buffered JSON (or a final unterminated SSE line)."""
        if self._pending:
            data = bytes(self._pending)
            self._pending.clear()
            if not self.streaming:
                usage = _usage_of(data)
            elif data.startswith(_SSE_DATA) and _USAGE in data:
                usage = _usage_of(data[len(_SSE_DATA) :].strip())
            else:
                usage = None
            if usage is not None:
                self.usage = usage
        return self.usage


def rewrite_model_name(chunk: bytes, target: str, incoming: str) -> bytes:
    """Put the client's model name back into a response, as the reference does (byte replace)."""
    if target == incoming or target.encode() not in chunk:
        return chunk
    t, i = orjson.dumps(target), orjson.dumps(incoming)
    return chunk.replace(b'"model":' + t, b'"model":' + i).replace(b'"model": ' + t, b'"model": ' + i)
