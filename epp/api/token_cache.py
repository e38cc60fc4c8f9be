"""Local tokenization with an exact cache of the prompts' shared prefixes.

A long shared prefix (a customer's context, a growing chat) would otherwise be tokenized again
on every request: 100k tokens cost a tokenizer hundreds of milliseconds. The cache remembers
recent prompts' token ids and character offsets, findable by the chained hashes of their text
blocks (`block_chars` characters each), so a new prompt only tokenizes what follows the longest
cached prefix, plus a short overlap that proves the splice is exact:

1. find the longest cached text that shares our first k blocks (a hash walk, then a memcmp);
2. pick a cut `c` at a cached token boundary at least `margin` characters before the end of the
   shared text, and re-tokenize from `lead` characters before `c` to the end of the prompt;
3. accept the splice (cached ids before `c` + new ids from `c`) only when the re-tokenized tokens
   just before `c` are exactly the cached ones (same ids, same offsets): the tokenizations have
   converged, so left context no longer matters; otherwise tokenize the whole prompt.

Tokenizers' pre-tokenizers and normalizers act locally (a split or a merge depends on a few
characters around it), so the overlap absorbs the context the re-tokenized window lacks; the
check catches the rare case where it does not (a very long word across the cut). Tests compare
the result with tokenizing the whole prompt, on WordLevel, byte-level BPE and Metaspace
tokenizers. Special tokens the post-processor adds (a BOS) are added once, around the whole.

Memory is bounded by `max_tokens` token ids held (least recently used prompts go first).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

_hash = xxhash.xxh3_64_intdigest

# (ids, starts, ends) of a text, without special tokens; offsets in characters.
Encoder = Callable[[str], tuple[list[int], list[tuple[int, int]]]]


@dataclass(slots=True)
class Tokenized:
    """One prompt's ids, and which cached prompt it extended (for callers that cache per-prompt
    work of their own, e.g. router keys: the first `shared_tokens` ids equal that prompt's)."""

    ids: array  # uint32
    reused_chars: int  # characters not tokenized again
    serial: int  # this prompt's cache entry (0: not stored)
    prefix_serial: int = 0  # the cached prompt it extended (0: none)
    shared_tokens: int = 0  # leading ids identical to that prompt's


@dataclass(slots=True)
class _Entry:
    data: bytes  # the text, encoded at fixed width (ASCII: 1 byte per char, else UTF-32)
    width: int
    ids: array  # uint32
    starts: array  # uint32 character offset of each token's start
    ends: array
    boundaries: list[int]  # the block hashes registered for it
    serial: int = 0


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0
    hits: int = 0  # spliced from a cached prefix
    verify_failures: int = 0  # a candidate splice did not converge: tokenized whole
    cached_chars: int = 0  # characters not tokenized again, summed
    tokenized_chars: int = 0  # characters given to the tokenizer, summed


def _fixed_width(text: str) -> tuple[bytes, int]:
    if text.isascii():
        return text.encode("ascii"), 1
    return text.encode("utf-32-le"), 4


def _block_hashes(data: bytes, step: int, seed: int) -> list[int]:
    view = memoryview(data)
    out: list[int] = []
    h = seed
    for off in range(0, len(data) - step + 1, step):
        h = _hash(view[off:off + step], seed=h)
        out.append(h)
    return out


