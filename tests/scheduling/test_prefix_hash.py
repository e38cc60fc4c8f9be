"""Prefix block keys: the reference's chained xxhash64, computed one C call per block."""

from __future__ import annotations

import xxhash

from epp.scheduling.plugins import _prefix_hash
from epp.scheduling.plugins._prefix_hash import block_hashes, seed_hash


def spec_hashes(prompt: bytes, model: str, salt: str, block: int, max_blocks: int) -> list[int]:
    """The algorithm written out plainly (streaming digests), to check the fast path against."""
    if len(prompt) < block:
        return []
    seed = xxhash.xxh64()
    seed.update(model.encode())
    seed.update(salt.encode())
    prev = seed.intdigest()
    out = []
    for start in range(0, min(len(prompt), block * max_blocks), block):
        d = xxhash.xxh64()
        d.update(prompt[start : start + block])
        d.update(prev.to_bytes(8, "little"))
        prev = d.intdigest()
        out.append(prev)
    return out


def test_matches_the_written_out_algorithm_including_partial_block() -> None:
    prompt = bytes(range(256)) * 3 + b"tail"  # 772 bytes: 12 full blocks of 64 + a partial one
    got = block_hashes(prompt, "llama", "salt", 64, 256)
    assert len(got) == 13
    assert got == spec_hashes(prompt, "llama", "salt", 64, 256)


def test_seed_is_model_plus_salt() -> None:
    assert seed_hash("m", "s") == xxhash.xxh64_intdigest(b"ms")
    assert seed_hash("m") == xxhash.xxh64_intdigest(b"m")


def test_shorter_than_one_block_has_no_keys() -> None:
    assert block_hashes(b"x" * 63, "m", "", 64, 256) == []
    assert len(block_hashes(b"x" * 64, "m", "", 64, 256)) == 1


def test_partial_trailing_block_is_hashed() -> None:
    full = block_hashes(b"a" * 128, "m", "", 64, 256)
    longer = block_hashes(b"a" * 128 + b"b" * 10, "m", "", 64, 256)
    assert len(longer) == 3 and longer[:2] == full


def test_truncated_at_max_blocks() -> None:
    keys = block_hashes(b"q" * 64 * 10 + b"extra", "m", "", 64, 4)
    assert keys == block_hashes(b"q" * 64 * 4, "m", "", 64, 4)


def test_model_and_salt_change_every_key() -> None:
    prompt = b"p" * 200
    base = block_hashes(prompt, "model-a", "", 64, 256)
    other_model = block_hashes(prompt, "model-b", "", 64, 256)
    salted = block_hashes(prompt, "model-a", "tenant-1", 64, 256)
    assert not set(base) & set(other_model)
    assert not set(base) & set(salted)


def test_keys_are_chained_so_position_matters() -> None:
    a = block_hashes(b"A" * 64 + b"B" * 64, "m", "", 64, 256)
    b = block_hashes(b"C" * 64 + b"B" * 64, "m", "", 64, 256)
    assert a[1] != b[1]  # same block bytes, different prefix


def test_a_100k_token_prompt_costs_one_xxhash_call_per_block(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls = 0
    real = xxhash.xxh64_intdigest

    def counting(data: bytes) -> int:
        nonlocal calls
        calls += 1
        return real(data)

    monkeypatch.setattr(_prefix_hash, "_xxh64", counting)
    prompt = b"0123456789abcdef" * 25_000  # 400k bytes = 100k tokens at 4 chars/token
    keys = block_hashes(prompt, "m", "", 64, 1_000_000)
    assert len(keys) == 6250
    assert calls == len(keys) + 1  # one per block plus the seed; nothing per byte
