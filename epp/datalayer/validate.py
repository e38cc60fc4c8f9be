"""What a model server may report: bounds per kind of value, so garbage never reaches a decision.

A pod's `/metrics` is input like a request body. A broken exporter, an engine that reports a
percentage where a fraction is meant (85 for 85 %), or a hostile pod writing `1e308` or `NaN`
must not reach pool statistics, saturation or scores: one such value averaged into the pool once
made every sheddable request fail with 429 while other pods were idle.

Every value the extractor reads has a kind, and each kind a bound:
- a *count* (requests waiting or running) is a whole number in [0, `MAX_COUNT`];
- a *fraction* (KV-cache use) is in [0, 1] — above 1 is not "very full", it is a wrong unit;
- a *block size* / *block count* is a whole number in [1, `MAX_BLOCK_SIZE`] / [1, `MAX_NUM_BLOCKS`];
- a *limit* (`max_lora`) is a whole number in [0, `MAX_LORA`];
- a histogram *total* (the inter-token latency's `_sum` and `_count`) is finite and >= 0;
- a *name* (a model or LoRA adapter) is at most `MAX_NAME_CHARS` long, and a list of them at
  most `MAX_NAMES` long; all the names one scrape reports (served models, running and waiting
  adapters) take at most `MAX_NAME_BYTES` of UTF-8 together: what one endpoint's slot of the
  shared-memory metrics board holds (`board`), so the scraper process and the request path
  always agree.

A value outside its bound makes the whole scrape invalid (`Extraction.invalid`): the endpoint
keeps its previous metrics, which then age like after a failed scrape, and the scraper records
why. Nothing is clamped: a clamped 1e308 would read as "full", a clamped -5 as "idle", and
either would be a silent lie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_COUNT = 1_000_000  # requests on one server; vLLM's max_num_seqs is in the hundreds
MAX_BLOCK_SIZE = 1 << 20  # tokens per KV block (vLLM: 16-128, hybrid models some thousands)
MAX_NUM_BLOCKS = 1 << 32  # KV blocks on one device
MAX_LORA = 1 << 16  # LoRA slots
MAX_NAME_CHARS = 1024  # a model or adapter name (the request parser's cap on `model` too)
MAX_NAMES = 1024  # names in one label (adapter lists) or model names on one server
MAX_NAME_BYTES = 12 * 1024  # UTF-8 bytes of every name one scrape reports, with a separator each


@dataclass(slots=True, frozen=True)
class Invalid:
    """One value out of bounds: `metric` is the series name (bounded: it comes from the engine
    mapping), `detail` says what was wrong, with the value cut short."""

    metric: str
    detail: str

    def __str__(self) -> str:
        return f"{self.metric}: {self.detail}"


def _shown(value: float) -> str:
    return repr(value) if math.isfinite(value) else str(value)


def _whole(value: float, low: int, high: int, what: str) -> str:
    """'' when `value` is a whole number in [low, high], else why not."""
    if not math.isfinite(value) or not value.is_integer() or not low <= value <= high:
        return f"{_shown(value)} is not a valid {what} (a whole number in [{low}, {high}])"
    return ""


def count_error(value: float) -> str:
    return _whole(value, 0, MAX_COUNT, "count")


def fraction_error(value: float) -> str:
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        return f"{_shown(value)} is not a valid fraction (0 to 1; a percentage is a wrong unit)"
    return ""


def block_size_error(value: float) -> str:
    return _whole(value, 1, MAX_BLOCK_SIZE, "block size")


def num_blocks_error(value: float) -> str:
    return _whole(value, 1, MAX_NUM_BLOCKS, "block count")


def limit_error(value: float) -> str:
    return _whole(value, 0, MAX_LORA, "limit")


def total_error(value: float) -> str:
    if not math.isfinite(value) or value < 0.0:
        return f"{_shown(value)} is not a valid histogram total (finite, >= 0)"
    return ""


def names_error(names: frozenset[str] | set[str], what: str) -> str:
    """'' when every name is short enough and there are not too many of them."""
    if len(names) > MAX_NAMES:
        return f"{len(names)} {what}s (at most {MAX_NAMES})"
    longest = max((len(n) for n in names), default=0)
    if longest > MAX_NAME_CHARS:
        return f"a {what} of {longest} characters (at most {MAX_NAME_CHARS})"
    return ""


def names_bytes(*sets: frozenset[str]) -> int:
    """The names' UTF-8 bytes with one separator each (as the metrics board stores them)."""
    return sum(len(name.encode()) + 1 for names in sets for name in names)


def name_bytes_error(*sets: frozenset[str]) -> str:
    size = names_bytes(*sets)
    if size > MAX_NAME_BYTES:
        return f"{size} bytes of model and adapter names (at most {MAX_NAME_BYTES})"
    return ""