class PrefixTokenCache:
    def __init__(self, encode: Encoder, *, block_chars: int = 1024, margin: int = 128, lead: int = 128,
                 converge_tokens: int = 8, max_tokens: int = 4_000_000) -> None:
        self.encode = encode
        self.block_chars = block_chars
        self.margin = margin
        self.lead = lead
        self.converge_tokens = converge_tokens
        self.max_tokens = max_tokens
        self.stats = CacheStats()
        # chained block hash -> the newest entry whose text has that prefix, one table per width
        # (a chained hash names its position too; the memcmp below guards against collisions)
        self._by_block: dict[int, dict[int, _Entry]] = {1: {}, 4: {}}
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # serial -> entry, least recently used first
        self._tokens = 0
        self._serial = 0

    def tokenize(self, text: str) -> tuple[array, int]:
        """Token ids of `text` (no special tokens) and how many characters came from the cache."""
        result = self.lookup(text)
        return result.ids, result.reused_chars

    def lookup(self, text: str) -> Tokenized:
        """`tokenize`, also saying which cached prompt this one extended."""
        self.stats.lookups += 1
        data, width = _fixed_width(text)
        step = self.block_chars * width
        hashes = _block_hashes(data, step, width)
        found = self._longest(hashes, width, data)
        result = self._splice(text, found) if found is not None else None
        prefix_serial = shared = 0
        if result is None:
            ids, offsets = self.encode(text)
            self.stats.tokenized_chars += len(text)
            ids_a = array("I", ids)
            starts = array("I", [s for s, _ in offsets])
            ends = array("I", [e for _, e in offsets])
            reused = 0
        else:
            ids_a, starts, ends, reused, shared = result
            assert found is not None
            prefix_serial = found[0].serial
            self.stats.hits += 1
            self.stats.cached_chars += reused
        self._serial += 1
        entry = _Entry(data, width, ids_a, starts, ends, [], self._serial)
        stored = self._store(entry, hashes)
        return Tokenized(ids_a, reused, entry.serial if stored else 0, prefix_serial, shared)

    # -- lookup --

    def _longest(self, hashes: list[int], width: int, data: bytes) -> tuple[_Entry, int] | None:
        """The cached entry sharing the most leading blocks with `data`, and the shared length in chars."""
        entry: _Entry | None = None
        blocks = 0
        by_block = self._by_block[width]
        for h in hashes:
            hit = by_block.get(h)
            if hit is None:
                break
            entry = hit
            blocks += 1
        if entry is None:
            return None
        block = blocks - 1
        n = blocks * self.block_chars * width
        if entry.data[:n] != data[:n]:  # a hash collision: never trust it (a copy and a memcmp)
            return None
        self._entries.move_to_end(entry.serial)
        return entry, (block + 1) * self.block_chars

    def _splice(self, text: str, found: tuple[_Entry, int]) -> tuple[array, array, array, int, int] | None:
        entry, shared = found
        limit = shared - self.margin
        # The cut: the start of the last cached token that ends at or before `limit`.
        cut_index = bisect_right(entry.ends, limit) - 1
        if cut_index < self.converge_tokens:
            return None
        cut = entry.starts[cut_index]
        if cut < self.lead:
            return None
        lead_start = entry.starts[bisect_right(entry.starts, cut - self.lead) - 1]
        window = text[lead_start:]
        ids, offsets = self.encode(window)
        self.stats.tokenized_chars += len(window)
        starts = [s + lead_start for s, _ in offsets]
        j = bisect_left(starts, cut)
        if j >= len(starts) or starts[j] != cut or j < self.converge_tokens:
            self.stats.verify_failures += 1
            return None
        n = self.converge_tokens
        ends = [e + lead_start for _, e in offsets]
        if (ids[j - n:j] != entry.ids[cut_index - n:cut_index].tolist()
                or starts[j - n:j] != entry.starts[cut_index - n:cut_index].tolist()
                or ends[j - n:j] != entry.ends[cut_index - n:cut_index].tolist()):
            self.stats.verify_failures += 1
            return None
        out_ids = entry.ids[:cut_index]
        out_ids.extend(ids[j:])
        out_starts = entry.starts[:cut_index]
        out_starts.extend(starts[j:])
        out_ends = entry.ends[:cut_index]
        out_ends.extend(ends[j:])
        return out_ids, out_starts, out_ends, lead_start, cut_index

    # -- storage --

    def _store(self, entry: _Entry, hashes: list[int]) -> bool:
        if len(entry.ids) > self.max_tokens:
            return False
        self._entries[entry.serial] = entry
        self._tokens += len(entry.ids)
        by_block = self._by_block[entry.width]
        for h in hashes:
            by_block[h] = entry  # the newest prompt with this prefix answers for it
        entry.boundaries = hashes
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._tokens -= len(old.ids)
            table = self._by_block[old.width]
            for h in old.boundaries:
                if table.get(h) is old:
                    del table[h]
        return True

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def entries(self) -> int:
        return len(self._entries)
