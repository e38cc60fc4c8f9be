"""Decoding real vLLM 0.32 KV-event captures, leniently."""

from __future__ import annotations

import msgspec
import pytest

from epp.datalayer.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, StreamState,
                                     decode_payload, decode_seq, parse_topic)
from tests.precise.helpers import decoded, frames


def test_every_captured_batch_decodes_like_the_generic_decoding() -> None:
    expected = decoded()
    got = frames()
    assert len(got) == len(expected) == 15
    for (topic, seq, payload), want in zip(got, expected):
        assert topic.decode() == want["topic"]
        assert decode_seq(seq) == want["seq"]
        batch, skipped = decode_payload(payload)
        assert skipped == 0
        assert batch.ts == want["payload"]["ts"]
        assert batch.data_parallel_rank == want["payload"]["data_parallel_rank"]
        assert [type(e).__name__ for e in batch.events] == [e["type"] for e in want["payload"]["events"]]
        for event, raw in zip(batch.events, want["payload"]["events"]):
            if isinstance(event, (BlockStored, BlockRemoved)):
                assert event.block_hashes == raw["block_hashes"]
                assert event.medium == raw["medium"] == "GPU"
            if isinstance(event, BlockStored):
                assert event.token_ids == raw["token_ids"]
                assert event.parent_block_hash == raw["parent_block_hash"]
                assert event.block_size == 128
                assert event.kv_cache_spec_kind == "full_attention"


def test_hashes_are_unsigned_64_bit() -> None:
    hashes = [h for _, _, p in frames() for e in decode_payload(p)[0].events
              if isinstance(e, BlockStored) for h in e.block_hashes]
    assert max(hashes) >= 2**63 and min(hashes) >= 0


def test_first_block_has_no_parent_and_the_second_request_chains_on_the_first() -> None:
    first = decode_payload(frames()[0][2])[0].events[0]
    second = decode_payload(frames()[1][2])[0].events[0]
    assert first.parent_block_hash is None and len(first.token_ids) == 3 * 128
    assert second.parent_block_hash == first.block_hashes[1]


def test_the_last_batch_clears() -> None:
    assert isinstance(decode_payload(frames()[14][2])[0].events[0], AllBlocksCleared)


class _Future(msgspec.Struct, tag="BlockPinned"):
    block_hashes: list[int]


class _NewStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = "GPU"
    locality: str | None = "LOCAL"
    ownership: str | None = "x"
    session_id: str | None = "s1"
    some_future_field: int = 7


def test_unknown_fields_are_ignored_and_unknown_event_types_skipped() -> None:
    payload = msgspec.msgpack.encode([1.5, [_NewStored([1], None, [5] * 4, 4), _Future([2])], 0])
    batch, skipped = decode_payload(payload)
    assert skipped == 1
    assert len(batch.events) == 1 and batch.events[0].token_ids == [5] * 4


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode("x")])
def test_garbage_is_a_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_payload(payload)


def test_sequence_frames() -> None:
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1  # vLLM's end-of-replay marker
    with pytest.raises(DecodeError):
        decode_seq(b"\x00" * 4)


def test_topics() -> None:
    topic = parse_topic(b"kv@10.0.0.7:8000@meta-llama/Llama-3.1-8B")
    assert topic is not None and topic.address == "10.0.0.7:8000" and topic.model == "meta-llama/Llama-3.1-8B"
    assert parse_topic(b"kv@[fd00::1]:8000@m").address == "[fd00::1]:8000"  # type: ignore[union-attr]
    for bad in (b"kv-events", b"", b"kv@", b"\xff\xfe", b"kv@" + b"x" * 300):
        assert parse_topic(bad) is None


def test_stream_verdicts() -> None:
    s = StreamState()
    assert s.verdict(0) == "first"
    s.advance(0)
    assert s.verdict(1) == "next"
    assert s.verdict(5) == "gap"
    s.advance(5)
    assert s.verdict(0) == "restart"
