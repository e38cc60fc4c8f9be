"""KV-cache events exactly as vLLM publishes them (`vllm/distributed/kv_events.py`, 0.32).

The simulated block pool records these as it caches, evicts and clears blocks; a publisher
(ZMQ, as vLLM's `--kv-events-config`) or the virtual-time cluster delivers them in batches of one
engine step. The classes are msgspec structs with vLLM's names, field order and options, so
`msgspec.msgpack.encode(EventBatch(...))` is byte-compatible with a real server's payload:
the batch is an array `[ts, events, data_parallel_rank]`, each event a map tagged by `"type"`,
fields left at their default omitted.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
FULL_ATTENTION = "full_attention"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged union (`"type": "<class name>"` on the wire)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache. Hashes are unsigned 64-bit ints (vLLM's default
    `ExternalBlockHash`); `token_ids` holds `block_size` ids per block; `parent_block_hash` is the
    hash of the block before the first one, None at the start of a sequence."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # one per block: LoRA name, cache_salt, ...
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted (only their hashes: a consumer maps them to what it stored)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset (`/reset_prefix_cache`)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of one published message (the third frame)."""
    return _encoder.encode(batch)
