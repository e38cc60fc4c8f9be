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
    None when the line has none. Samples may be shared through a line cache: never mutate them."""

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


LineCache = dict[bytes, Sample]
CACHE_MIN_LINE = 256  # shorter lines are gauges whose value changes every scrape
CACHE_MAX_LINES = 16


def parse_wanted(body: bytes, wanted: WantedNames | Iterable[str],
                 cache: LineCache | None = None) -> dict[str, list[Sample]]:
    """Samples of the wanted metric names only, grouped by name in exposition order.

    Names with no sample are absent from the result. Raises `MetricsParseError` on a wanted line
    that cannot be read or on a binary body.

    `cache`, owned by the caller (one per scraped endpoint), remembers the parse of long lines:
    info-style metrics such as vLLM's `cache_config_info` carry dozens of labels, are the most
    expensive lines to parse, and are byte-identical on every scrape.
    """
    if not isinstance(wanted, WantedNames):
        wanted = WantedNames(wanted)
    nul = body.find(b"\0")
    if nul != -1:
        raise MetricsParseError(f"not Prometheus text: NUL byte at offset {nul}")
    out: dict[str, list[Sample]] = {}
    size = len(body)
    for name, raw, needle in wanted._needles:
        if body.startswith(raw) and _is_name_end(body, len(raw)):
            start = 0
        else:
            start = _find_line(body, needle, 0)
            if start < 0:
                continue
        samples: list[Sample] = []
        cut = len(raw)
        while True:
            end = body.find(b"\n", start)
            if end < 0:
                end = size
            if cache is not None and end - start >= CACHE_MIN_LINE:
                line = body[start:end]
                sample = cache.get(line)
                if sample is None:
                    sample = _parse_line(line, name, cut, body, start)
                    if len(cache) >= CACHE_MAX_LINES:
                        cache.clear()
                    cache[line] = sample
                samples.append(sample)
            else:
                samples.append(_parse_line(body[start:end], name, cut, body, start))
            start = end + 1
            if start >= size or not (body.startswith(raw, start) and _is_name_end(body, start + cut)):
                break
        out[name] = samples
    return out


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


def _parse_line(line: bytes, name: str, cut: int, body: bytes, start: int) -> Sample:
    """Parse one wanted line; `body` and `start` only serve the error message's line number."""
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
    except UnicodeDecodeError:
        raise MetricsParseError(f"{name} at line {_line_number(body, start)}: label is not UTF-8") from None
    return Sample(name, labels, value_f, timestamp)


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
