"""The responses of successive slices as one OpenAI response (pure: bytes and dicts in and out).

A whole (non-streaming) response is the first slice's JSON with the text of all slices, the last
slice's finish reason and the usage summed: the client's prompt tokens (the first slice's), the
completion tokens of every slice. Every other field — id, created, model, fingerprint, their
order — is the first slice's, so the client gets exactly the shape an unsliced request gets.

A stream keeps every event as vLLM wrote it, byte for byte, except:
- later slices' events carry the first slice's `id` and `created` (rewritten in place);
- a later slice's opening chat event (`delta.role`) is dropped: the stream has one;
- a slice's finish event is held until it is known whether another slice follows. If one does,
  it goes out as an ordinary content event (`finish_reason: null`; a chat chunk also loses its
  `stop_reason`, which only finish chunks have; an empty chat one is dropped). The last slice's
  goes out as it came;
- the usage events of the slices (the slicer always asks for them: they say how many tokens a
  slice made) become one, with the sums, at the end — only if the client asked for usage;
- one `[DONE]` ends the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

DATA = b"data: "
DONE = b"[DONE]"
SEP = b"\n\n"


def event(payload: bytes) -> bytes:
    return DATA + payload + SEP


def _choice(obj: dict[str, Any]) -> dict[str, Any] | None:
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def _text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        part = choice.get("delta") if "delta" in choice else choice.get("message")
        value = part.get("content") if isinstance(part, dict) else None
    else:
        value = choice.get("text")
    return value if isinstance(value, str) else ""


def _completion_tokens(obj: dict[str, Any]) -> int:
    usage = obj.get("usage")
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _summed_usage(first: dict[str, Any], completion: int) -> dict[str, Any]:
    usage = dict(first)
    prompt = usage.get("prompt_tokens")
    prompt = prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else 0
    usage["completion_tokens"] = completion
    usage["total_tokens"] = prompt + completion
    return usage


@dataclass(slots=True)
class SliceEnd:
    """How a slice ended: its finish reason ("" if it sent none) and its tokens."""

    finish_reason: str
    completion_tokens: int
    prompt_tokens: int


def merge(responses: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """One whole response from the slices' whole responses (at least one)."""
    first = responses[0]
    out = dict(first)
    choice = _choice(first)
    if choice is None:
        return out
    text = "".join(_text(c, chat) for c in (_choice(r) for r in responses) if c is not None)
    last = _choice(responses[-1]) or choice
    merged = dict(choice)
    if chat:
        message = dict(choice.get("message") or {})
        message["content"] = text
        merged["message"] = message
    else:
        merged["text"] = text
    for key in ("finish_reason", "stop_reason"):
        if key in merged:
            merged[key] = last.get(key)
    out["choices"] = [merged, *first["choices"][1:]]
    if isinstance(first.get("usage"), dict):
        out["usage"] = _summed_usage(first["usage"], sum(_completion_tokens(r) for r in responses))
    return out


