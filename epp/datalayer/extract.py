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
from dataclasses import dataclass, field, fields
from typing import Any

from epp.datalayer.engines import EngineMapping, Specs
from epp.datalayer.page_template import MAX_TEMPLATE_BYTES, PageTemplate
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
    """Read the mapping's metrics from a `/metrics` body. Raises `MetricsParseError`.

    With the endpoint's `memory` a page is read only as far as it changed: the same bytes again
    are the same extraction (`_again`); a page that matches the last one's template (only the
    numbers read moved, `page_template`) has those numbers read and checked, nothing else; a page
    whose wanted lines kept their labels has its values read again (`_values_moved`); any other
    page is read in full. Each gives what reading it in full would give."""
    # An exporter that creates a gauge on its first use (TGI's): a family appearing is news at once.
    shortcuts = memory is not None and not mapping.first_use_prefix
    last = memory.result if memory is not None and isinstance(memory.result, _Remembered) else None
    if shortcuts and last is not None:
        quick = _quick(mapping, body, previous, now, memory, last)  # type: ignore[arg-type]
        if quick is not None:
            return quick
    recheck = 0 if mapping.first_use_prefix else None
    samples = parse_wanted(body, mapping.primary, memory, recheck_absent=recheck)
    if mapping.fallback.names and (
            any(len(f) > 1 and f[0].name not in samples for f in mapping.fields())
            or (len(mapping.itl) > 1 and f"{mapping.itl[0].name}_count" not in samples)):
        unchanged = memory is not None and memory.unchanged
        same_labels = memory is not None and memory.same_labels
        complete = memory is not None and memory.complete
        samples.update(parse_wanted(body, mapping.fallback, memory, recheck_absent=recheck))
        if memory is not None:
            memory.unchanged = unchanged and memory.unchanged
            memory.same_labels = same_labels and memory.same_labels
            memory.complete = complete and memory.complete
    if memory is None:
        return _extract(mapping, body, samples, previous, now)[0]
    result: Extraction | None = None
    totals: tuple[float, float] | None = None
    if shortcuts and last is not None:
        if memory.unchanged:
            result, totals = _again(last, previous, now), last.totals
        elif memory.same_labels:
            moved = _values_moved(mapping, samples, previous, now, last)
            if moved is not None:
                result, totals = moved
    if result is None:
        result, totals = _extract(mapping, body, samples, previous, now)
    shape = last.shape if last is not None else _Shape()
    if shortcuts:
        _remake_template(shape, mapping, body, memory, result, samples)
    known = body if memory.complete and len(body) <= MAX_REMEMBERED_BYTES else b""
    memory.result = _Remembered(result, totals, previous, samples, known, shape)
    return result


# A page this large is not kept to be known again (a pod's memory, whatever it sends; a vLLM page
# is ~55 KB whole, ~2 KB asked for its series).
MAX_REMEMBERED_BYTES = 256 << 10


def _quick(mapping: EngineMapping, body: bytes, previous: EndpointMetrics, now: float, memory: PageMemory,
           last: _Remembered) -> Extraction | None:
    """The extraction of a page that is the last one again, or matches its template; None when
    the page must be parsed."""
    if last.body and body == last.body:  # (an unchanged page of an idle pod: one memcmp)
        again = _again(last, previous, now)
        if again is None:
            return None
        memory.unchanged = memory.same_labels = memory.complete = True
        memory.result = _Remembered(again, last.totals, previous, last.samples, body, last.shape)
        return again
    shape = last.shape
    template, plan = shape.template, shape.plan
    if template is None or plan is None:
        return None
    tokens = template.values(body)
    if tokens is None:  # the page changed shape: parse it (and make a new template of it)
        shape.template = shape.plan = None
        if not shape.matched:
            shape.misses += 1
        return None
    shape.matched = True
    shape.misses = 0
    done = last.extraction
    if done.metrics is None or previous is not done.metrics:
        return None
    found: dict[str, Any] = {}
    try:
        for index, key, check in plan.fields:
            value = float(tokens[index])
            if check(value):
                return None  # out of bounds: the full extraction names every invalid value
            found[key] = value if check is fraction_error else int(value)
        totals: tuple[float, float] | None = None
        if plan.itl is not None:
            sums, counts = plan.itl
            totals = (sum(float(tokens[i]) for i in sums), sum(float(tokens[i]) for i in counts))
            if total_error(totals[0]) or total_error(totals[1]):
                return None
            _read_itl(totals, previous, found)
    except ValueError:
        return None  # not a number: the parser says where
    again = Extraction(_updated(previous, now, found), done.problems)
    memory.unchanged = False
    memory.same_labels = memory.complete = True
    memory.result = _Remembered(again, totals, previous, shape.samples, body, shape)
    return again


