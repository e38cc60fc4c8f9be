"""The approximate prefix index kept consistent across writers: every add is broadcast.

`SharedPrefixIndex` is the producer's `PrefixIndex` plus one thing: what this process records
(a pick's blocks on its endpoint, a finished request's blocks touched again) is also appended to
its ring. `PrefixSync` drains the other writers' rings into the local index through the base
methods (so nothing is broadcast twice); the director's `refresh` runs it right before each pick,
so a pick sees the others' picks up to that moment. Every writer applies the same adds with the
capacity the writer computed, so the indexes agree up to the order of concurrent picks.

A record: kind (add/touch), capacity and extra blocks, the index's name (the producer's: several
producers keep several indexes), the endpoint's address, the block keys.
The same records travel between replicas (`epp.scale.replicas`).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from epp.scale.ring import Ring, RingReader
from epp.scheduling.plugins._prefix_index import PrefixIndex

ADD, TOUCH = 1, 2
_HEADER = struct.Struct("<BIIHH")  # kind, capacity, extra blocks, index name length, address length


@dataclass(slots=True, frozen=True)
class PrefixRecord:
    kind: int
    index: str
    address: str
    hashes: Sequence[int]
    capacity: int = 0
    extra: int = 0


def encode(record: PrefixRecord) -> bytes:
    name, address = record.index.encode(), record.address.encode()
    return (_HEADER.pack(record.kind, max(0, min(record.capacity, 0xFFFFFFFF)), max(0, min(record.extra, 0xFFFFFFFF)),
                         len(name), len(address))
            + name + address + array("Q", record.hashes).tobytes())


def decode(payload: bytes) -> PrefixRecord:
    kind, capacity, extra, name_length, length = _HEADER.unpack_from(payload)
    if (len(payload) - _HEADER.size - name_length - length) % 8:
        raise ValueError("a prefix record's block keys are not whole 8-byte words")
    start = _HEADER.size
    name = payload[start:start + name_length].decode()
    start += name_length
    address = payload[start:start + length].decode()
    hashes = array("Q")
    hashes.frombytes(payload[start + length:])
    return PrefixRecord(kind, name, address, hashes.tolist(), capacity, extra)


class SharedPrefixIndex(PrefixIndex):
    """A `PrefixIndex` whose own adds and touches are also sent to `sink` (the ring's append),
    named after its producer."""

    __slots__ = ("name", "sink")

    def __init__(self, name: str, sink: Callable[[bytes], None]) -> None:
        super().__init__()
        self.name = name
        self.sink = sink

    def add(self, hashes: Sequence[int], server: str, capacity: int, extra_blocks: int = 0) -> None:
        super().add(hashes, server, capacity, extra_blocks)
        if hashes:
            self.sink(encode(PrefixRecord(ADD, self.name, server, hashes, capacity, extra_blocks)))

    def touch(self, hashes: Sequence[int], server: str) -> None:
        super().touch(hashes, server)
        if hashes:
            self.sink(encode(PrefixRecord(TOUCH, self.name, server, hashes)))

    def apply(self, record: PrefixRecord, known: Callable[[str], bool]) -> None:
        """Another writer's record, applied here only (not broadcast again). Endpoints this
        process does not know (yet, or any more) are skipped: the index describes live pods."""
        if not known(record.address):
            return
        if record.kind == ADD:
            PrefixIndex.add(self, record.hashes, record.address, record.capacity, record.extra)
        elif record.kind == TOUCH:
            PrefixIndex.touch(self, record.hashes, record.address)


class PrefixSync:
    """Drains the other writers' rings into this process's shared indexes."""

    def __init__(self, indexes: Iterable[SharedPrefixIndex], rings: Iterable[Ring],
                 known: Callable[[str], bool]) -> None:
        self.indexes = {index.name: index for index in indexes}
        self.readers = [RingReader(ring) for ring in rings]
        self.known = known
        self.applied = 0
        self.malformed = 0  # records that did not decode (a replica of another version, say): skipped

    @property
    def lost(self) -> int:
        return sum(reader.lost for reader in self.readers)

    def drain(self) -> None:
        for reader in self.readers:
            if not reader.pending():
                continue
            for payload in reader.read():
                try:
                    record = decode(payload)
                except (struct.error, UnicodeDecodeError, ValueError):
                    self.malformed += 1
                    continue
                index = self.indexes.get(record.index)
                if index is not None:
                    index.apply(record, self.known)
                    self.applied += 1
