"""One scrape body + an engine mapping → a new immutable `EndpointMetrics`.

Semantics follow the reference extractor (§6.1): for ordinary fields the matching series with the
newest exposition timestamp wins (first one on a tie, e.g. when no timestamps are written); for
LoRA the series with the largest *value* (a creation time) wins. Fields not found keep their
previous value, and the result exists only if at least one field was read, so `update_time`
advances only on a useful scrape. A missing LoRA metric is normal (LoRA off) and not reported.

Every value read is checked against its kind's bounds (`validate`). One value out of bounds makes
the whole scrape invalid: `Extraction.metrics` is None and `invalid` says which metric and why,
so the endpoint keeps its previous (valid) metrics and nothing is clamped. The model names the
server reports (the `model_name` label on the series read) are kept in `EndpointMetrics.models`:
they tell the EPP's own metrics which names this pool serves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from epp.datalayer.engines import EngineMapping, Specs
from epp.datalayer.promparse import PageMemory, Sample, parse_wanted
from epp.datalayer.validate import (
    Invalid,
    block_size_error,
    count_error,
    fraction_error,
    limit_error,
    name_bytes_error,
    names_error,
    num_blocks_error,
    total_error,
)
from epp.datastore import EndpointMetrics

_NO_TIMESTAMP = -math.inf
MODEL_LABEL = "model_name"  # the label vLLM and SGLang put the served model's name in

Check = Callable[[float], str]


@dataclass(slots=True, frozen=True)
class Extraction:
    """`metrics` is None when nothing could be read or a value was out of bounds; `problems`
    names what was missing or unreadable, `invalid` what was out of bounds."""

    metrics: EndpointMetrics | None
    problems: tuple[str, ...] = ()
    invalid: tuple[Invalid, ...] = ()


def extract_metrics(mapping: EngineMapping, body: bytes, previous: EndpointMetrics, now: float,
                    memory: PageMemory | None = None) -> Extraction:
    """Read the mapping's metrics from a `/metrics` body. Raises `MetricsParseError`."""
    # An exporter that creates a gauge on its first use (TGI's): a family appearing is news at once.
    recheck = 0 if mapping.first_use_prefix else None
    samples = parse_wanted(body, mapping.primary, memory, recheck_absent=recheck)
    if mapping.fallback.names and (
            any(len(f) > 1 and f[0].name not in samples for f in mapping.fields())
            or (len(mapping.itl) > 1 and f"{mapping.itl[0].name}_count" not in samples)):
        unchanged = memory is not None and memory.unchanged
        same_labels = memory is not None and memory.same_labels
        samples.update(parse_wanted(body, mapping.fallback, memory, recheck_absent=recheck))
        if memory is not None:
            memory.unchanged = unchanged and memory.unchanged
            memory.same_labels = same_labels and memory.same_labels
    if memory is not None:
        last = memory.result
        if isinstance(last, _Remembered) and not mapping.first_use_prefix:
            if memory.unchanged:
                again = _again(last, previous, now)
                if again is not None:
                    memory.result = _Remembered(again, last.totals, previous, samples)
                    return again
            elif memory.same_labels:
                moved = _values_moved(mapping, samples, previous, now, last)
                if moved is not None:
                    memory.result = _Remembered(moved[0], moved[1], previous, samples)
                    return moved[0]
        result, totals = _extract(mapping, body, samples, previous, now)
        memory.result = _Remembered(result, totals, previous, samples)
        return result
    return _extract(mapping, body, samples, previous, now)[0]


_METRIC_FIELDS = tuple(f.name for f in fields(EndpointMetrics))


def _updated(previous: EndpointMetrics, now: float, found: dict[str, Any]) -> EndpointMetrics:
    """`dataclasses.replace(previous, update_time=now, **found)` at half its cost (every poll)."""
    found["update_time"] = now
    return EndpointMetrics(*[found[name] if name in found else getattr(previous, name) for name in _METRIC_FIELDS])


