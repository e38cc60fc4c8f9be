"""`epp.shm`: slots and counters shared between real processes (spawned, as the EPP starts them)."""

from __future__ import annotations

import multiprocessing
import struct

import pytest

from epp.shm import Int64Array, Segment, SlotArray, align

_CTX = multiprocessing.get_context("spawn")


def _layout(segment: Segment, count: int = 4, capacity: int = 256) -> tuple[SlotArray, Int64Array]:
    slots = SlotArray(segment.buf, count, capacity)
    counters = Int64Array(segment.buf, count, offset=SlotArray.size(count, capacity))
    return slots, counters


def _segment_size(count: int = 4, capacity: int = 256) -> int:
    return SlotArray.size(count, capacity) + Int64Array.size(count)


def test_write_read_versions() -> None:
    segment = Segment.create(_segment_size())
    slots, counters = _layout(segment)
    try:
        assert slots.read(0) is None and slots.versions() == [0, 0, 0, 0]
        v1 = slots.write(1, b"hello")
        assert v1 > 0 and v1 % 2 == 0
        assert slots.read(1) == (v1, b"hello")
        v2 = slots.write(1, b"")
        assert v2 > v1 and slots.read(1) == (v2, b"")
        assert slots.versions() == [0, v2, 0, 0]
        with pytest.raises(ValueError, match="capacity"):
            slots.write(0, b"x" * 257)
        counters.add(2, 5)
        counters.add(2, -2)
        assert counters.tolist() == [0, 0, 3, 0] and counters.sum_of([1, 2]) == 3
    finally:
        slots.release()
        counters.release()
        segment.close()


def test_layout_is_cache_line_aligned_and_checked() -> None:
    assert align(1) == 64 and align(64) == 64 and SlotArray.size(3, 10) % 64 == 0
    segment = Segment.create(128)
    try:
        with pytest.raises(ValueError, match="too small"):
            SlotArray(segment.buf, 4, 256)
        with pytest.raises(ValueError, match="aligned"):
            Int64Array(segment.buf, 2, offset=4)
    finally:
        segment.close()


def _child_reads_and_writes(name: str, out: multiprocessing.connection.Connection) -> None:
    segment = Segment.attach(name)
    slots, counters = _layout(segment)
    out.send(slots.read(0))
    slots.write(3, b"from the child")
    counters.values[3] = 42
    slots.release()
    counters.release()
    segment.close()
    out.close()


def test_another_process_reads_and_writes_and_does_not_remove_the_segment() -> None:
    segment = Segment.create(_segment_size())
    slots, counters = _layout(segment)
    try:
        version = slots.write(0, b"from the parent")
        parent_end, child_end = _CTX.Pipe()
        child = _CTX.Process(target=_child_reads_and_writes, args=(segment.name, child_end))
        child.start()
        assert parent_end.recv() == (version, b"from the parent")
        child.join(30)
        assert child.exitcode == 0
        # the child's exit (and its resource tracker) left the segment in place
        again = Segment.attach(segment.name)
        again.close()
        assert slots.read(3) is not None and slots.read(3)[1] == b"from the child"
        assert counters.values[3] == 42
    finally:
        slots.release()
        counters.release()
        segment.close()
    with pytest.raises(FileNotFoundError):
        Segment.attach(segment.name)


_RECORD = struct.Struct("=Q")


def _payload(n: int) -> bytes:
    """Self-checking: the same counter repeated, a length that varies with it."""
    return _RECORD.pack(n) * (1 + n % 31)


def _writer(name: str, rounds: int) -> None:
    segment = Segment.attach(name)
    slots = SlotArray(segment.buf, 1, 256)
    for n in range(1, rounds + 1):
        slots.write(0, _payload(n))
    slots.release()
    segment.close()


def test_readers_never_see_a_torn_payload_while_another_process_writes() -> None:
    segment = Segment.create(SlotArray.size(1, 256))
    slots = SlotArray(segment.buf, 1, 256)
    rounds = 200_000
    writer = _CTX.Process(target=_writer, args=(segment.name, rounds))
    try:
        writer.start()
        seen: list[int] = []
        last = 0
        while writer.is_alive() or not seen:
            got = slots.read(0)
            if got is None:
                continue
            version, payload = got
            n = _RECORD.unpack_from(payload)[0]
            assert payload == _payload(n), "a torn payload was returned"
            assert version >= last  # versions only grow
            last = version
            seen.append(n)
        writer.join(60)
        assert writer.exitcode == 0
        final = slots.read(0)
        assert final is not None and final[1] == _payload(rounds)
        assert len(set(seen)) > 1  # the reader did run while the writer wrote
    finally:
        if writer.is_alive():
            writer.kill()
        slots.release()
        segment.close()


def test_a_restarted_writer_continues_the_versions() -> None:
    segment = Segment.create(SlotArray.size(1, 64))
    first = SlotArray(segment.buf, 1, 64)
    try:
        v = first.write(0, b"a")
        second = SlotArray(segment.buf, 1, 64)  # a new writer, e.g. a restarted process
        v2 = second.write(0, b"b")
        assert v2 > v and first.read(0) == (v2, b"b")
        second.release()
    finally:
        first.release()
        segment.close()


def _create_and_die(out: multiprocessing.connection.Connection) -> None:
    segment = Segment.create(64, prefix="epp-test-orphan")
    out.send(segment.name)
    out.close()
    import os

    os._exit(0)  # killed in effect: close() never runs


def test_a_killed_owners_segment_is_removed_by_the_next_owner_but_a_live_ones_is_not() -> None:
    live = Segment.create(64, prefix="epp-test-orphan")
    parent_end, child_end = _CTX.Pipe()
    child = _CTX.Process(target=_create_and_die, args=(child_end,))
    child.start()
    orphan = parent_end.recv()
    child.join(30)
    try:
        Segment.attach(orphan).close()  # left behind
        Segment.create(64, prefix="epp-test-orphan").close()
        with pytest.raises(FileNotFoundError):
            Segment.attach(orphan)
        Segment.attach(live.name).close()  # its owner holds the lock: kept
    finally:
        live.close()