class StreamStitcher:
    """Feeds on the event lines of one slice after another; returns the bytes to send the client."""

    def __init__(self, *, chat: bool, client_wants_usage: bool) -> None:
        self.chat = chat
        self.client_wants_usage = client_wants_usage
        self.index = -1  # the slice being fed
        self.text = ""  # everything generated so far
        self.completion_tokens = 0
        self._id: bytes | None = None
        self._created: bytes | None = None
        self._slice_id: bytes | None = None
        self._slice_created: bytes | None = None
        self._finish: dict[str, Any] | None = None  # the held finish event of the current slice
        self._last_finish: dict[str, Any] | None = None  # the latest finish event seen, held or not
        self._finish_reason = ""
        self._usage: dict[str, Any] | None = None  # the first slice's usage object
        self._slice_tokens = 0
        self._slice_prompt = 0

    # -- one slice --

    def begin_slice(self) -> None:
        self.index += 1
        self._finish = None
        self._finish_reason = ""
        self._slice_tokens = 0
        self._slice_prompt = 0
        self._slice_id = self._slice_created = None

    def feed(self, line: bytes) -> bytes:
        """One line of the upstream stream; the bytes to forward now (often none)."""
        if not line.startswith(DATA):
            return b""  # blank separators and anything but data lines
        payload = line[len(DATA):].rstrip(b"\r\n")
        if payload == DONE:
            return b""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event(payload)  # not ours to judge: forward it
        if not isinstance(obj, dict):
            return event(payload)
        self._learn_ids(obj)
        choice = _choice(obj)
        if choice is None:
            if isinstance(obj.get("usage"), dict):  # the slice's usage event: count it, send it later
                self._slice_tokens = _completion_tokens(obj)
                prompt = obj["usage"].get("prompt_tokens")
                self._slice_prompt = prompt if isinstance(prompt, int) else 0
                if self._usage is None:
                    self._usage = obj
                return b""
            return self._out(payload)  # e.g. an error event
        text = _text(choice, self.chat)
        self.text += text
        if choice.get("finish_reason") is not None:
            self._finish = self._last_finish = obj
            self._finish_reason = str(choice["finish_reason"])
            return b""
        if self.index > 0 and self.chat and isinstance(choice.get("delta"), dict) and "role" in choice["delta"]:
            return b""  # the stream opened with the first slice's role event
        return self._out(payload)

    def end_slice(self) -> SliceEnd:
        self.completion_tokens += self._slice_tokens
        return SliceEnd(self._finish_reason, self._slice_tokens, self._slice_prompt)

    def resume(self) -> bytes:
        """Another slice follows: the held finish event as an ordinary content event."""
        held, self._finish = self._finish, None
        if held is None:
            return b""
        choice = dict(_choice(held) or {})
        choice["finish_reason"] = None
        if self.chat:
            choice.pop("stop_reason", None)
            delta = choice.get("delta")
            if isinstance(delta, dict) and not delta.get("content") and len(delta) <= 1:
                return b""
        obj = dict(held)
        obj["choices"] = [choice, *held["choices"][1:]]
        return self._dump(obj)

    def finish(self, finish_reason: str | None = None) -> bytes:
        """The end of the stream: the last slice's finish event as it came — or, when a
        continuation could not run (`finish_reason` given), an empty one like it with that
        reason — then the summed usage if the client asked for it, then `[DONE]`."""
        out = b""
        held, self._finish = self._finish, None
        if held is not None and finish_reason is None:
            out += self._dump(held)
        elif self._last_finish is not None:
            last = self._last_finish
            choice = dict(_choice(last) or {})
            if self.chat:
                choice["delta"] = {**(choice.get("delta") or {}), "content": ""}
            else:
                choice["text"] = ""
            choice["finish_reason"] = finish_reason or self._finish_reason or "length"
            out += self._dump({**last, "choices": [choice, *last["choices"][1:]]})
        if self.client_wants_usage and self._usage is not None:
            obj = dict(self._usage)
            obj["usage"] = _summed_usage(self._usage["usage"], self.completion_tokens)
            out += self._dump(obj)
        return out + event(DONE)

    # -- ids --

    def _learn_ids(self, obj: dict[str, Any]) -> None:
        if self._slice_id is not None:
            return
        rid, created = obj.get("id"), obj.get("created")
        if isinstance(rid, str):
            self._slice_id = orjson.dumps(rid)
            if self._id is None:
                self._id = self._slice_id
        if isinstance(created, int) and not isinstance(created, bool):
            self._slice_created = str(created).encode()
            if self._created is None:
                self._created = self._slice_created

    def _out(self, payload: bytes) -> bytes:
        """An upstream event as it came, but with the first slice's id and created."""
        if self.index > 0:
            if self._slice_id is not None and self._id is not None and self._slice_id != self._id:
                payload = payload.replace(b'"id":' + self._slice_id, b'"id":' + self._id, 1)
            if self._slice_created is not None and self._created is not None \
                    and self._slice_created != self._created:
                payload = payload.replace(b'"created":' + self._slice_created, b'"created":' + self._created, 1)
        return event(payload)

    def _dump(self, obj: dict[str, Any]) -> bytes:
        if self._id is not None and "id" in obj:
            obj = dict(obj)
            obj["id"] = orjson.loads(self._id)
            if self._created is not None and "created" in obj:
                obj["created"] = int(self._created)
        return event(orjson.dumps(obj))
