"""The pod's shared table: per endpoint, one row of sums per writer; readers add the rows up.

Writers ("members") are the request-path workers, the flow-control dispatcher and the replica
link (what the other EPP replicas reported). Each writes only its own rows — its own exact
in-flight counts and ledger sums (`FIELDS`) — so nothing is ever locked on the request path: a
row is one `epp.shm.SlotArray` slot (a seqlock with a checksum), so a reader always gets a whole
row, and its version tells readers which rows moved since they last looked.

Endpoints are named by address in a slot table every member shares; a member marks the slots it
uses, and a slot whose marks are all clear may be given to another address (pods come and go).
Taking or giving back a slot is the one operation under a lock (a POSIX record lock on the
segment's file). A member that dies is cleared by the supervisor (`clear_member`): its rows go to
zero, so the in-flight counts it held leave every reader's view at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

from epp.shm import Int64Array, SlotArray, align

FIELDS = (
    "inflight_requests", "inflight_tokens",  # the director's exact in-flight counts
    "prefill_backlog", "prefill_pairs", "decoding", "context_tokens", "footprint_tokens", "requests",
    "pending",  # requests whose prefill is not over (the ledger's queue length)
    "decode_output",  # Σ expected output of the decoding ones (how soon they end)
    "decode_ending",  # Σ ENDING_UNIT // expected output of the decoding ones (their pace of ending)
    "pick_rate", "work_rate", "prefill_rate", "kv_rate",  # exponential averages as of `rates_at`
    "rates_at",  # (monotonic clock)
    "step_scale", "prefill_scale", "observations",  # the writer's own fit of the pod's service model
    "rates_age",  # seconds of history behind the writer's rates (readers correct them for it)
)
F = len(FIELDS)
(INFLIGHT, TOKENS, BACKLOG, PAIRS, DECODING, CONTEXT, FOOTPRINT, REQUESTS, PENDING, DECODE_OUTPUT, DECODE_ENDING,
 PICK_RATE, WORK_RATE, PREFILL_RATE, KV_RATE, RATES_AT, STEP_SCALE, PREFILL_SCALE, OBSERVATIONS, RATES_AGE) = range(F)
ZEROS = (0.0,) * F
_ROW = struct.Struct(f"={F}d")

MAX_ADDRESS_BYTES = 120
# Member status words (integers; the heartbeat in milliseconds of the wall clock; PICKS: requests
# the member scheduled or handed to the dispatcher, for the pod's per-member metric).
PID, HEARTBEAT_MS, STARTED, SYNCED, METRICS_PORT, ADMIN_PORT, GENERATION, SEQUENCE, PICKS = range(9)
_STATUS_WORDS = 9
POD_READY = 0  # the one pod-wide word, before the members' status


class SharedTable:
    """The table in `buf` (a segment's buffer) at `offset`; `lock_path` is the segment's file."""

    def __init__(self, buf: memoryview, capacity: int, members: int, *, offset: int = 0,
                 lock_path: Path | None = None) -> None:
        self.capacity = capacity
        self.members = members
        self.lock_path = lock_path
        o = offset
        self._status = Int64Array(buf, 1 + members * _STATUS_WORDS, o)
        o += Int64Array.size(1 + members * _STATUS_WORDS)
        self._names = SlotArray(buf, capacity, MAX_ADDRESS_BYTES, o)
        o += SlotArray.size(capacity, MAX_ADDRESS_BYTES)
        self._marks = Int64Array(buf, members * capacity, o)
        o += Int64Array.size(members * capacity)
        self._rows = SlotArray(buf, members * capacity, _ROW.size, o)
        self._s = self._status.values
        self._m = self._marks.values
        self._names_cache: dict[int, tuple[int, str]] = {}  # slot -> (version, address)

    @staticmethod
    def size(capacity: int, members: int) -> int:
        return (Int64Array.size(1 + members * _STATUS_WORDS) + SlotArray.size(capacity, MAX_ADDRESS_BYTES)
                + Int64Array.size(members * capacity) + align(SlotArray.size(members * capacity, _ROW.size)))

    def release(self) -> None:
        for array in (self._status, self._names, self._marks, self._rows):
            array.release()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self.lock_path is None:  # one process (tests): nothing to exclude
            yield
            return
        fd = os.open(self.lock_path, os.O_RDWR)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)  # a record lock: independent of the owner's flock
            yield
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN)
            os.close(fd)

    # -- slots (under the lock) --

    def claim(self, member: int, address: str) -> int:
        """The slot of `address` (taking a free one if no member uses it yet), marked as used by
        `member`. Raises ValueError when the table is full or the address too long."""
        raw = address.encode()
        if len(raw) > MAX_ADDRESS_BYTES:
            raise ValueError(f"endpoint address longer than {MAX_ADDRESS_BYTES} bytes")
        with self._locked():
            free = -1
            for slot in range(self.capacity):
                named = self._names.read(slot)
                if named is not None and named[1] == raw:
                    self._m[member * self.capacity + slot] = 1
                    return slot
                if free < 0 and (named is None or not self._used(slot)):
                    free = slot
            if free < 0:
                raise ValueError(f"the shared endpoint table is full ({self.capacity} endpoints)")
            for m in range(self.members):
                self._zero(m, free)
            self._names.write(free, raw)
            self._m[member * self.capacity + free] = 1
            return free

    def give_back(self, member: int, slot: int) -> None:
        """`member` no longer uses `slot`: its row goes to zero and its mark is cleared."""
        with self._locked():
            self._zero(member, slot)
            self._m[member * self.capacity + slot] = 0

    def address(self, slot: int) -> str:
        version = self._names.version(slot)
        cached = self._names_cache.get(slot)
        if cached is not None and cached[0] == version:
            return cached[1]
        named = self._names.read(slot)
        address = named[1].decode() if named is not None else ""
        self._names_cache[slot] = (named[0] if named is not None else 0, address)
        return address

    def slots(self) -> dict[str, int]:
        """Every named slot some member uses: address -> slot."""
        return {self.address(slot): slot for slot in range(self.capacity)
                if self._names.version(slot) and self._used(slot)}

    def clear_member(self, member: int) -> None:
        """A member died (or restarts): every row it wrote goes to zero, every mark it held clears."""
        with self._locked():
            base = member * self.capacity
            for slot in range(self.capacity):
                if self._m[base + slot]:
                    self._zero(member, slot)
                    self._m[base + slot] = 0
            self._s[1 + member * _STATUS_WORDS + GENERATION] += 1

    def marked(self, member: int, slot: int) -> bool:
        """Whether `member` uses `slot`."""
        return bool(self._m[member * self.capacity + slot])

    def _used(self, slot: int) -> bool:
        marks, cap = self._m, self.capacity
        return any(marks[m * cap + slot] for m in range(self.members))

    def _zero(self, member: int, slot: int) -> None:
        """Under the lock, possibly for another member: the row's version moves, the member's
        sequence (its own writes' counter) is left to it; `clear_member` bumps the generation."""
        index = member * self.capacity + slot
        if self._rows.version(index):
            self._rows.write(index, _ROW.pack(*ZEROS))

    # -- rows (lock-free: one writer per row) --

    def write(self, member: int, slot: int, values: Sequence[float]) -> None:
        self._rows.write(member * self.capacity + slot, _ROW.pack(*values))
        self._s[1 + member * _STATUS_WORDS + SEQUENCE] += 1

    def read(self, member: int, slot: int) -> tuple[float, ...]:
        got = self._rows.read(member * self.capacity + slot)
        return _ROW.unpack(got[1]) if got is not None else ZEROS

    def version(self, member: int, slot: int) -> int:
        return self._rows.version(member * self.capacity + slot)

    def sequence(self, member: int) -> tuple[int, int]:
        """Moves with every write of `member` and every clearing of it: a reader skips a member
        whose sequence did not move."""
        base = 1 + member * _STATUS_WORDS
        return self._s[base + SEQUENCE], self._s[base + GENERATION]

    # -- member status and the pod's readiness --

    def status(self, member: int, word: int) -> int:
        return self._s[1 + member * _STATUS_WORDS + word]

    def set_status(self, member: int, word: int, value: int) -> None:
        self._s[1 + member * _STATUS_WORDS + word] = int(value)

    @property
    def pod_ready(self) -> bool:
        return bool(self._s[POD_READY])

    @pod_ready.setter
    def pod_ready(self, ready: bool) -> None:
        self._s[POD_READY] = int(ready)
