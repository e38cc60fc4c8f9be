"""Prometheus text exposition, fast path: read only the metric names an engine mapping wants.

A vLLM `/metrics` body is ~50 KB and ~600 lines, of which we need about five. Parsing all of it
would cost more CPU than everything else a scrape does, so instead each wanted name is located
with `bytes.find` (C speed) on ``b"\\n" + name``, and only those lines are parsed. Label values
cannot contain a raw newline (the format escapes it as ``\\n``), so a match is always at the
start of a line, and `#` comment lines never match.

The format requires all samples of one metric to be one contiguous group, so after the first
match we read following lines only while they carry the same name; a name that is absent costs
one scan of the body, one that is present costs only the distance to it.

Error policy: lines we do not want are never looked at, so garbage there is ignored. A wanted
line that cannot be read (bad labels, missing or non-numeric value, truncated body, invalid
UTF-8 in a label) raises `MetricsParseError`, because using half of a broken exposition could
be silently wrong. A body containing a NUL byte is rejected as not being text at all (protobuf
exposition, a compressed body we did not ask for, binary junk). A body that simply lacks the
wanted names yields an empty result; the extractor turns that into "no metrics found".

Not supported: the UTF-8 quoted-name syntax (``{"my.metric"}``); such series are not found.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


class MetricsParseError(ValueError):
    """The exposition could not be read where we needed it; the message says where and why."""


@dataclass(slots=True, frozen=True)
class Sample:
    """One series line. `timestamp` is as written (milliseconds in the Prometheus text format),
    None when the line has none. Samples may be shared between parses (`PageMemory`): never mutate them."""

    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None


# One `name="value"` pair, the value with backslash escapes kept raw (unrolled-loop form so the
# regex engine does not backtrack per character). A whole label set is first validated by one
# match (pairs separated by commas, optional trailing comma), then its pairs are read with one
# findall: two passes in C instead of a Python loop per label (vLLM's cache_config_info has ~40).
_PAIR_SRC = rb'[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*"[^"\\]*(?:\\.[^"\\]*)*"'
_LABEL_SET = re.compile(rb"\{[ \t]*(?:" + _PAIR_SRC + rb"[ \t]*,[ \t]*)*(?:" + _PAIR_SRC + rb"[ \t]*)?\}")
_PAIR = re.compile(rb'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\]*(?:\\.[^"\\]*)*)"')
_ESCAPES = {b"\\": "\\", b'"': '"', b"n": "\n"}


class WantedNames:
    """A set of metric names with their search needles precomputed, reused on every scrape."""

    __slots__ = ("_needles", "names")

    def __init__(self, names: Iterable[str]) -> None:
        self.names: tuple[str, ...] = tuple(sorted(set(names)))
        self._needles = tuple((name, name.encode(), b"\n" + name.encode()) for name in self.names)

    def __repr__(self) -> str:
        return f"WantedNames({list(self.names)})"


ABSENT_RECHECK_POLLS = 20  # a family absent from a page is looked for again after this many polls
HINT_WINDOW = 2048  # bytes before last poll's offset where a family's search starts
_PROBE_BYTES = 48  # how much of a known line's start `_find_single` searches for


@dataclass(slots=True)
class _Group:
    """One family's lines as last seen: where, their bytes, their parse, and each line's label
    set (its bytes and dict), so a line whose labels did not change parses only its value."""

    start: int
    raw: bytes
    samples: list[Sample]
    labels: list[tuple[bytes, dict[str, str]]]
    # A one-line family with a label set: b"\n" + name + labels, what the line starts with
    # (found by one `find`, see `_find_single`); b"" otherwise.
    key: bytes = b""


class PageMemory:
    """What one endpoint's last page looked like, so the next parse does only what changed.

    Owned by the caller (one per scraped endpoint). A family is looked for first where it was
    (its offset moves only by as much as the values before it changed length), a family whose
    lines are byte-identical to last time is not parsed again (vLLM's `cache_config_info`, ~40
    labels, never changes; neither do an idle pod's gauges), a line whose label set is unchanged
    parses only its value, and a family absent from the page (`lora_requests_info` on a pod
    without LoRA) is looked for again only every `recheck_absent` polls rather than costing a
    scan of the whole page on each. Samples may be shared between polls: never mutate them.

    `unchanged` tells after a parse whether every wanted family read the same bytes as the
    previous parse (and none appeared or went away): the page's signals did not move.
    `same_labels` whether every wanted family had the same lines with the same label sets (only
    values or timestamps may have moved, and no family appeared or went away): a busy pod's page.
    `complete` whether it looked for every wanted family (none was skipped as absent): only then
    does the page say all there is to know about every family, present or not."""

    __slots__ = ("_absent", "_groups", "complete", "recheck_absent", "result", "same_labels", "unchanged")

    def __init__(self, recheck_absent: int = ABSENT_RECHECK_POLLS) -> None:
        self.recheck_absent = recheck_absent
        self.unchanged = False
        self.same_labels = False
        self.complete = False
        # What the caller made of the page as last parsed (the extractor keeps its result here,
        # to skip the work when the page did not change).
        self.result: object = None
        self._groups: dict[str, _Group] = {}
        self._absent: dict[str, int] = {}  # name -> polls left before it is looked for again

    def forget(self) -> None:
        """Drop everything (a new server behind the same address)."""
        self._groups.clear()
        self._absent.clear()
        self.unchanged = False
        self.same_labels = False
        self.complete = False
        self.result = None


def parse_wanted(body: bytes, wanted: WantedNames | Iterable[str],
                 memory: PageMemory | None = None, *, recheck_absent: int | None = None) -> dict[str, list[Sample]]:
    """Samples of the wanted metric names only, grouped by name in exposition order.

    Names with no sample are absent from the result. Raises `MetricsParseError` on a wanted line
    that cannot be read or on a binary body. `memory` (see `PageMemory`) makes repeated parses
    of one endpoint's pages cheap; the result is the same with or without it, except that a
    family that appears on a page is seen up to `recheck_absent` polls late (the memory's, or
    this call's: 0 for exporters that create a family on its first use, where appearing is news).
    """
    if not isinstance(wanted, WantedNames):
        wanted = WantedNames(wanted)
    nul = body.find(b"\0")
    if nul != -1:
        raise MetricsParseError(f"not Prometheus text: NUL byte at offset {nul}")
    out: dict[str, list[Sample]] = {}
    unchanged = same_labels = complete = True
    for name, raw, needle in wanted._needles:
        group: _Group | None = None
        if memory is None:
            start = _find_group(body, raw, needle, -1)
        else:
            skip = memory._absent.get(name, 0)
            if skip > 0:
                memory._absent[name] = skip - 1
                complete = False
                continue
            group = memory._groups.get(name)
            if group is not None and group.key:
                where = _find_single(body, raw, group)
                if where is not None:  # the usual case: the same line, maybe another value
                    start, end = where
                    if end - start == len(group.raw) and body.startswith(group.raw, start):
                        group.start = start
                        out[name] = group.samples
                        continue
                    line = body[start:end]
                    value, timestamp = _value(line, len(group.key) - 1, name, body, start)
                    samples = [Sample(name, group.labels[0][1], value, timestamp)]
                    group.start, group.raw, group.samples = start, line, samples
                    out[name] = samples
                    unchanged = False
                    continue
            start = _find_group(body, raw, needle, group.start if group is not None else -1)
        if start < 0:
            if memory is not None:
                if memory._groups.pop(name, None) is not None or name not in memory._absent:
                    unchanged = same_labels = False  # it went away, or this is the first look
                memory._absent[name] = memory.recheck_absent if recheck_absent is None else recheck_absent
            continue
        lines = _group_lines(body, start, raw)
        end = lines[-1][1]
        if group is not None:
            if end - start == len(group.raw) and body.startswith(group.raw, start):
                group.start = start
                out[name] = group.samples
                continue
            if len(lines) == 1 and len(group.labels) == 1:  # a gauge that moved: its labels did not
                label_bytes, label_dict = group.labels[0]
                cut = len(raw)
                if label_bytes and body.startswith(label_bytes, start + cut):
                    line = body[start:end]
                    value, timestamp = _value(line, cut + len(label_bytes), name, body, start)
                    samples = [Sample(name, label_dict, value, timestamp)]
                    group.start, group.raw, group.samples = start, line, samples
                    out[name] = samples
                    unchanged = False
                    continue
        unchanged = False
        samples, labels = _parse_group(body, lines, name, len(raw), group)
        if group is None or len(labels) != len(group.labels) \
                or any(now is not before for now, before in zip(labels, group.labels)):
            same_labels = False  # (a line whose label set was reused is the same tuple)
        out[name] = samples
        if memory is not None:
            memory._absent.pop(name, None)
            key = b"\n" + raw + labels[0][0] if len(labels) == 1 and labels[0][0] else b""
            memory._groups[name] = _Group(start, body[start:end], samples, labels, key)
    if memory is not None:
        memory.unchanged = unchanged
        memory.same_labels = same_labels
        memory.complete = complete
    return out


def value_spans(body: bytes, memory: PageMemory, name: str) -> list[tuple[int, int]] | None:
    """Where the value of each line of family `name` is in `body`, which `memory` has just
    parsed: (start, end) of each line's value token, in line order. None when the family is not
    on the page (or not as `memory` last saw it)."""
    group = memory._groups.get(name)
    if group is None or not body.startswith(group.raw, group.start):
        return None
    raw = name.encode()
    spans: list[tuple[int, int]] = []
    start = group.start
    for line in group.raw.split(b"\n"):
        _, pos = _parse_line(line, name, len(raw), body, start)
        token = _TOKEN.search(line, pos)
        if token is None:
            return None
        spans.append((start + token.start(), start + token.end()))
        start += len(line) + 1
    return spans


_TOKEN = re.compile(rb"\S+")  # a line's value: its first token after the label set (`_value`)


def _find_group(body: bytes, raw: bytes, needle: bytes, hint: int) -> int:
    """Offset of the first line of `raw`'s family, or -1. With a `hint` (where it was on the
    previous page) the search starts a little before it; a match there that is not the group's
    first line, or no match, falls back to searching the whole page."""
    if hint >= 0:
        low = max(0, hint - HINT_WINDOW)
        if low == 0 and body.startswith(raw) and _is_name_end(body, len(raw)):
            return 0
        i = _find_line(body, needle, max(0, low - 1))
        if i > 0:
            previous = body.rfind(b"\n", 0, i - 1) + 1
            if not (body.startswith(raw, previous) and _is_name_end(body, previous + len(raw))):
                return i
    if body.startswith(raw) and _is_name_end(body, len(raw)):
        return 0
    return _find_line(body, needle, 0)


def _find_single(body: bytes, raw: bytes, group: _Group) -> tuple[int, int] | None:
    """(start, end) of the line of a family that was one line with these labels on the previous
    page, if it is still that: a line starting with the same name and label set near where it
    was, and no other line of the family before or after it. None when the page changed shape
    there (the full search then decides)."""
    key = group.key
    # Found by its first bytes (a long needle, such as the cache config's ~40 labels, costs a
    # setup per search), in the window around where it was; then checked whole.
    low = max(0, group.start - HINT_WINDOW - 1)
    i = body.find(key[:_PROBE_BYTES], low, group.start + HINT_WINDOW + len(key))
    if i < 0 or not body.startswith(key, i):
        return None
    cut = len(raw)
    previous = body.rfind(b"\n", 0, i) + 1
    if body.startswith(raw, previous) and _is_name_end(body, previous + cut):
        return None  # another line of the family comes first now
    start = i + 1
    end = body.find(b"\n", i + len(key))
    if end < 0:
        end = len(body)
    elif body.startswith(raw, end + 1) and _is_name_end(body, end + 1 + cut):
        return None  # and another one follows
    return start, end


def _group_lines(body: bytes, start: int, raw: bytes) -> list[tuple[int, int]]:
    """(start, end) of each line of the family that begins at `start` (contiguous, by the format)."""
    size = len(body)
    cut = len(raw)
    lines: list[tuple[int, int]] = []
    while True:
        end = body.find(b"\n", start)
        if end < 0:
            end = size
        lines.append((start, end))
        start = end + 1
        if start >= size or not (body.startswith(raw, start) and _is_name_end(body, start + cut)):
            return lines


def _parse_group(body: bytes, lines: list[tuple[int, int]], name: str, cut: int,
                 previous: _Group | None) -> tuple[list[Sample], list[tuple[bytes, dict[str, str]]]]:
    samples: list[Sample] = []
    labels: list[tuple[bytes, dict[str, str]]] = []
    known = previous.labels if previous is not None else []
    for k, (start, end) in enumerate(lines):
        line = body[start:end]
        if k < len(known):
            label_bytes, label_dict = known[k]
            if label_bytes and line.startswith(label_bytes, cut):
                value, timestamp = _value(line, cut + len(label_bytes), name, body, start)
                samples.append(Sample(name, label_dict, value, timestamp))
                labels.append(known[k])
                continue
        sample, label_end = _parse_line(line, name, cut, body, start)
        samples.append(sample)
        labels.append((line[cut:label_end] if label_end > cut and line[cut:cut + 1] == b"{" else b"",
                       sample.labels))
    return samples, labels


def _is_name_end(body: bytes, i: int) -> bool:
    """The metric name ends at `i` (so `foo` does not match the line of `foo_total`)."""
    return body[i:i + 1] in (b"{", b" ", b"\t")


def _find_line(body: bytes, needle: bytes, start: int) -> int:
    """Offset of the first line starting with needle[1:] followed by a name end, or -1."""
    cut = len(needle)
    i = body.find(needle, start)
    while i >= 0:
        if _is_name_end(body, i + cut):
            return i + 1
        i = body.find(needle, i + cut)
    return -1


def _parse_line(line: bytes, name: str, cut: int, body: bytes, start: int) -> tuple[Sample, int]:
    """Parse one wanted line, and say where its label set ends; `body` and `start` only serve the
    error message's line number."""
    labels: dict[str, str] = {}
    pos = cut
    try:
        if line[pos:pos + 1] in (b" ", b"\t"):  # tolerate `name {labels}` as well
            brace = len(line) - len(line[pos:].lstrip(b" \t"))
            if line[brace:brace + 1] == b"{":
                pos = brace
        if line[pos:pos + 1] == b"{":
            label_set = _LABEL_SET.match(line, pos)
            if label_set is None:
                raise MetricsParseError("malformed or unterminated label set")
            for key, value in _PAIR.findall(line, pos, label_set.end()):
                labels[key.decode()] = _unescape(value) if b"\\" in value else value.decode()
            pos = label_set.end()
    except MetricsParseError as exc:
        raise MetricsParseError(f"{name} at line {_line_number(body, start)}: {exc}") from None
    except UnicodeDecodeError:
        raise MetricsParseError(f"{name} at line {_line_number(body, start)}: label is not UTF-8") from None
    value, timestamp = _value(line, pos, name, body, start)
    return Sample(name, labels, value, timestamp), pos


def _value(line: bytes, pos: int, name: str, body: bytes, start: int) -> tuple[float, float | None]:
    """The value and optional timestamp after the label set (or the name) at `pos`."""
    try:
        tokens = line[pos:].split()
        if tokens and tokens[0].startswith(b"#"):
            tokens = []
        if not tokens:
            raise MetricsParseError("missing value")
        value_f = _number(tokens[0], "value")
        timestamp: float | None = None
        if len(tokens) > 1 and not tokens[1].startswith(b"#"):
            timestamp = _number(tokens[1], "timestamp")
            if len(tokens) > 2 and not tokens[2].startswith(b"#"):
                raise MetricsParseError(f"unexpected text after the timestamp: {tokens[2][:32]!r}")
    except MetricsParseError as exc:
        raise MetricsParseError(f"{name} at line {_line_number(body, start)}: {exc}") from None
    return value_f, timestamp


def _line_number(body: bytes, offset: int) -> int:
    return body.count(b"\n", 0, offset) + 1


def _number(token: bytes, what: str) -> float:
    try:
        return float(token)  # accepts NaN, +Inf, -Inf as the format writes them
    except ValueError:
        raise MetricsParseError(f"{what} is not a number: {token[:32]!r}") from None


def _unescape(raw: bytes) -> str:
    """Undo the format's label escapes (`\\\\`, `\\"`, `\\n`); other escapes are kept verbatim."""
    parts: list[str] = []
    i = 0
    while True:
        j = raw.find(b"\\", i)
        if j < 0:
            parts.append(raw[i:].decode())
            return "".join(parts)
        parts.append(raw[i:j].decode())
        esc = raw[j + 1:j + 2]
        parts.append(_ESCAPES.get(esc) or "\\" + esc.decode())
        i = j + 2
