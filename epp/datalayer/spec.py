"""Metric spec strings: the PromQL instant-selector subset the reference's engine configs use.

`name{label=value,...}` where values may be quoted (`"v"`, `'v'`) or bare, as the reference
accepts both. Only equality matchers are meaningful for picking a series; `!=`, `=~` and `!~`
are rejected rather than silently ignored (the reference drops them), so a config never means
something other than what it says. `{__name__="x"}` is accepted as the name; other `__` labels
are pseudo labels and are dropped, as in the reference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*")
_MATCHER = re.compile(
    r"""\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"""
    r"""(?:"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)'|([^"',}\s]+))\s*(,?)"""
)
_CLOSE = re.compile(r"\s*}")
_UNESCAPE = re.compile(r"\\(.)")
_ESCAPED = {"n": "\n"}


@dataclass(slots=True, frozen=True)
class MetricSpec:
    """A metric name and the label values a series must have to be picked."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        for key, value in self.labels:  # a plain loop: cheaper than all() over a generator
            if labels.get(key) != value:
                return False
        return True

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        inner = ",".join(f'{k}="{_quote(v)}"' for k, v in self.labels)
        return f"{self.name}{{{inner}}}"


def parse_spec(text: str) -> MetricSpec | None:
    """Parse a spec string; "" means the metric is turned off (None). Raises ValueError."""
    if not text.strip():
        return None
    m = _NAME.match(text)
    name = m.group(1) if m else ""
    pos = m.end() if m else 0
    labels: dict[str, str] = {}
    if pos < len(text) and text[pos] == "{":
        pos += 1
        while True:
            close = _CLOSE.match(text, pos)
            if close:
                pos = close.end()
                break
            mm = _MATCHER.match(text, pos)
            if mm is None:
                raise ValueError(f"invalid metric spec {text!r}: cannot read labels at offset {pos}")
            key, op = mm.group(1), mm.group(2)
            if op != "=":
                raise ValueError(f"invalid metric spec {text!r}: only `=` matchers are supported, got `{op}`")
            quoted = mm.group(3) if mm.group(3) is not None else mm.group(4)
            value = mm.group(5) if quoted is None else _UNESCAPE.sub(_unescape_one, quoted)
            if key == "__name__":
                if name and name != value:
                    raise ValueError(f"invalid metric spec {text!r}: two different names")
                name = value
            elif not key.startswith("__"):
                labels[key] = value
            pos = mm.end()
            if not mm.group(6):
                close = _CLOSE.match(text, pos)
                if close is None:
                    raise ValueError(f"invalid metric spec {text!r}: expected `,` or `}}` at offset {pos}")
                pos = close.end()
                break
    if text[pos:].strip():
        raise ValueError(f"invalid metric spec {text!r}: unexpected {text[pos:].strip()!r}")
    if not name or not _NAME.fullmatch(name):
        raise ValueError(f"invalid metric spec {text!r}: missing or invalid metric name")
    return MetricSpec(name, tuple(sorted(labels.items())))


def _unescape_one(m: re.Match[str]) -> str:
    return _ESCAPED.get(m.group(1), m.group(1))


def _quote(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
