"""The pod's shared table: per endpoint, one row of sums per writer; readers add the rows up.

Writers ("members") are the request-path workers, the flow-control dispatcher and the replica
link (what the other EPP replicas reported). Each writes only its own rows — its own exact
in-flight counts and ledger sums (`FIELDS`) — so nothing is ever locked on the request path: a
row is a run of 8-byte words, each stored whole, and a per-row version tells readers which rows
moved since they last looked. A reader may see one row half-way through an update (some fields
new, some old); that is the skew of reading two events apart and is corrected by the next read.

Endpoints are named by address in a slot table every member shares; a member marks the slots it
uses, and a slot whose marks are all clear may be given to another address (pods come and go).
Taking or giving back a slot is the one operation under the file lock. A member that dies is
cleared by the supervisor (`clear_member`): its rows go to zero, so the in-flight counts it held
leave every reader's view at once.

Layout (one file): header | member status | slot names | marks | row versions | rows.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from epp.scale.shm import SharedFile, file_lock

FIELDS = (
    "inflight_requests", "inflight_tokens",  # the director's exact in-flight counts
    "prefill_backlog", "prefill_pairs", "decoding", "context_tokens", "footprint_tokens", "requests",
    "pending",  # requests whose prefill is not over (the ledger's queue length)
    "pick_rate", "work_rate", "rates_at",  # exponential averages as of `rates_at` (monotonic clock)
    "step_scale", "prefill_scale", "observations",  # the writer's own fit of the pod's service model
)
F = len(FIELDS)
(INFLIGHT, TOKENS, BACKLOG, PAIRS, DECODING, CONTEXT, FOOTPRINT, REQUESTS, PENDING, PICK_RATE, WORK_RATE,
 RATES_AT, STEP_SCALE, PREFILL_SCALE, OBSERVATIONS) = range(F)

MAX_ADDRESS_BYTES = 120
_NAME_BYTES = 8 + MAX_ADDRESS_BYTES
_MAGIC = 0x4550505F5441424C  # "EPP_TABL"
_STATUS_WORDS = 8
# Member status words.
PID, HEARTBEAT, STARTED, SYNCED, METRICS_PORT, ADMIN_PORT, GENERATION, SEQUENCE = range(_STATUS_WORDS)
# Header words after magic, capacity and members.
POD_READY = 3


@dataclass(slots=True, frozen=True)
class TableSpec:
    """What a process needs to map the table: where, how many slots and members."""

    directory: str
    capacity: int = 1024
    members: int = 2

    @property
    def path(self) -> Path:
        return Path(self.directory) / "table"

    @property
    def lock_path(self) -> Path:
        return Path(self.directory) / "table.lock"


class SharedTable:
    def __init__(self, spec: TableSpec, *, create: bool = False) -> None:
        self.spec = spec
        cap, members = spec.capacity, spec.members
        self.capacity = cap
        self.members = members
        header = 8 * 8
        status = members * _STATUS_WORDS * 8
        names = cap * _NAME_BYTES
        marks = members * cap
        marks += -marks % 8
        versions = members * cap * 8
        rows = members * cap * F * 8
        self._o_status = header
        self._o_names = self._o_status + status
        self._o_marks = self._o_names + names
        self._o_versions = self._o_marks + marks
        self._o_rows = self._o_versions + versions
        size = self._o_rows + rows
        self._file = SharedFile(spec.path, size, create=create)
        view = self._file.view
        self._header = view[:header].cast("q")
        self._status = view[self._o_status:self._o_names].cast("d")
        self._names = view[self._o_names:self._o_marks]
        self._marks = view[self._o_marks:self._o_versions]
        self._versions = view[self._o_versions:self._o_rows].cast("q")
        self._rows = view[self._o_rows:size].cast("d")
        if create:
            self._header[0], self._header[1], self._header[2] = _MAGIC, cap, members
        elif (self._header[0], self._header[1], self._header[2]) != (_MAGIC, cap, members):
            raise ValueError(f"{spec.path}: not a table of {cap} slots and {members} members")

    def close(self) -> None:
        for view in (self._header, self._status, self._names, self._marks, self._versions, self._rows):
            view.release()
        self._file.close()

    # -- slots (under the file lock) --

    def claim(self, member: int, address: str) -> int:
        """The slot of `address` (taking a free one if no member uses it yet), marked as used by
        `member`. Raises ValueError when the table is full or the address too long."""
        raw = address.encode()
        if len(raw) > MAX_ADDRESS_BYTES:
            raise ValueError(f"endpoint address longer than {MAX_ADDRESS_BYTES} bytes")
        with file_lock(self.spec.lock_path):
            free = -1
            for slot in range(self.capacity):
                length = self._name_length(slot)
                if length == len(raw) and self._name(slot, length) == raw:
                    self._marks[member * self.capacity + slot] = 1
                    return slot
                if free < 0 and (length == 0 or not self._used(slot)):
                    free = slot
            if free < 0:
                raise ValueError(f"the shared endpoint table is full ({self.capacity} endpoints)")
            self._clear_slot(free)
            start = free * _NAME_BYTES
            struct.pack_into("q", self._names, start, len(raw))
            self._names[start + 8:start + 8 + len(raw)] = raw
            self._marks[member * self.capacity + free] = 1
            return free

    def give_back(self, member: int, slot: int) -> None:
        """`member` no longer uses `slot`: its row goes to zero and its mark is cleared."""
        with file_lock(self.spec.lock_path):
            self._zero_row(member, slot)
            self._marks[member * self.capacity + slot] = 0

    def address(self, slot: int) -> str:
        return bytes(self._name(slot, self._name_length(slot))).decode()

    def slots(self) -> dict[str, int]:
        """Every named slot some member uses: address -> slot."""
        out: dict[str, int] = {}
        for slot in range(self.capacity):
            length = self._name_length(slot)
            if length and self._used(slot):
                out[bytes(self._name(slot, length)).decode()] = slot
        return out

    def clear_member(self, member: int) -> None:
        """A member died (or restarts): every row it wrote goes to zero, every mark it held clears."""
        with file_lock(self.spec.lock_path):
            base = member * self.capacity
            for slot in range(self.capacity):
                if self._marks[base + slot]:
                    self._zero_row(member, slot)
                    self._marks[base + slot] = 0
            self._status[member * _STATUS_WORDS + GENERATION] += 1

    def _name_length(self, slot: int) -> int:
        return struct.unpack_from("q", self._names, slot * _NAME_BYTES)[0]

    def _name(self, slot: int, length: int) -> memoryview:
        start = slot * _NAME_BYTES + 8
        return self._names[start:start + length]

    def _used(self, slot: int) -> bool:
        marks, cap = self._marks, self.capacity
        return any(marks[m * cap + slot] for m in range(self.members))

    def _clear_slot(self, slot: int) -> None:
        for member in range(self.members):
            self._zero_row(member, slot)

    def _zero_row(self, member: int, slot: int) -> None:
        start = (member * self.capacity + slot) * F
        self._rows[start:start + F] = _ZEROS
        self._versions[member * self.capacity + slot] += 1
        self._status[member * _STATUS_WORDS + SEQUENCE] += 1

    # -- rows (lock-free: one writer per row) --

    def write(self, member: int, slot: int, values: Sequence[float]) -> None:
        start = (member * self.capacity + slot) * F
        self._rows[start:start + F] = _pack(values)
        self._versions[member * self.capacity + slot] += 1
        self._status[member * _STATUS_WORDS + SEQUENCE] += 1

    def read(self, member: int, slot: int) -> list[float]:
        start = (member * self.capacity + slot) * F
        return self._rows[start:start + F].tolist()

    def version(self, member: int, slot: int) -> int:
        return self._versions[member * self.capacity + slot]

    def sequence(self, member: int) -> float:
        """Bumped by every write of `member`: a reader skips a member that did not move."""
        return self._status[member * _STATUS_WORDS + SEQUENCE]

    # -- member status and the pod's readiness --

    def status(self, member: int, word: int) -> float:
        return self._status[member * _STATUS_WORDS + word]

    def set_status(self, member: int, word: int, value: float) -> None:
        self._status[member * _STATUS_WORDS + word] = float(value)

    @property
    def pod_ready(self) -> bool:
        return bool(self._header[POD_READY])

    @pod_ready.setter
    def pod_ready(self, ready: bool) -> None:
        self._header[POD_READY] = int(ready)


_ZEROS = memoryview(bytes(8 * F)).cast("d")


def _pack(values: Sequence[float]) -> memoryview:
    return memoryview(struct.pack(f"{F}d", *values)).cast("d")
