"""A busy pod's next page read in a few compares: the last page with its signal values left open.

A pod answering `?name[]=` sends ~2 KB that differ from one poll to the next only in a few
numbers (the queue, the batch, the KV use, the ITL counters). Reading them by searching the page
family by family costs more CPU than everything else a poll does; here the last page becomes a
template — its bytes cut around the value token of each line the extractor reads a number from —
and a new page that matches it (each literal part in its place, a token between them, nothing
after the last part) has the same lines, labels, timestamps, families present and absent, and
comments as the last one: only those numbers can have moved, and they are the open tokens.

A token cannot hold whitespace, a NUL or start with `#`, so a match cannot join or split lines
or hide a NUL (a binary body), and every token is what the parser would read as that line's
value. Whether it is a number is for the caller to check (`float`, as the parser does).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from epp.datalayer.promparse import PageMemory, value_spans

MAX_TEMPLATE_BYTES = 16 << 10  # larger pages (a whole vLLM page: ~55 KB, with other moving numbers) are read as before
_TOKEN = re.compile(rb"[^\s\x00#][^\s\x00]*")


@dataclass(slots=True, frozen=True)
class PageTemplate:
    """`parts`: the literal bytes around the open tokens (one more part than tokens);
    `families`: (name, first token, lines) for each family whose values are open."""

    parts: tuple[bytes, ...]
    families: tuple[tuple[str, int, int], ...]

    @classmethod
    def of(cls, body: bytes, memory: PageMemory, names: Iterable[str]) -> PageTemplate | None:
        """The template of `body`, which `memory` has just parsed, with the values of the lines of
        `names` open; None when their lines cannot be located."""
        spans: list[tuple[int, int, str]] = []
        for name in names:
            found = value_spans(body, memory, name)
            if found is not None:
                spans += [(start, end, name) for start, end in found]
        spans.sort()
        parts: list[bytes] = []
        families: list[tuple[str, int, int]] = []
        last = 0
        for token, (start, end, name) in enumerate(spans):
            if start < last:
                return None  # overlapping: not lines the parser read
            parts.append(body[last:start])
            last = end
            if families and families[-1][0] == name:
                families[-1] = (name, families[-1][1], families[-1][2] + 1)
            else:
                families.append((name, token, 1))
        parts.append(body[last:])
        return cls(tuple(parts), tuple(families))

    def values(self, body: bytes) -> list[bytes] | None:
        """The open tokens of `body`, in page order, if it matches the template."""
        tokens: list[bytes] = []
        pos = 0
        token = _TOKEN.match
        for part in self.parts[:-1]:
            if not body.startswith(part, pos):
                return None
            found = token(body, pos + len(part))
            if found is None:
                return None
            tokens.append(found.group())
            pos = found.end()
        tail = self.parts[-1]
        return tokens if len(body) - pos == len(tail) and body.endswith(tail) else None