@dataclass(slots=True, frozen=True)
class _Remembered:
    """An extraction and what it was made from, for a page that comes back the same."""

    extraction: Extraction
    totals: tuple[float, float] | None  # the ITL histogram's (sum, count), None if absent
    previous: EndpointMetrics
    samples: dict[str, list[Sample]]  # what was read (a family's list is reused while its lines stay the same)


def _again(last: _Remembered, previous: EndpointMetrics, now: float) -> Extraction | None:
    """The extraction of a page whose wanted lines are byte-identical to the last one's, without
    redoing it: the same values (only the scrape time moves, and an ITL window with no new
    tokens on an idle pod reads 0), the same problems, the same invalid values. None when the
    endpoint's metrics are not the ones that extraction left (then it is done in full)."""
    done = last.extraction
    if done.metrics is None:
        return done if previous is last.previous else None
    if previous is not done.metrics:
        return None
    found: dict[str, Any] = {}
    if last.totals is not None:
        _read_itl(last.totals, previous, found)
    return Extraction(_updated(previous, now, found), done.problems)


def _values_moved(mapping: EngineMapping, samples: dict[str, list[Sample]], previous: EndpointMetrics, now: float,
                  last: _Remembered) -> tuple[Extraction, tuple[float, float] | None] | None:
    """The extraction of a page whose wanted lines have the label sets of the last one's (a busy
    pod's: only numbers moved), redoing only what numbers decide: the value fields and the ITL
    window, read and checked again. What labels decide (the model names, the cache config, the
    problems) stands as the last extraction left it in `previous`. None when the full extraction
    must decide: the last one was not valid or `previous` is not its result, the cache config or
    LoRA lines changed (which of their series wins can move with a timestamp or a value), or a
    value is out of bounds (the full extraction names every invalid value)."""
    done = last.extraction
    if done.metrics is None or previous is not done.metrics:
        return None
    for spec in (*mapping.cache_info, *mapping.lora):
        if samples.get(spec.name) is not last.samples.get(spec.name):
            return None
    found: dict[str, Any] = {}
    invalid: list[Invalid] = []
    problems: list[str] = []  # the same as last time: which series exist is a matter of labels
    for specs, key, check in _value_fields(mapping):
        value = _latest_value(specs, samples, problems, check, invalid)
        if value is not None:
            found[key] = value if check is fraction_error else int(value)
    totals = _histogram_totals(mapping.itl, samples, invalid) if mapping.itl else None
    if invalid:
        return None
    if totals is not None:
        _read_itl(totals, previous, found)
    return Extraction(_updated(previous, now, found), done.problems), totals


def _value_fields(mapping: EngineMapping) -> tuple[tuple[Specs, str, Check], ...]:
    """The fields read from a series' value, with their bounds."""
    return ((mapping.queued, "waiting_queue_size", count_error), (mapping.running, "running_requests", count_error),
            (mapping.kv_usage, "kv_cache_usage", fraction_error),
            (mapping.cache_block_size, "cache_block_size", block_size_error),
            (mapping.cache_num_blocks, "cache_num_blocks", num_blocks_error))


