"""Prefix-cache block hashes the way vLLM v1 computes them, from token ids.

vLLM hashes each *full* block of `block_size` token ids chained to its parent's hash, with the
block's extra keys (the LoRA adapter on every block, `cache_salt` on the first block only;
`vllm/v1/core/kv_cache_utils.py`); the first block chains from a fixed `NONE_HASH`, so the same
prompt gives the same hash on every server (seen on 0.32). Hashes are unsigned 64-bit ints, as
vLLM publishes them in KV events. We use xxh3-64 instead of sha256: the values differ from a
real server's, the structure (what shares a hash with what) does not, and one C call per block
keeps a 100,000-request virtual run cheap.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_hash = xxhash.xxh3_64_intdigest

# The parent of a sequence's first block (vLLM derives its NONE_HASH from a fixed seed string).
NONE_HASH = _hash(b"vllm-none-hash")


def extra_keys_seed(parent: int, lora: str | None, cache_salt: str | None, first: bool) -> int:
    """Mix a block's extra keys into its parent hash (the seed its tokens are hashed with)."""
    if not lora and not (first and cache_salt):
        return parent
    key = b"lora:" + lora.encode() if lora else b""
    if first and cache_salt:
        key += b"\x00salt:" + cache_salt.encode()
    return _hash(key, seed=parent)


def hash_blocks(token_ids: Sequence[int] | array, block_size: int, *, lora: str | None = None,
                cache_salt: str | None = None, parent: int | None = None, start_block: int = 0,
                max_blocks: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`, from block `start_block` on.

    `parent` is the hash of block `start_block - 1` (None: the sequence start). The tail that does
    not fill a block is not hashed: vLLM never caches partial blocks."""
    ids = token_ids if isinstance(token_ids, array) and token_ids.typecode == "i" else array("i", token_ids)
    n = len(ids) // block_size
    if max_blocks is not None:
        n = min(n, start_block + max_blocks)
    data = memoryview(ids).cast("B")
    step = block_size * ids.itemsize
    h = NONE_HASH if parent is None else parent
    out: list[int] = []
    for j in range(start_block, n):
        seed = extra_keys_seed(h, lora, cache_salt, j == 0)
        h = _hash(data[j * step:(j + 1) * step], seed=seed)
        out.append(h)
    return out


def hash_block(block_token_ids: array, parent: int | None, *, index: int, lora: str | None = None,
               cache_salt: str | None = None) -> int:
    """The hash of one full block (block `index` of its sequence) chained to `parent`.

    The same value `hash_blocks` gives for that block; for blocks that fill while a request runs
    (its generated tokens), one call per block."""
    h = NONE_HASH if parent is None else parent
    ids = block_token_ids if block_token_ids.typecode == "i" else array("i", block_token_ids)
    return _hash(memoryview(ids).cast("B"), seed=extra_keys_seed(h, lora, cache_salt, index == 0))


def event_extra_keys(lora: str | None, cache_salt: str | None, index: int) -> tuple[str, ...] | None:
    """A block's extra keys as vLLM publishes them in `BlockStored.extra_keys` (untagged): the
    LoRA name on every block, the cache salt after it on the first block, None when neither."""
    if lora and index == 0 and cache_salt:
        return (lora, cache_salt)
    if lora:
        return (lora,)
    if index == 0 and cache_salt:
        return (cache_salt,)
    return None


# Token ids for tokens the simulator has no real ids for: generated tokens, and prompts built from
# bare sizes or counted text. Deterministic, in a range every tokenizer's vocabulary covers; they
# stand in for real ids only in KV events and in the hashes of blocks the engine fills itself.
SYNTHETIC_ID_BASE = 1000
SYNTHETIC_ID_SPAN = 30000


_SYNTHETIC = array("i", range(SYNTHETIC_ID_BASE, SYNTHETIC_ID_BASE + SYNTHETIC_ID_SPAN)) * 2
_SYNTHETIC_BYTES = memoryview(_SYNTHETIC).cast("B")


def synthetic_token_ids(key: int, start: int, count: int) -> array:
    """`count` (<= SYNTHETIC_ID_SPAN) ids for positions `start`.. of the sequence `key` names:
    consecutive, wrapping."""
    first = (key + start) % SYNTHETIC_ID_SPAN
    return _SYNTHETIC[first:first + count]


def synthetic_token_bytes(key: int, start: int, count: int) -> memoryview:
    """The same ids as raw bytes, without a copy (what `hash_block` hashes)."""
    first = (key + start) % SYNTHETIC_ID_SPAN * 4
    return _SYNTHETIC_BYTES[first:first + count * 4]
