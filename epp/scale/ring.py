"""A single-producer, many-reader ring of records in shared memory: the prefix picks.

Why a ring and not a pipe per worker: the writer never waits and never makes a system call (a
slow reader cannot hold up a pick), a reader drains everything new in one pass right before its
own pick (a pipe is read only when the reader's event loop gets to it, so a pick could miss the
other worker's pick of a moment ago), and adding a reader costs nothing. A reader that falls more
than a ring behind loses the records it missed — the approximate index forgets a few picks, which
it is built to survive — and counts them.

Layout (a region of the pod's segment): an 8-byte head (bytes ever written) and `size` bytes of records; a record is its length
(4 bytes), an xxh32 of the payload (4 bytes) and the payload; a record that would not fit before
the end is preceded by a wrap marker. The checksum makes a record overwritten while it was being
read (the writer lapped the reader) fail, whatever the processor's store order.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import xxhash

_HEAD = 8
_RECORD = struct.Struct("<II")  # length, xxh32
_WRAP = 0xFFFFFFFF


class Ring:
    """The ring in `buf` at `offset` (8-byte aligned), `size` bytes of records after its head."""

    def __init__(self, buf: memoryview, size: int, offset: int = 0) -> None:
        self.size = size
        self._head = buf[offset:offset + _HEAD].cast("q")
        self._data = buf[offset + _HEAD:offset + _HEAD + size]

    @staticmethod
    def footprint(size: int) -> int:
        return _HEAD + size + (-(_HEAD + size) % 64)

    def release(self) -> None:
        self._head.release()
        self._data.release()

    @property
    def head(self) -> int:
        return self._head[0]

    def append(self, payload: bytes) -> None:
        """Write one record (payloads larger than a quarter of the ring are dropped)."""
        need = _RECORD.size + len(payload)
        if need > self.size // 4:
            return
        head = self._head[0]
        at = head % self.size
        if at + need > self.size:  # no room before the end: mark the wrap, start over at 0
            if at + 4 <= self.size:
                struct.pack_into("<I", self._data, at, _WRAP)
            head += self.size - at
            at = 0
        _RECORD.pack_into(self._data, at, len(payload), xxhash.xxh32_intdigest(payload))
        self._data[at + _RECORD.size:at + need] = payload
        self._head[0] = head + need  # published last: readers never look past it


class RingReader:
    """One reader's cursor on one ring; `lost` counts the times it was lapped (records lost)."""

    def __init__(self, ring: Ring, *, from_start: bool = False) -> None:
        self.ring = ring
        self.cursor = 0 if from_start else ring.head
        self.lost = 0

    def pending(self) -> bool:
        return self.ring.head != self.cursor

    def read(self) -> Iterator[bytes]:
        ring = self.ring
        size = ring.size
        data = ring._data
        head = ring.head
        if head - self.cursor > size:
            self.lost += 1
            self.cursor = head
            return
        while self.cursor < head:
            at = self.cursor % size
            if at + 4 > size or struct.unpack_from("<I", data, at)[0] == _WRAP:
                self.cursor += size - at
                continue
            length, digest = _RECORD.unpack_from(data, at)
            end = at + _RECORD.size + length
            if end > size:  # torn or garbage: resynchronise at the head
                self.lost += 1
                self.cursor = ring.head
                return
            payload = bytes(data[at + _RECORD.size:end])
            if ring.head - self.cursor > size or xxhash.xxh32_intdigest(payload) != digest:
                self.lost += 1
                self.cursor = ring.head
                return
            self.cursor += _RECORD.size + length
            yield payload
