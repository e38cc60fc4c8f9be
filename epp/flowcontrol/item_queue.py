"""The two queue shapes ordering policies use, both O(1)/O(log n) per operation.

- `FifoQueue`: arrival order on an `OrderedDict` (a C linked hash map), so removing a cancelled
  request from the middle is O(1) and frees it at once.
- `HeapQueue`: a min-heap on `(key, seq)`. Removal marks the entry dead in O(1) and drops the
  item reference immediately; dead entries are skipped when they reach the top and the heap is
  rebuilt when they outnumber the live ones, so memory stays proportional to what is queued.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from epp.flowcontrol.item import QueueItem


class ItemQueue(ABC):
    @abstractmethod
    def push(self, item: QueueItem) -> None: ...

    @abstractmethod
    def peek(self) -> QueueItem | None:
        """The next item in order, without removing it."""

    @abstractmethod
    def pop(self) -> QueueItem:
        """Remove and return the next item. The queue must not be empty."""

    @abstractmethod
    def remove(self, item: QueueItem) -> bool:
        """Remove an item from anywhere in the queue; False if it was not there."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[QueueItem]:
        """Every item, in no particular order (for shutdown, never on the hot path)."""


class FifoQueue(ItemQueue):
    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: OrderedDict[QueueItem, None] = OrderedDict()

    def push(self, item: QueueItem) -> None:
        self._items[item] = None

    def peek(self) -> QueueItem | None:
        return next(iter(self._items)) if self._items else None

    def pop(self) -> QueueItem:
        return self._items.popitem(last=False)[0]

    def remove(self, item: QueueItem) -> bool:
        return self._items.pop(item, False) is None

    def newest(self) -> QueueItem | None:
        return next(reversed(self._items)) if self._items else None

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[QueueItem]:
        return iter(list(self._items))


_COMPACT_MIN = 64


class HeapQueue(ItemQueue):
    """Ordered by `key(item)` (smaller first), ties by enqueue sequence (FCFS)."""

    __slots__ = ("_heap", "_entries", "_key", "_dead")

    def __init__(self, key: Callable[[QueueItem], float]) -> None:
        self._heap: list[list[Any]] = []  # [key, seq, item | None]
        self._entries: dict[QueueItem, list[Any]] = {}
        self._key = key
        self._dead = 0

    def push(self, item: QueueItem) -> None:
        entry = [self._key(item), item.seq, item]
        self._entries[item] = entry
        heapq.heappush(self._heap, entry)

    def _skip_dead(self) -> None:
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
            self._dead -= 1

    def peek(self) -> QueueItem | None:
        self._skip_dead()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> QueueItem:
        self._skip_dead()
        item = heapq.heappop(self._heap)[2]
        del self._entries[item]
        return item

    def remove(self, item: QueueItem) -> bool:
        entry = self._entries.pop(item, None)
        if entry is None:
            return False
        entry[2] = None
        self._dead += 1
        if self._dead > _COMPACT_MIN and self._dead > len(self._entries):
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)
            self._dead = 0
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[QueueItem]:
        return iter(list(self._entries))