@dataclass(slots=True, frozen=True)
class _Plan:
    """What `_values_moved` would read from a page that matches a template, found once: the token
    of the series that wins each value field (`_latest`: which one wins is a matter of labels and
    timestamps, the template's literal bytes) and the tokens the ITL histogram's totals add up."""

    fields: tuple[tuple[int, str, Check], ...]  # token, field, bounds
    itl: tuple[tuple[int, ...], tuple[int, ...]] | None  # the sum's tokens, the count's

    @classmethod
    def of(cls, mapping: EngineMapping, template: PageTemplate, samples: dict[str, list[Sample]]) -> _Plan | None:
        token: dict[int, int] = {}  # id(sample) -> its value's token
        for name, first, count in template.families:
            lines = samples.get(name, [])
            if len(lines) != count:
                return None
            token.update((id(sample), first + k) for k, sample in enumerate(lines))
        fields: list[tuple[int, str, Check]] = []
        for specs, key, check in _value_fields(mapping):
            sample = _latest(specs, samples) if specs else None
            if sample is not None:  # (absent: one of the problems the extraction reported)
                if id(sample) not in token:
                    return None
                fields.append((token[id(sample)], key, check))
        itl = None
        for spec in mapping.itl:  # as `_histogram_totals`: the first alternative present
            sums, counts = samples.get(f"{spec.name}_sum"), samples.get(f"{spec.name}_count")
            if sums and counts:
                chosen = ([s for s in sums if spec.matches(s.labels)], [s for s in counts if spec.matches(s.labels)])
                if any(id(s) not in token for s in (*chosen[0], *chosen[1])):
                    return None
                itl = (tuple(token[id(s)] for s in chosen[0]), tuple(token[id(s)] for s in chosen[1]))
                break
        return cls(tuple(fields), itl)


def _remake_template(shape: _Shape, mapping: EngineMapping, body: bytes, memory: PageMemory, result: Extraction,
                     samples: dict[str, list[Sample]]) -> None:
    """After a parse, a template of the page if it has none that fits: a small page, every family
    looked for, values valid. Templates that no page matched (a page whose other numbers move,
    or whose labels do) are not made again for a while: each costs a regex compile."""
    if shape.template is not None or not memory.complete or result.metrics is None \
            or len(body) > MAX_TEMPLATE_BYTES:
        return
    if shape.wait > 0:
        shape.wait -= 1
        return
    if shape.misses >= _TEMPLATE_MISSES:
        shape.misses = 0
        shape.wait = _TEMPLATE_WAIT
        return
    template = PageTemplate.of(body, memory, _value_names(mapping))
    plan = _Plan.of(mapping, template, samples) if template is not None else None
    shape.template, shape.plan = (template, plan) if plan is not None else (None, None)
    shape.samples = samples
    shape.matched = False


_TEMPLATE_MISSES = 2  # templates in a row that no page matched ...
_TEMPLATE_WAIT = 20  # ... and the parses before the next one is made


def _value_names(mapping: EngineMapping) -> tuple[str, ...]:
    """The families whose values the extraction reads as numbers (not by their labels)."""
    names = [spec.name for specs, _, _ in _value_fields(mapping) for spec in specs]
    names += [f"{spec.name}{suffix}" for spec in mapping.itl for suffix in ("_sum", "_count")]
    return tuple(dict.fromkeys(names))


_METRIC_FIELDS = tuple(f.name for f in fields(EndpointMetrics))


def _updated(previous: EndpointMetrics, now: float, found: dict[str, Any]) -> EndpointMetrics:
    """`dataclasses.replace(previous, update_time=now, **found)` at half its cost (every poll)."""
    found["update_time"] = now
    return EndpointMetrics(*[found[name] if name in found else getattr(previous, name) for name in _METRIC_FIELDS])


@dataclass(slots=True, eq=False)
class _Shape:
    """One endpoint's page as a template (`page_template`), with the samples read from the page
    it was made of (their labels and timestamps are the template's literal bytes)."""

    template: PageTemplate | None = None
    plan: _Plan | None = None  # what to read from a page that matches it
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    matched: bool = False  # a page matched the template since it was made
    misses: int = 0  # templates in a row that no page matched
    wait: int = 0  # parses before a template is made again


@dataclass(slots=True)
class _Remembered:
    """An extraction and what it was made from, for a page that comes back the same (made on
    every poll and never changed: not frozen, which would cost a microsecond each time)."""

    extraction: Extraction
    totals: tuple[float, float] | None  # the ITL histogram's (sum, count), None if absent
    previous: EndpointMetrics
    # What was read (a family's list is reused while its lines stay the same). After a template
    # match, the template page's samples: the families read by their labels (the cache config,
    # LoRA) are what they hold, and only those are compared with the next parse's.
    samples: dict[str, list[Sample]]
    body: bytes  # the page, when its parse looked for every family (b"": not), to know it again
    shape: _Shape


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
            longest = _max_model_len(info)
            if longest:
                found["max_model_len"] = longest
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


MAX_MODEL_LEN = 100_000_000  # tokens: a larger reading is not believed


def _max_model_len(info: Sample) -> int:
    """vLLM's max_model_len, from its cache config (`kv_cache_size_tokens / kv_cache_max_concurrency`:
    it has no label of its own), or 0 when the labels are absent (older engines) or not sensible
    (what a pod writes is bounded before it bounds anything)."""
    size, concurrency = info.labels.get("kv_cache_size_tokens"), info.labels.get("kv_cache_max_concurrency")
    if size is None or concurrency is None or len(size) > 32 or len(concurrency) > 32:
        return 0
    try:
        longest = float(size) / float(concurrency)
    except (ValueError, ZeroDivisionError):
        return 0
    return round(longest) if math.isfinite(longest) and 1.0 <= longest <= MAX_MODEL_LEN else 0


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
