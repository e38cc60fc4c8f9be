"""Seeded random distributions for workload sizes and times, read from YAML.

A distribution is a number (a constant) or a mapping with `dist` and its parameters:

    512                                         constant
    {dist: constant, value: 512}
    {dist: uniform, min: 100, max: 900}
    {dist: normal, mean: 500, std: 100}
    {dist: lognormal, mean: 500, sigma: 0.8}    mean of the distribution, sigma of its log
    {dist: exponential, mean: 5}
    {dist: pareto, min: 100, alpha: 1.5}        heavy tail
    {dist: choice, values: [64, 4096], weights: [0.9, 0.1]}
    {dist: mix, of: [{weight: 0.9, dist: ...}, {weight: 0.1, dist: ...}]}

Every form also takes `min` and `max` clamps (for `uniform` they are its bounds). Draws use a
caller-supplied `random.Random`, so a seed fixes the whole workload.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

from epp.params import ConfigError, Params

KINDS = ("constant", "uniform", "normal", "lognormal", "exponential", "pareto", "choice", "mix")


@dataclass(slots=True, frozen=True)
class Dist:
    """One distribution; `sample(rng)` draws a float, `sample_int(rng)` a rounded count."""

    kind: str
    a: float = 0.0  # constant value | uniform min | normal/lognormal/exponential mean | pareto min
    b: float = 0.0  # uniform max | normal std | lognormal sigma | pareto alpha
    lo: float = -math.inf
    hi: float = math.inf
    values: tuple[float, ...] = ()
    parts: tuple[Dist, ...] = ()
    cum_weights: tuple[float, ...] = ()

    def sample(self, rng: random.Random) -> float:
        k = self.kind
        if k == "constant":
            v = self.a
        elif k == "uniform":
            v = rng.uniform(self.a, self.b)
        elif k == "normal":
            v = rng.gauss(self.a, self.b)
        elif k == "lognormal":
            v = rng.lognormvariate(math.log(self.a) - self.b * self.b / 2, self.b)
        elif k == "exponential":
            v = rng.expovariate(1.0 / self.a)
        elif k == "pareto":
            v = self.a * rng.paretovariate(self.b)
        elif k == "choice":
            v = self.values[bisect.bisect(self.cum_weights, rng.random() * self.cum_weights[-1])]
        else:  # mix
            part = self.parts[bisect.bisect(self.cum_weights, rng.random() * self.cum_weights[-1])]
            v = part.sample(rng)
        return self.lo if v < self.lo else self.hi if v > self.hi else v

    def sample_int(self, rng: random.Random, minimum: int = 1) -> int:
        return max(minimum, int(round(self.sample(rng))))

    @property
    def mean(self) -> float:
        """The (unclamped) mean, for capacity estimates in reports."""
        k = self.kind
        if k == "constant":
            return self.a
        if k == "uniform":
            return (self.a + self.b) / 2
        if k in ("normal", "lognormal", "exponential"):
            return self.a
        if k == "pareto":
            return self.a * self.b / (self.b - 1) if self.b > 1 else math.inf
        weights = [w - p for w, p in zip(self.cum_weights, (0.0, *self.cum_weights[:-1]))]
        items = self.values if k == "choice" else tuple(p.mean for p in self.parts)
        return sum(w * v for w, v in zip(weights, items)) / self.cum_weights[-1]


def constant(value: float) -> Dist:
    return Dist("constant", a=float(value))


def parse_dist(raw: Any, path: str) -> Dist:
    """Read a distribution (see the module doc); errors name the field path."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return constant(raw)
    p = Params(raw, path)
    kind = p.str("dist", "", choices=KINDS)
    if not kind:
        raise p.error("dist", f"required (one of {', '.join(KINDS)})")
    lo = p.float("min", -math.inf)
    hi = p.float("max", math.inf)
    if lo > hi:
        raise p.error("max", "must be >= min")
    if kind == "constant":
        d = Dist(kind, a=_required(p, "value"), lo=lo, hi=hi)
    elif kind == "uniform":
        if not (p.has("min") and p.has("max")):
            raise p.error("min", "uniform needs min and max")
        d = Dist(kind, a=lo, b=hi, lo=lo, hi=hi)
    elif kind == "normal":
        d = Dist(kind, a=_required(p, "mean"), b=p.float("std", 0.0, min=0.0), lo=lo, hi=hi)
    elif kind == "lognormal":
        mean = _required(p, "mean")
        if mean <= 0:
            raise p.error("mean", "must be > 0")
        d = Dist(kind, a=mean, b=p.float("sigma", 0.5, min=0.0), lo=lo, hi=hi)
    elif kind == "exponential":
        mean = _required(p, "mean")
        if mean <= 0:
            raise p.error("mean", "must be > 0")
        d = Dist(kind, a=mean, lo=lo, hi=hi)
    elif kind == "pareto":
        scale = lo if lo > -math.inf else 1.0
        d = Dist(kind, a=scale, b=p.float("alpha", 1.5, min=0.0, min_exclusive=True), lo=lo, hi=hi)
    elif kind == "choice":
        values = p.list("values")
        if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise p.error("values", "must be a non-empty list of numbers")
        weights = _weights(p, len(values))
        d = Dist(kind, values=tuple(float(v) for v in values), cum_weights=weights, lo=lo, hi=hi)
    else:
        entries = p.list("of")
        if not entries:
            raise p.error("of", "must be a non-empty list of {weight, dist, ...}")
        parts, ws = [], []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise ConfigError(f"{path}.of[{i}]: must be a mapping")
            entry = dict(entry)
            w = entry.pop("weight", 1.0)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w <= 0:
                raise ConfigError(f"{path}.of[{i}].weight: must be a number > 0")
            parts.append(parse_dist(entry, f"{path}.of[{i}]"))
            ws.append(float(w))
        d = Dist(kind, parts=tuple(parts), cum_weights=tuple(itertools.accumulate(ws)), lo=lo, hi=hi)
    p.done()
    return d


def _required(p: Params, key: str) -> float:
    if not p.has(key):
        raise p.error(key, "required")
    return p.float(key, 0.0)


def _weights(p: Params, n: int) -> tuple[float, ...]:
    raw = p.list("weights")
    if not raw:
        return tuple(float(i + 1) for i in range(n))
    if len(raw) != n or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in raw):
        raise p.error("weights", f"must be {n} numbers >= 0")
    if sum(raw) <= 0:
        raise p.error("weights", "must not all be 0")
    return tuple(itertools.accumulate(float(w) for w in raw))