def _extract(mapping: EngineMapping, body: bytes, samples: dict[str, list[Sample]], previous: EndpointMetrics,
             now: float) -> tuple[Extraction, tuple[float, float] | None]:
    totals: tuple[float, float] | None = None
    found: dict[str, Any] = {}
    problems: list[str] = []
    invalid: list[Invalid] = []

    for specs, key, check in ((mapping.queued, "waiting_queue_size", count_error),
                              (mapping.running, "running_requests", count_error),
                              (mapping.kv_usage, "kv_cache_usage", fraction_error)):
        if (check is count_error and mapping.first_use_prefix and specs and _latest(specs, samples) is None
                and _unstarted(mapping, body)):
            found[key] = 0  # the exporter creates the gauge on first use: nothing has happened yet
            continue
        value = _latest_value(specs, samples, problems, check, invalid)
        if value is not None:
            found[key] = value if check is fraction_error else int(value)
    models = _model_names((mapping.queued, mapping.running, mapping.kv_usage), samples)
    if models:
        error = names_error(models, "model name")
        if error:
            invalid.append(Invalid(MODEL_LABEL, error))
        else:
            found["models"] = models

    if mapping.lora:
        lora = _largest(mapping.lora, samples)
        if lora is not None:
            _read_lora(lora, found, problems, invalid)

    if mapping.cache_info:
        info = _latest(mapping.cache_info, samples)
        if info is None:
            problems.append(f"{_describe(mapping.cache_info)}: not found")
        else:
            for label, key, check in ((mapping.cache_block_size_label, "cache_block_size", block_size_error),
                                      (mapping.cache_num_blocks_label, "cache_num_blocks", num_blocks_error)):
                number = _int_label(info, label, problems, check, invalid)
                if number is not None:
                    found[key] = number
    for specs, key, check in ((mapping.cache_block_size, "cache_block_size", block_size_error),
                              (mapping.cache_num_blocks, "cache_num_blocks", num_blocks_error)):
        value = _latest_value(specs, samples, problems, check, invalid)
        if value is not None:
            found[key] = int(value)

    if mapping.itl:
        totals = _histogram_totals(mapping.itl, samples, invalid)
        if totals is not None:  # absent is not a problem: the ITL gate then treats it as unknown
            _read_itl(totals, previous, found)

    if not invalid and ("models" in found or "active_models" in found or "waiting_models" in found):
        error = name_bytes_error(found.get("models", previous.models), found.get("active_models", previous.active_models),
                                 found.get("waiting_models", previous.waiting_models))
        if error:
            adapters = found.get("active_models") or found.get("waiting_models")
            invalid.append(Invalid(mapping.lora[0].name if adapters and mapping.lora else MODEL_LABEL, error))
    if invalid:
        return Extraction(None, tuple(problems), tuple(invalid)), totals
    if not found:
        return Extraction(None, tuple(problems)), totals
    return Extraction(_updated(previous, now, found), tuple(problems)), totals


def _unstarted(mapping: EngineMapping, body: bytes) -> bool:
    """An exporter of the engine that has created no gauge yet: empty, or only its other metrics."""
    return not body or body.isspace() or mapping.first_use_prefix.encode() in body


def _model_names(fields: tuple[Specs, ...], samples: dict[str, list[Sample]]) -> frozenset[str]:
    """The `model_name` label values on the series the fields read (one per engine in vLLM)."""
    names: set[str] = set()
    for specs in fields:
        for spec in specs:
            for sample in samples.get(spec.name, ()):
                name = sample.labels.get(MODEL_LABEL)
                if name and spec.matches(sample.labels):
                    names.add(name)
    return frozenset(names)


def _histogram_totals(specs: Specs, samples: dict[str, list[Sample]],
                      invalid: list[Invalid]) -> tuple[float, float] | None:
    """(sum, count) of a histogram over the matching series (engines, models) of the first
    alternative present: the pod-wide mean is what a dispatch decision needs. The fast parser
    reads a name's first contiguous run of lines, so where an exposition interleaves series
    (`_count`/`_sum` per label set) the first series stands for the pod; sum and count then
    still come from the same series."""
    for spec in specs:
        sums = samples.get(f"{spec.name}_sum")
        counts = samples.get(f"{spec.name}_count")
        if not sums or not counts:
            continue
        total = sum(s.value for s in sums if spec.matches(s.labels))
        count = sum(s.value for s in counts if spec.matches(s.labels))
        for name, value in ((f"{spec.name}_sum", total), (f"{spec.name}_count", count)):
            error = total_error(value)
            if error:
                invalid.append(Invalid(name, error))
                return None
        return total, count
    return None


