"""Shared memory between the EPP's processes: one writer per slot, any number of readers, no locks.

Below every layer (it imports nothing of ours), so the data layer, the request-path workers and
anything else can share state through it:

- `Segment`: a named block of shared memory. One process creates it (and removes it when it
  closes); the others attach by name.
- `SlotArray`: `count` slots of up to `capacity` bytes in a segment. A slot holds one opaque
  payload (the caller's encoding); `write` replaces it whole, `read` returns a consistent copy of
  the last payload written, and `versions` reads every slot's version at once, so a reader finds
  what changed since its last look with one C call and one list comparison.
- `Int64Array`: aligned 64-bit integers (counters, one writer per element; readers add them up).

Why it is safe without locks. Each slot has a sequence number (a seqlock): the writer makes it odd,
writes the payload, then makes it even; a reader copies the payload between two reads of the
sequence and keeps the copy only if both reads are equal and even. The payload also carries a
CRC-32 that the reader checks, so the protocol does not depend on the CPU keeping the writer's
stores in order: on x86-64 stores are seen in program order anyway, on Arm they may not be, and
a payload seen half-written fails the checksum (and is read again) rather than being believed.
Sequence numbers and counters are aligned 8-byte words, which both architectures read and write
in one access (never torn). There is exactly one writer per slot (or element): the caller
guarantees it, e.g. one scraper process writes every metrics slot, each worker its own row.

Layout of a `SlotArray` at `offset`: `count` sequence words (uint64), then per slot a header
(payload length uint32, CRC-32 uint32) and `capacity` bytes. Sizes round up to 64 bytes (a
cache line) so arrays can be packed one after another in a segment (`SlotArray.size`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Int64Array", "Segment", "SlotArray", "align"]

_LINE = 64
_SLOT_HEADER = struct.Struct("=II")  # payload length, CRC-32 (native sizes, standard alignment)
_READ_ATTEMPTS = 64  # a writer holds a slot for about a microsecond; give up after this many tries


def align(size: int) -> int:
    """`size` rounded up to a cache line: where the next array in a segment may start."""
    return (size + _LINE - 1) // _LINE * _LINE


class Segment:
    """A named shared-memory block: a file in /dev/shm (memory, on Linux) mapped by every process
    that uses it. The creating process owns it and removes it on `close`; attached processes only
    unmap it. Views handed out by the arrays must be released (their `release`) before `close`.

    Why not `multiprocessing.shared_memory`: before Python 3.13 its resource tracker registers
    every attachment and removes the segment when *any* attached process exits, and processes
    that share one tracker cannot tell it who owns what. A plain mapped file has no such
    bookkeeping. The owner holds an exclusive `flock` on the file while it lives, so a segment
    left behind by an owner that was killed is recognised (nobody holds its lock) and removed by
    the next owner that starts with the same prefix."""

    def __init__(self, path: Path, fd: int, owner: bool) -> None:
        self.path = path
        self.owner = owner
        self.name = path.name
        self.size = os.fstat(fd).st_size
        self._mmap = mmap.mmap(fd, self.size)
        self._fd = fd if owner else -1  # the owner keeps its file (and lock) open
        if not owner:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    @classmethod
    def create(cls, size: int, prefix: str = "epp") -> Segment:
        """A new zero-filled segment of at least `size` bytes with a fresh name. Pages are
        allocated when first written, so capacity never written costs no memory."""
        if size <= 0:
            raise ValueError("size must be > 0")
        directory = _directory()
        _remove_orphans(directory, prefix)
        name = f"{prefix}-{os.getpid()}-{os.urandom(6).hex()}"
        staging = directory / f".{name}"  # locked before it gets a name others look at
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, size)
            os.rename(staging, directory / name)
            return cls(directory / name, fd, owner=True)
        except BaseException:
            os.close(fd)
            staging.unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Attach to a segment another process created (FileNotFoundError once it is gone)."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"invalid segment name {name!r}")
        path = _directory() / name
        return cls(path, os.open(path, os.O_RDWR), owner=False)

    def close(self) -> None:
        """Unmap; the owner also removes the name (attached processes keep their mapping)."""
        self.buf.release()
        self._mmap.close()
        if self.owner:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


def _directory() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _remove_orphans(directory: Path, prefix: str) -> None:
    """Segments named `prefix-*` that no owner holds locked (their owner was killed)."""
    for path in directory.glob(f"{prefix}-*"):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # its owner is alive
        else:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)


class SlotArray:
    """`count` slots of at most `capacity` payload bytes; one writer per slot, lock-free readers."""

    def __init__(self, buf: memoryview, count: int, capacity: int, offset: int = 0) -> None:
        if count <= 0 or capacity <= 0:
            raise ValueError("count and capacity must be > 0")
        if offset % 8:
            raise ValueError("offset must be 8-byte aligned")
        end = offset + self.size(count, capacity)
        if end > len(buf):
            raise ValueError(f"segment too small: {len(buf)} bytes, the slots need {end}")
        self.count = count
        self.capacity = capacity
        self._view = buf[offset:end]
        self._seq = self._view[:count * 8].cast("Q")
        self._base = align(count * 8)
        self._stride = align(_SLOT_HEADER.size + capacity)
        self._written = [0] * count  # writer side: the sequence each slot was left at

    @staticmethod
    def size(count: int, capacity: int) -> int:
        """Bytes the array occupies (a multiple of 64)."""
        return align(count * 8) + count * align(_SLOT_HEADER.size + capacity)

    def write(self, index: int, payload: bytes) -> int:
        """Replace slot `index`'s payload; returns its new (even) version. Only one process may
        write a given slot. Raises ValueError when the payload exceeds the capacity."""
        if len(payload) > self.capacity:
            raise ValueError(f"payload of {len(payload)} bytes exceeds the slot capacity {self.capacity}")
        seq = self._written[index]
        if seq != self._seq[index]:  # a restarted writer: carry on after what the slot holds
            seq = (self._seq[index] | 1) + 1
        self._seq[index] = seq + 1  # odd: being written
        start = self._base + index * self._stride
        _SLOT_HEADER.pack_into(self._view, start, len(payload), zlib.crc32(payload))
        body = start + _SLOT_HEADER.size
        self._view[body:body + len(payload)] = payload
        self._seq[index] = seq + 2
        self._written[index] = seq + 2
        return seq + 2

    def read(self, index: int) -> tuple[int, bytes] | None:
        """(version, payload) as last written, or None if the slot was never written or stayed
        unreadable (its writer died mid-write, or kept rewriting it) for every attempt."""
        seq = self._seq
        view = self._view
        start = self._base + index * self._stride
        body = start + _SLOT_HEADER.size
        for _ in range(_READ_ATTEMPTS):
            before = seq[index]
            if before == 0:
                return None
            if before & 1:
                continue
            length, crc = _SLOT_HEADER.unpack_from(view, start)
            if length > self.capacity:
                continue
            payload = bytes(view[body:body + length])
            if seq[index] == before and zlib.crc32(payload) == crc:
                return before, payload
        return None

    def version(self, index: int) -> int:
        """Slot `index`'s version: 0 never written, odd being written, else even and growing."""
        return self._seq[index]

    def versions(self, upto: int | None = None) -> list[int]:
        """The versions of slots [0, upto) (all by default), read in one call."""
        if upto is None or upto >= self.count:
            return self._seq.tolist()
        with self._seq[:upto] as head:
            return head.tolist()

    def release(self) -> None:
        """Drop the views into the segment (before the segment is closed)."""
        self._seq.release()
        self._view.release()


class Int64Array:
    """`count` signed 64-bit integers at `offset`; aligned, so each read and write is one access.
    One writer per element (read-modify-write is not atomic across processes)."""

    def __init__(self, buf: memoryview, count: int, offset: int = 0) -> None:
        if count <= 0:
            raise ValueError("count must be > 0")
        if offset % 8:
            raise ValueError("offset must be 8-byte aligned")
        end = offset + count * 8
        if end > len(buf):
            raise ValueError(f"segment too small: {len(buf)} bytes, the array needs {end}")
        self.count = count
        self._view = buf[offset:end]
        self.values = self._view.cast("q")  # index it directly: values[i], values[i] = n

    @staticmethod
    def size(count: int) -> int:
        return align(count * 8)

    def add(self, index: int, delta: int) -> None:
        """values[index] += delta; only the element's single writer may call it."""
        self.values[index] += delta

    def sum_of(self, indices: Sequence[int]) -> int:
        values = self.values
        return sum(values[i] for i in indices)

    def tolist(self) -> list[int]:
        return self.values.tolist()

    def release(self) -> None:
        self.values.release()
        self._view.release()
