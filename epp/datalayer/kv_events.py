"""Decoding vLLM's KV-event messages, leniently, and the stream rules around them.

A message is three ZMQ frames: the topic, an 8-byte big-endian sequence number, and a msgpack
`EventBatch` (`[ts, [events...], data_parallel_rank]`, each event a map tagged by `"type"`).
The structs below are our own, field-compatible with vLLM 0.32 (`vllm/distributed/kv_events.py`):
every field is optional, unknown fields (0.32 added `locality`, `ownership`, `session_id`) are
ignored, and an event of an unknown type is skipped rather than failing its batch. Block hashes
are unsigned 64-bit ints (some >= 2**63), or bytes when the engine publishes full digests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

MAX_TOPIC_BYTES = 256
BlockHash = int | bytes


class KVEvent(msgspec.Struct, tag=True, gc=False):
    """Base of the tagged union (`"type": "<class name>"`)."""


class BlockStored(KVEvent):
    block_hashes: list[BlockHash] = []
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVEvent):
    block_hashes: list[BlockHash] = []
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float = 0.0
    events: list[Event] = []
    data_parallel_rank: int | None = None


class _LenientBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float = 0.0
    events: list[msgspec.Raw] = []
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_lenient_decoder = msgspec.msgpack.Decoder(_LenientBatch)
_event_decoder = msgspec.msgpack.Decoder(Event)


class DecodeError(ValueError):
    """A payload that is not an event batch at all (the message is dropped and counted)."""


def decode_payload(payload: bytes) -> tuple[EventBatch, int]:
    """The batch, and how many of its events were skipped (unknown type or malformed)."""
    try:
        return _batch_decoder.decode(payload), 0
    except msgspec.DecodeError:
        pass
    try:
        lenient = _lenient_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"not a KV-event batch: {exc}") from None
    events: list[Event] = []
    skipped = 0
    for raw in lenient.events:
        try:
            events.append(_event_decoder.decode(raw))
        except msgspec.DecodeError:
            skipped += 1
    return EventBatch(lenient.ts, events, lenient.data_parallel_rank), skipped


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence number (signed: vLLM's replay end marker is -1)."""
    if len(frame) != 8:
        raise DecodeError(f"sequence frame has {len(frame)} bytes, want 8")
    return int.from_bytes(frame, "big", signed=True)


@dataclass(slots=True, frozen=True)
class Topic:
    """`kv@<ip>:<port>@<model>` (llm-d's convention): which endpoint a central-mode message is for."""

    address: str
    model: str


def parse_topic(topic: bytes) -> Topic | None:
    """The endpoint a topic names, or None when it names none (the caller counts and warns)."""
    if len(topic) > MAX_TOPIC_BYTES:
        return None
    try:
        text = topic.decode()
    except UnicodeDecodeError:
        return None
    parts = text.split("@")
    if len(parts) < 2 or parts[0] != "kv" or not parts[1]:
        return None
    return Topic(parts[1], "@".join(parts[2:]))


class StreamState:
    """Sequence bookkeeping of one publisher (one endpoint, one data-parallel rank).

    `verdict(seq)` says what a live message means: "next" (apply it), "gap" (messages were
    lost: replay them, or reset), "restart" (the numbers went back: the engine restarted, its
    cache is empty) or "first" (the first message this EPP sees; earlier ones may be replayable)."""

    __slots__ = ("expected",)

    def __init__(self) -> None:
        self.expected: int | None = None

    def verdict(self, seq: int) -> str:
        expected = self.expected
        if expected is None:
            return "first"
        if seq == expected:
            return "next"
        if seq > expected:
            return "gap"
        return "restart"

    def advance(self, seq: int) -> None:
        self.expected = seq + 1