def _read_itl(totals: tuple[float, float], previous: EndpointMetrics, found: dict[str, Any]) -> None:
    """Mean inter-token latency over the window since the previous scrape.

    No tokens in the window: an idle pod has no latency (0.0); a busy one keeps its last value
    (a window can be shorter than one token). The first scrape, or counters that went backwards
    (a restarted server), only set the baseline.
    """
    total, count = totals
    found["itl_sum"], found["itl_count"] = total, count
    d_sum, d_count = total - previous.itl_sum, count - previous.itl_count
    if previous.update_time == 0.0 or d_count < 0 or d_sum < 0:
        return
    if d_count > 0:
        found["inter_token_latency"] = d_sum / d_count
    elif found.get("running_requests", previous.running_requests) == 0:
        found["inter_token_latency"] = 0.0


def _latest(specs: Specs, samples: dict[str, list[Sample]]) -> Sample | None:
    """The matching series with the newest timestamp, from the first alternative that has one."""
    for spec in specs:
        best: Sample | None = None
        best_ts = _NO_TIMESTAMP
        for sample in samples.get(spec.name, ()):
            if spec.matches(sample.labels):
                ts = _NO_TIMESTAMP if sample.timestamp is None else sample.timestamp
                if best is None or ts > best_ts:
                    best, best_ts = sample, ts
        if best is not None:
            return best
    return None


def _largest(specs: Specs, samples: dict[str, list[Sample]]) -> Sample | None:
    """The matching series with the largest finite value: the newest LoRA state (the value is
    only a creation time that picks the series, never a signal)."""
    for spec in specs:
        best: Sample | None = None
        for sample in samples.get(spec.name, ()):
            if spec.matches(sample.labels) and math.isfinite(sample.value) \
                    and (best is None or sample.value > best.value):
                best = sample
        if best is not None:
            return best
    return None


def _latest_value(specs: Specs, samples: dict[str, list[Sample]], problems: list[str], check: Check,
                  invalid: list[Invalid]) -> float | None:
    """The field's value, or None when it is absent (a problem) or out of bounds (invalid)."""
    if not specs:
        return None
    sample = _latest(specs, samples)
    if sample is None:
        problems.append(f"{_describe(specs)}: not found")
        return None
    error = check(sample.value)
    if error:
        invalid.append(Invalid(sample.name, error))
        return None
    return sample.value


def _read_lora(sample: Sample, found: dict[str, Any], problems: list[str], invalid: list[Invalid]) -> None:
    for label, key in (("running_lora_adapters", "active_models"), ("waiting_lora_adapters", "waiting_models")):
        adapters = _adapters(sample.labels.get(label, ""))
        error = names_error(adapters, "LoRA adapter name")
        if error:
            invalid.append(Invalid(sample.name, f"{label}: {error}"))
        else:
            found[key] = adapters
    if sample.labels.get("max_lora"):
        max_lora = _int_label(sample, "max_lora", problems, limit_error, invalid)
        if max_lora is not None:
            found["max_active_models"] = max_lora


def _adapters(csv: str) -> frozenset[str]:
    if not csv:
        return frozenset()
    return frozenset(name for name in (part.strip() for part in csv.split(",")) if name)


def _int_label(sample: Sample, label: str, problems: list[str], check: Check,
               invalid: list[Invalid]) -> int | None:
    """An integer label: absent or not a number is a problem (vLLM writes "None" before it knows),
    a number out of bounds is invalid."""
    text = sample.labels.get(label)
    if text is None:
        problems.append(f"{sample.name}: no label {label}")
        return None
    try:
        number = int(text) if len(text) <= 32 else None
    except ValueError:
        number = None
    if number is None:
        problems.append(f"{sample.name}: label {label}={text[:32]!r} is not an integer")
        return None
    error = check(float(number))
    if error:
        invalid.append(Invalid(sample.name, f"label {label}: {error}"))
        return None
    return number


def _describe(specs: Specs) -> str:
    return " or ".join(str(spec) for spec in specs)
