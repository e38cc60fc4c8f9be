"""Bounded label values for the EPP's own metrics: nothing a client or a pod sends can grow them.

Every label value that comes from outside — the request's `model` and rewrite target, the
fairness id header, the priority an objective gives, an endpoint's pod name — goes through a
`LabelGuard` before it reaches a series. Without it one request with a 1 MiB `model` once grew
`/metrics` from 3.9 MB to 431 MB for good, and a stream of new names grew it without end.

The rules, per value (`Kind`):
- a *model* keeps its name only when this pool is known to serve it (`KnownModels`: the names
  the pods report, their LoRA adapters, configured names); any other name is `other`;
- any value longer than `MAX_LABEL_CHARS` is `other`;
- each kind has a cap on distinct values (`LabelLimits`); values beyond it, first come first
  kept, are `other`;
- each metric family, and all of them together, have a budget of exposition lines (a histogram's
  label set costs one line per bucket plus `_sum`, `_count`, `_created`); a label set that would
  exceed it is folded: its model, fairness and endpoint values become `other` (a priority, one of
  at most `LabelLimits.priorities`, is kept).
A folded value is never dropped, only renamed, so every request is still counted exactly; each
fold is counted in `inference_extension_metric_labels_folded_total{metric, label, reason}`.

A family's folded label sets (`other` in those positions, the rest priorities or enum values such
as a status or an outcome) are always admitted, so the budget can be exceeded only by that
bounded set.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from epp.datastore import Datastore

OTHER = "other"
MAX_LABEL_CHARS = 256  # a Hugging Face repo id is at most 96; pod names at most 253


class Kind(enum.Enum):
    """Where a guarded label value comes from, so which rule bounds it."""

    MODEL = "model"  # request body / rewrite header: only names the pool serves
    FAIRNESS = "fairness"  # client header: first come, capped
    PRIORITY = "priority"  # from InferenceObjectives: capped
    ENDPOINT = "endpoint"  # discovery (pod name, namespace, port): capped over pod churn


# Folded when a label set does not fit the series budget (priorities are few: capped, kept).
_FOLD_ON_BUDGET = frozenset({Kind.MODEL, Kind.FAIRNESS, Kind.ENDPOINT})


class Reason(str, enum.Enum):
    """Why a value became `other` (the `reason` label of the folded counter)."""

    UNKNOWN_MODEL = "unknown_model"
    TOO_LONG = "too_long"
    TOO_MANY_VALUES = "too_many_values"
    SERIES_BUDGET = "series_budget"


@dataclass(slots=True, frozen=True)
class LabelLimits:
    """Caps on distinct values per kind and on exposition lines (`--metrics-max-series`)."""

    models: int = 256
    fairness_ids: int = 100
    priorities: int = 64
    endpoints: int = 1024
    series: int = 10_000  # exposition lines over all guarded families
    family_series: int = 0  # per family; 0: a quarter of `series`

    def per_family(self) -> int:
        return self.family_series or max(1, self.series // 4)

    def distinct(self, kind: Kind) -> int:
        return {Kind.MODEL: self.models, Kind.FAIRNESS: self.fairness_ids, Kind.PRIORITY: self.priorities,
                Kind.ENDPOINT: self.endpoints}[kind]


class KnownModels:
    """The model names this pool serves, from the datastore (each endpoint's reported models and
    LoRA adapters), configured names and extra sources (e.g. model rewrites).

    Re-read at most once per `refresh` seconds, and only when a name is not found, so a stream of
    unknown names costs one pass over the endpoints per second, not one per request."""

    def __init__(self, datastore: Datastore | None, configured: Iterable[str] = (), *, refresh: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.datastore = datastore
        self.configured = frozenset(configured)
        self.sources: list[Callable[[], Iterable[str]]] = []
        self.refresh = refresh
        self.clock = clock
        self._names: frozenset[str] = self.configured
        self._read_at = -float("inf")

    def add_source(self, source: Callable[[], Iterable[str]]) -> None:
        """Another provider of served names (read on the next refresh)."""
        self.sources.append(source)
        self._read_at = -float("inf")

    def __contains__(self, name: str) -> bool:
        if name in self._names:
            return True
        now = self.clock()
        if now - self._read_at < self.refresh:
            return False
        self._read_at = now
        self._names = self._read()
        return name in self._names

    def _read(self) -> frozenset[str]:
        names = set(self.configured)
        if self.datastore is not None:
            for endpoint in self.datastore.endpoints():
                m = endpoint.metrics
                names.update(m.models, m.active_models, m.waiting_models)
        for source in self.sources:
            names.update(source())
        return frozenset(names)


class LabelGuard:
    """The bounds shared by every family of one metrics registry."""

    def __init__(self, limits: LabelLimits, known_models: KnownModels, folded: Counter) -> None:
        self.limits = limits
        self.known_models = known_models
        self.folded = folded
        self.series = 0  # exposition lines admitted so far, over all families
        self._values: dict[Kind, set[str]] = {kind: set() for kind in Kind}

    def value(self, kind: Kind, value: str) -> tuple[str, Reason | None]:
        """The label value to use for `value`, and why it was folded (None: kept)."""
        kept = self._values[kind]
        if value in kept or not value:
            return value, None
        if len(value) > MAX_LABEL_CHARS:
            return OTHER, Reason.TOO_LONG
        if kind is Kind.MODEL and value not in self.known_models:
            return OTHER, Reason.UNKNOWN_MODEL
        if len(kept) >= self.limits.distinct(kind):
            return OTHER, Reason.TOO_MANY_VALUES
        kept.add(value)
        return value, None

    def count_fold(self, family: str, label: str, reason: Reason) -> None:
        self.folded.labels(family, label, reason.value).inc()


class BoundedFamily:
    """The admitted label sets of one metric family (or of several gauges updated together).

    `admit(values)` maps raw label values to the ones to use; the caller then calls
    `.labels(*admitted)` on its prometheus_client metric(s). `kinds` has one entry per label:
    a `Kind` for guarded values, None for values the EPP itself chooses (status, outcome, ...).
    `weight` is the exposition lines one label set costs."""

    def __init__(self, guard: LabelGuard, name: str, label_names: Sequence[str],
                 kinds: Sequence[Kind | None], weight: int) -> None:
        if len(label_names) != len(kinds):
            raise ValueError("one kind per label")
        self.guard = guard
        self.name = name
        self.label_names = tuple(label_names)
        self.kinds = tuple(kinds)
        self.weight = weight
        self.series = 0  # lines of this family
        self._admitted: set[tuple[str, ...]] = set()

    def admit(self, values: tuple[str, ...]) -> tuple[str, ...]:
        if values in self._admitted:  # the common case: values seen before, all within bounds
            return values
        guard = self.guard
        out = list(values)
        for i, kind in enumerate(self.kinds):
            if kind is not None:
                out[i], reason = guard.value(kind, out[i])
                if reason is not None:
                    guard.count_fold(self.name, self.label_names[i], reason)
        labels = tuple(out)
        if labels in self._admitted:
            return labels
        limits = guard.limits
        if self.series + self.weight > limits.per_family() or guard.series + self.weight > limits.series:
            folded = tuple(OTHER if kind in _FOLD_ON_BUDGET else v for v, kind in zip(labels, self.kinds))
            for i, kind in enumerate(self.kinds):
                if kind in _FOLD_ON_BUDGET and labels[i] != OTHER:
                    guard.count_fold(self.name, self.label_names[i], Reason.SERIES_BUDGET)
            labels = folded
            if labels in self._admitted:
                return labels
        self._admitted.add(labels)
        self.series += self.weight
        guard.series += self.weight
        return labels

    def release(self, labels: tuple[str, ...]) -> None:
        """A label set's series were removed (a gauge of a flow that left): free its budget."""
        if labels in self._admitted:
            self._admitted.remove(labels)
            self.series -= self.weight
            self.guard.series -= self.weight
