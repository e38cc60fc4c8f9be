"""Strict, typed reading of a plugin's `parameters` map, with errors that name the field path.

A leaf module: every layer's plugins read their parameters through it, so none of them imports
`epp.config` (which composes them all).
"""

from __future__ import annotations

import builtins
from typing import Any


class ConfigError(ValueError):
    """A configuration problem; the message starts with the path of the offending field."""


class Params:
    """Read each parameter once with its type and default; `done()` rejects the rest.

    Accepts camelCase keys as the reference's YAML does. Ints are accepted where floats are asked.
    """

    def __init__(self, raw: Any, path: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: must be a mapping, got {type(raw).__name__}")
        self._raw: dict[str, Any] = raw
        self._seen: set[str] = set()
        self.path = path

    def _get(self, key: str) -> Any:
        self._seen.add(key)
        return self._raw.get(key)

    def has(self, key: str) -> bool:
        return key in self._raw

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}.{key}: {message}")

    def int(self, key: str, default: builtins.int, *, min: builtins.int | None = None,
            max: builtins.int | None = None) -> builtins.int:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {value!r}")
        self._check_range(key, value, min, max)
        return value

    def float(self, key: str, default: builtins.float, *, min: builtins.float | None = None,
              max: builtins.float | None = None, min_exclusive: builtins.bool = False) -> builtins.float:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"must be a number, got {value!r}")
        value = float(value)
        if min_exclusive and min is not None and value <= min:
            raise self.error(key, f"must be > {min}, got {value}")
        self._check_range(key, value, None if min_exclusive else min, max)
        return value

    def bool(self, key: str, default: builtins.bool) -> builtins.bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def str(self, key: builtins.str, default: builtins.str, *,
            choices: tuple[builtins.str, ...] = ()) -> builtins.str:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {value!r}")
        if choices and value not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def list(self, key: builtins.str) -> builtins.list[Any]:
        value = self._get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(key, f"must be a list, got {type(value).__name__}")
        return value

    def mapping(self, key: builtins.str) -> dict[builtins.str, Any]:
        value = self._get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(key, f"must be a mapping, got {value!r}")
        return value

    def duration(self, key: builtins.str, default: builtins.float) -> builtins.float:
        """Seconds, from a number of seconds or a Go-style duration string ("200ms", "1m30s")."""
        value = self._get(key)
        if value is None:
            return default
        try:
            return parse_duration(value)
        except ValueError as exc:
            raise self.error(key, str(exc)) from None

    def done(self) -> None:
        unknown = sorted(set(self._raw) - self._seen)
        if unknown:
            raise ConfigError(f"{self.path}.{unknown[0]}: unknown field")

    def _check_range(self, key: builtins.str, value: builtins.float, lo: builtins.float | None,
                     hi: builtins.float | None) -> None:
        if lo is not None and value < lo:
            raise self.error(key, f"must be >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise self.error(key, f"must be <= {hi}, got {value}")


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> float:
    """Go `time.ParseDuration` subset: "50ms", "2s", "1m30s", "1.5h"; bare numbers are seconds."""
    if isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"invalid duration {value!r}: negative")
        return float(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"invalid duration {value!r}")
    text = value.strip()
    if text == "0":
        return 0.0
    total, i = 0.0, 0
    while i < len(text):
        j = i
        while j < len(text) and (text[j].isdigit() or text[j] == "."):
            j += 1
        k = j
        while k < len(text) and not (text[k].isdigit() or text[k] == "."):
            k += 1
        number, unit = text[i:j], text[j:k]
        if not number or unit not in _UNITS:
            raise ValueError(f"invalid duration {value!r}")
        try:
            total += float(number) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"invalid duration {value!r}") from None
        i = k
    return total
