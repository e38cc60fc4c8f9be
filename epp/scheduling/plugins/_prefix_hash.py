"""Chained xxhash64 over fixed-size blocks of the prompt: the approximate prefix-cache keys.

Compatible with the reference (`approx-prefix-cache-producer` at [M]):
- seed = xxhash64(target model + cache_salt), so different models or salts never share keys;
- block i = xxhash64(block bytes ‖ previous hash as 8 little-endian bytes), block 0 chains from
  the seed, so a block's key encodes everything before it (a prefix, not a bag of blocks);
- input shorter than one block has no keys; input longer than `max_blocks` blocks is truncated;
- the trailing partial block is hashed too.

Cost: one C call per block (never a Python loop over characters); with the default cap of 256
blocks a request costs at most 257 xxhash calls.
"""

from __future__ import annotations

import struct

import xxhash

_xxh64 = xxhash.xxh64_intdigest  # module attribute, so tests can count calls
_pack_u64 = struct.Struct("<Q").pack


def seed_hash(target_model: str, cache_salt: str = "") -> int:
    seed: int = _xxh64((target_model + cache_salt).encode())
    return seed


def block_hashes(prompt: bytes, target_model: str, cache_salt: str, block_chars: int, max_blocks: int) -> list[int]:
    """Keys of the prompt's blocks, in order; at most `max_blocks` of them."""
    size = len(prompt)
    if block_chars <= 0 or max_blocks <= 0 or size < block_chars:
        return []
    end = min(size, block_chars * max_blocks)
    h = _xxh64
    pack = _pack_u64
    join = b"".join
    view = memoryview(prompt)
    prev: int = h((target_model + cache_salt).encode())
    out: list[int] = []
    append = out.append
    for start in range(0, end, block_chars):
        prev = h(join((view[start : start + block_chars], pack(prev))))
        append(prev)
    return out
